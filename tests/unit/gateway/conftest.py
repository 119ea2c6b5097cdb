"""Fixtures of the gateway tests: a fresh fake backend, the app over it and an in-process client per test, on the
module's tiny demo checkpoint and its tokenizer (tests/conftest.py). A module overrides `fake` to script other
replies, or `app` to serve another backend or keep one app for the whole module."""

from __future__ import annotations

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from services.gateway import create_app
from tests.unit.gateway.harness import FakeBackend, settings_for


@pytest.fixture
def fake(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


@pytest.fixture
def app(checkpoint, fake) -> Litestar:
    return create_app(settings_for(checkpoint), fake)


@pytest.fixture
def client(app):
    """The app's client, its lifespan entered (the backend opened) for the test and left after it."""
    with TestClient(app) as c:
        yield c
