"""SendStream (shared/kv/transfer/send_stream.py): a no-op on CPU, and on CUDA the ordering it promises, held
against a scripted torch.cuda (no GPU here): the export's gather is issued on the send stream after an event
of the compute stream; the send runs on the send stream, its tensors are marked used there, and the thread
returns only after waiting for an event recorded after the send. EngineKvBlocks exports under it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.kv_export import KVExport
from shared.engine.sampling import SamplingParams
from shared.kv.transfer import send_stream as module
from shared.kv.transfer.pool_kv import PoolKv
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.source import EngineKvBlocks


def test_a_no_op_on_cpu():
    stream = SendStream("cpu")
    assert stream.stream is None
    ran = []
    with stream.exporting():
        ran.append("export")
    with stream.sending([torch.zeros(3)]):
        ran.append("send")
    assert ran == ["export", "send"]
    with pytest.raises(RuntimeError, match="peer gone"), stream.sending([]):
        raise RuntimeError("peer gone")


class FakeCuda:
    """Enough of torch.cuda to record what SendStream asks of it, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.current = "compute"
        fake = self

        class Event:
            def __init__(self, on: str) -> None:
                self.on = on

            def synchronize(self) -> None:
                fake.log.append(f"host waits for an event of {self.on}")

        class Stream:
            def __init__(self, device) -> None:
                self.name = "send"

            def wait_event(self, event) -> None:
                fake.log.append(f"{self.name} waits for an event of {event.on}")

            def record_event(self):
                fake.log.append(f"event on {self.name}")
                return Event(self.name)

        class Compute(Stream):
            def __init__(self) -> None:
                self.name = "compute"

        self.Stream = Stream
        self._compute = Compute()

    def current_stream(self, device):
        return self._compute if self.current == "compute" else self._send

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.log.append(f"enter {s.name}")
                fake.current, fake._send = s.name, s

            def __exit__(self, *exc):
                fake.log.append(f"leave {s.name}")
                fake.current = "compute"

        return Ctx()


class FakeTensor:
    def __init__(self, log: list[str], device: str) -> None:
        self.log, self.device = log, torch.device(device)

    def record_stream(self, s) -> None:
        self.log.append(f"tensor used on {s.name}")


def test_the_cuda_ordering(monkeypatch):
    cuda = FakeCuda()
    for name in ("Stream", "current_stream", "stream"):
        monkeypatch.setattr(module.torch.cuda, name, getattr(cuda, name))
    stream = SendStream("cuda:0")
    with stream.exporting():
        cuda.log.append(f"gather on {cuda.current}")
    assert cuda.log == [
        "event on compute",
        "send waits for an event of compute",
        "enter send",
        "gather on send",
        "leave send",
    ]
    cuda.log.clear()
    with pytest.raises(RuntimeError, match="timed out"):
        with stream.sending([FakeTensor(cuda.log, "cuda:0"), FakeTensor(cuda.log, "cpu")]):
            cuda.log.append(f"send on {cuda.current}")
            raise RuntimeError("timed out")  # a failed send still settles its stream before the buffer goes
    assert cuda.log == [
        "enter send",
        "send on send",
        "tensor used on send",  # the CUDA tensor only
        "event on send",
        "host waits for an event of send",
        "leave send",
    ]


def test_engine_exports_run_under_the_stream(model_dir):
    entered: list[str] = []

    class Spy(SendStream):
        def exporting(self):
            entered.append("exporting")
            return super().exporting()

    engine = Engine.from_dir(model_dir, num_kv_blocks=16, max_model_len=128)
    engine.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
    while engine.has_unfinished():
        engine.step()
    # A host pool's KV is sent straight from its blocks (pool_kv.py): no export, nothing to order.
    lent = asyncio.run(EngineKvBlocks(engine, send_stream=Spy("cpu")).export_kv("r"))
    assert isinstance(lent, PoolKv) and entered == []
    # The export copy (what a CUDA pool's KV always takes) runs under the stream.
    blocks = EngineKvBlocks(engine, send_stream=Spy("cpu"), from_pool=False)
    kv = asyncio.run(blocks.export_kv("r"))
    assert isinstance(kv, KVExport) and entered == ["exporting"] and kv.num_tokens == 19
    torch.testing.assert_close(kv.blocks, engine.pool.read(engine.requests["r"].block_table[:2]))
