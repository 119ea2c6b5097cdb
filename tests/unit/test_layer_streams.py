"""The engine's per-layer progress of a watched prefill (shared/engine/layer_streams.py), in one process."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.layer_streams import LayerProgress, StreamFailed, StreamStart
from shared.engine.sampling import SamplingParams

PREFILL = SamplingParams(max_tokens=1, temperature=0.0)


def _engine(checkpoint, model) -> Engine:
    chunks = SchedulerConfig(max_num_batched_tokens=128)
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_model_len=1024, scheduler=chunks)
    return Engine.build(config, model)


def _prompt(n: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_the_stream_starts_at_the_last_chunk_and_marks_every_layer_then_the_token(checkpoint, model):
    engine = _engine(checkpoint, model)
    engine.add_request("r", _prompt(300), PREFILL, hold_kv=True)
    starts: list[tuple[int, StreamStart]] = []
    engine.stream_kv("r", lambda s: starts.append((engine.stats.steps, s)))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    ((steps_before, start),) = starts
    assert steps_before == 2  # chunks of 128: the third step completes the prompt
    assert start.num_tokens == 300 and start.block_ids == engine.kv_blocks("r")[1]
    progress = start.progress
    assert progress.layers_done == model.config.num_layers and len(progress.layers_at) == model.config.num_layers
    assert progress.wait_token(0) == tokens[0]
    assert not engine.layer_streams.is_streaming("r") and engine.model.on_layer is None


def test_a_step_that_raises_fails_the_stream_after_the_layers_it_wrote(checkpoint, model):
    engine = _engine(checkpoint, model)
    engine.add_request("a", _prompt(40), PREFILL, hold_kv=True)
    started: list[StreamStart] = []
    engine.stream_kv("a", started.append)
    layer = engine.model.model.layers[1]
    forward = layer.forward

    def failing(*args):  # the step raises inside layer 1: the stream fails, layer 0 was marked
        raise RuntimeError("boom")

    layer.forward = failing
    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.step()
    finally:
        layer.forward = forward
    progress = started[0].progress
    assert progress.layers_done == 1
    with pytest.raises(StreamFailed, match="boom"):
        progress.wait_layer(1, 1.0)
    progress.wait_layer(0, 0)  # what was marked stays readable
    assert engine.model.on_layer is None


def test_progress_waits_are_bounded_and_thread_safe():
    progress = LayerProgress(3)
    with pytest.raises(TimeoutError):
        progress.wait_layer(0, 0.01)
    done = threading.Event()

    def waiter():
        progress.wait_layer(2, 5)
        assert progress.wait_token(5) == 7
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    for layer in range(3):
        progress.mark(layer)
    progress.finish(7)
    thread.join(5)
    assert done.is_set()
    progress.fail("late")  # a no-op once finished
    assert progress.wait_token(0) == 7
    failed = LayerProgress(2)
    failed.fail("aborted")
    failed.mark(0)  # ignored after a failure
    with pytest.raises(StreamFailed, match="aborted"):
        failed.wait_layer(0, 1)


def test_only_a_fresh_held_prefill_on_a_host_pool_is_streamed(checkpoint, model):
    engine = _engine(checkpoint, model)
    engine.add_request("plain", _prompt(20), PREFILL)
    with pytest.raises(ValueError, match="not a fresh prefill"):
        engine.stream_kv("plain", lambda s: None)
    with pytest.raises(ValueError, match="not a fresh prefill"):
        engine.stream_kv("unknown", lambda s: None)
    engine.add_request("held", _prompt(20), PREFILL, hold_kv=True)
    engine.stream_kv("held", lambda s: None)
    assert engine.abort("held") and not engine.layer_streams.is_streaming("held")
