"""Fixtures of the gateway tests: one tiny demo checkpoint (its tokenizer) per module, a fresh fake backend and
an in-process client per test. A module overrides `fake` to script other replies."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from services.demo_model import write_demo_checkpoint
from services.gateway import create_app
from shared.model.tokenizer import Tokenizer
from tests.unit.gateway.harness import FakeBackend, settings_for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer(checkpoint)


@pytest.fixture
def fake(tokenizer):
    return FakeBackend(tokenizer)


@pytest.fixture
def client(checkpoint, fake):
    with TestClient(create_app(settings_for(checkpoint), fake)) as c:
        yield c
