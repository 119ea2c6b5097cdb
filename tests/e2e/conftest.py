"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.e2e_support import start_stack


@pytest.fixture(scope="module")
def stack(model_dir):
    """A whole stack (gateway, nats, redis, 1 prefill + 1 decode worker of one thread each) serving the module's
    `model_dir`, started once per module and stopped after its last test."""
    stack = start_stack(StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=1, threads_per_worker=1))
    yield stack
    stack.stop()
