"""The CUDA stream a prefill worker's KV exports and sends run on, apart from the engine's compute stream.

Without it, on CUDA an export's gather (`KVPool.read`, an index_select over the pool) runs on the engine's
compute stream between two steps, and the send thread issues the NCCL send on its own current stream, the
device's default stream, which is the compute stream: NCCL makes its internal stream wait on the issuing
thread's current stream, so the send waits for every step queued before it, and the steps queued after it
wait behind the gather. With it:

- `exporting()` (the engine's thread, around the export): records an event on the compute stream, which
  covers the steps that wrote the request's blocks; the send stream waits on that event, and the gather is
  issued on the send stream. The compute stream goes on without waiting for the gather.
- `sending(tensors)` (the send thread, around the send): makes the send stream current, so NCCL orders the
  send after the gather and nothing else; gloo's `.cpu()` copy runs there too. On leaving, the tensors are
  marked used on the send stream (`record_stream`: the caching allocator will not reuse their memory for
  another stream before this work is done), and the thread waits for an event recorded after the send: the
  export buffer goes back to its pool (and the blocks are freed) only once the send's work has completed.

On CPU (gloo over host memory) both are no-op contexts: the same code path, nothing to order. One per
transfer server; the source that exports and the server that sends must share it (the prefill worker builds
one and hands it to both). Not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class SendStream:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @contextmanager
    def exporting(self) -> Iterator[None]:
        """Issue what runs inside (the export's gather) on the send stream, after the compute queued so far."""
        if self.stream is None:
            yield
            return
        computed = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(computed)
        with torch.cuda.stream(self.stream):
            yield

    @contextmanager
    def sending(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Issue what runs inside (the send of `tensors`) on the send stream; return once that work is done."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            try:
                yield
            finally:
                for t in tensors:
                    if t.device.type == "cuda":
                        t.record_stream(self.stream)
                self.stream.record_event().synchronize()
