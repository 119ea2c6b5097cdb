"""Fixtures shared across test modules, and the Triton set-up every tier needs.

Triton kernels run under the interpreter on CPU tensors where no GPU is present. TRITON_INTERPRET is read when a
function is decorated with @triton.jit, and triton.language's own helpers (tl.cdiv, tl.sum, ...) are decorated
when triton is first imported, so the variable is set here, before any test module of any tier is collected:
several import triton indirectly (llguidance.torch, torch's compile stack). On a CUDA machine it is left alone:
the kernels compile and the same tests run on the GPU (set TRITON_INTERPRET=1 by hand to interpret there too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's stacks test the disaggregated hand-off (KV pulled, transfer metrics and spans, which worker emits which
# token) with short prompts, which the gateway's default prefill path (auto) would compute on the decode worker: their
# gateways take every prompt down the remote path, as before the per-request choice existed. The prefill path's own
# tests set PDSERVE_PREFILL_PATH in their stack's environment (StackSpec.env wins over this one).
os.environ.setdefault("PDSERVE_PREFILL_PATH", "remote")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random-weight Qwen3-MoE checkpoint the real-stack tests serve, as model "demo" (its directory's
    name). Read-only: a module that needs another checkpoint defines its own."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("model") / "demo", arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The same tiny qwen3_moe checkpoint, written afresh for each module that loads it in process (engines, the
    gateway's tokenizer); a module that needs another architecture defines its own `checkpoint`."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    """`checkpoint`'s weights, loaded once per module: engines built over them share them (each engine has its own
    KV pool and scheduler)."""
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer(checkpoint)


TIERS = ("unit", "integration", "e2e", "clients")
TESTS = Path(__file__).parent


def tier_of(path: Path) -> str | None:
    """The tier of the test file at `path`: the folder directly under tests/ that holds it, at any depth
    (tests/unit/gateway/test_x.py is a unit test); None for a file outside every tier."""
    if not path.is_relative_to(TESTS):
        return None
    top = path.relative_to(TESTS).parts[0]
    return top if top in TIERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, the folder under tests/ it lives in: `-m unit` selects the fast tier (no
    server processes), `-m integration` real nats/redis/gRPC/gloo pieces, `-m e2e` whole stacks and faults,
    `-m clients` third-party clients against a whole stack (make test-clients installs them)."""
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
