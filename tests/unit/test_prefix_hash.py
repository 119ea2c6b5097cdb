"""Prefix-cache block hashes (shared/prefix_hash.py): chained, full blocks only, salted."""

from __future__ import annotations

import pytest

from shared.prefix_hash import block_hashes, request_salt, root_hash


def test_only_full_blocks_are_named_and_a_shared_prefix_shares_its_hashes():
    root = root_hash("demo")
    a = block_hashes(list(range(10)), 4, root)
    b = block_hashes([*range(8), 99, 98, 97, 96], 4, root)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]


def test_a_hash_names_the_whole_prefix_not_just_its_block():
    root = root_hash("demo")
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, root)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, root)
    assert a[1] != b[1]  # same second block, other first block


def test_hashing_on_from_a_later_block_agrees_with_hashing_everything():
    root = root_hash("demo")
    tokens = list(range(40))
    whole = block_hashes(tokens, 8, root)
    assert block_hashes(tokens, 8, root, start=2, parent=whole[1]) == whole[2:]
    with pytest.raises(ValueError):
        block_hashes(tokens, 8, root, start=2)


@pytest.mark.parametrize(
    "other", [("other-model", ""), ("demo", request_salt("tenant-b", None)), ("demo", request_salt(None, "s"))]
)
def test_model_tenant_and_salt_each_change_every_hash(other):
    tokens = list(range(16))
    mine = block_hashes(tokens, 4, root_hash("demo", request_salt("tenant-a", None)))
    theirs = block_hashes(tokens, 4, root_hash(*other))
    assert not set(mine) & set(theirs)


def test_tenant_and_cache_salt_do_not_run_into_each_other():
    assert request_salt("ab", "c") != request_salt("a", "bc")
    assert request_salt(None, None) == ""
    assert request_salt("t", None) != request_salt(None, "t")
