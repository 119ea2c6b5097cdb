"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model.demo import write_demo_checkpoint


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random-weight Qwen3-MoE checkpoint the real-stack tests serve, as model "demo" (its directory's
    name). Read-only: a module that needs another checkpoint defines its own."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("model") / "demo", arch="qwen3_moe", size="tiny")
