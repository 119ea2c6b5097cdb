"""A test carries the marker of its tier, the folder directly under tests/, however deep it sits: `-m unit` selects
tests/unit/gateway/ too (the marker once came from the parent folder's name, and the gateway tests escaped every
tier), and a file outside the tiers gets none."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import TESTS, tier_of

ROOT = TESTS.parent


@pytest.mark.parametrize(
    ("path", "tier"),
    [
        ("unit/test_x.py", "unit"),
        ("unit/gateway/test_x.py", "unit"),
        ("integration/a/b/test_x.py", "integration"),
        ("e2e/test_x.py", "e2e"),
        ("clients/test_x.py", "clients"),
        ("test_x.py", None),  # beside the tiers, not in one
        ("data/unit/test_x.py", None),  # a folder named like a tier deeper down is not the tier
    ],
)
def test_the_tier_is_the_folder_under_tests(path, tier):
    assert tier_of(TESTS / path) == tier


def test_tier_of_a_file_outside_tests_is_none(tmp_path):
    assert tier_of(tmp_path / "unit" / "test_x.py") is None


def test_marker_selects_tests_in_tier_subfolders():
    """What `-m unit` (and `make test`'s `-m "not slow"` split by tier) really selects, in a fresh collection."""
    gateway, top, other = (
        "tests/unit/gateway/test_tokenize.py",
        "tests/unit/test_tier_markers.py",
        "tests/e2e/test_e2e.py",
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "unit"]
        + [gateway, top, other],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    files = {line.partition("::")[0] for line in run.stdout.splitlines() if "::" in line}
    assert files == {gateway, top}
