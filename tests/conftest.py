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


TIERS = ("unit", "integration", "e2e", "clients")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its tier, the folder it lives in: `-m unit` selects the fast tier (no server
    processes), `-m integration` real nats/redis/gRPC/gloo pieces, `-m e2e` whole stacks and faults, `-m clients`
    third-party clients against a whole stack (make test-clients installs them)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
