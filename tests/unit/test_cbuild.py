"""The C kernels' build cache (shared/model/kernels/cbuild.py): one library per source and flags, compiled once,
rebuilt when the source changes; a kernel that cannot be built falls back with one log line. Each kernel's own
tests hold it to its torch reference."""

from __future__ import annotations

import logging
import shutil

import pytest

from shared.model.kernels import cbuild, cpu_attention, cpu_moe, cpu_norm_rope, cpu_stream_copy

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this host")


@needs_gcc
@pytest.mark.parametrize(
    "source",
    [cpu_attention.SOURCE, cpu_moe.SOURCE, cpu_norm_rope.SOURCE, cpu_stream_copy.SOURCE],
    ids=lambda p: p.stem,
)
def test_build_is_cached_by_source_hash(tmp_path, source):
    first = cbuild.build_library(source, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cbuild.build_library(source, tmp_path) == first and first.stat().st_mtime_ns == mtime
    edited = tmp_path / source.name  # a source that includes itself finds itself by this name, next to it
    edited.write_text(source.read_text() + "\n/* edited */\n")
    assert cbuild.build_library(edited, tmp_path) != first
    assert cbuild.build_library(source, tmp_path, flags=("-DPDSERVE_UNUSED=1",)) != first  # flags are in the key


@pytest.mark.parametrize(
    ("kernel", "fallback"),
    [(cpu_attention, "torch path"), (cpu_norm_rope, "torch ops"), (cpu_stream_copy, "torch's copy")],
)
def test_missing_compiler_falls_back_with_one_log_line(monkeypatch, tmp_path, caplog, kernel, fallback):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-pdserve")
    with caplog.at_level(logging.WARNING, logger=kernel.__name__):
        assert kernel.load.__wrapped__() is None
    assert len([r for r in caplog.records if fallback in r.message]) == 1
    assert list(tmp_path.iterdir()) == []  # nothing half-built left in the cache
