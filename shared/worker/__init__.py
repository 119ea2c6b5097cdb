"""The worker runtime: what every role (services/prefill, decode, mixed) shares, one concern a module.

runtime.py         Worker: connect, the capacity-gated job loop, the one cancel and failure paths, drain,
                   the token outbox, progress reports, heartbeats
streaming.py       StreamingWorker: roles that stream every token back (decode, mixed)
connections.py     Connections: NATS, JetStream and Redis, made by Worker.run()
ledger.py          JobLedger: one entry (job, message, phase, spans) per attempt key, generic over the job kind
cancels.py         CancelMemory: the cancels remembered for a while (bounded by age and count)
cancel_feed.py     CancelFeed: every cancel, also those published while this worker was disconnected
engine_load.py     EngineLoad: the engine thread's snapshot that admission and heartbeats read
heartbeat.py       heartbeats built from that snapshot, and the engine-thread facts they carry
gauges.py          the worker's Prometheus gauges
spans.py           a request's spans (process, prefill, decode) and per-request metrics
events.py          every TokenEvent the runtime sends
engine_factory.py  build_engine, sampling_params
"""

from shared.worker.engine_factory import build_engine, sampling_params
from shared.worker.events import error_event, token_event
from shared.worker.ledger import Entry, JobLedger, Phase
from shared.worker.runtime import Worker
from shared.worker.streaming import StreamingWorker

__all__ = [
    "Entry",
    "JobLedger",
    "Phase",
    "StreamingWorker",
    "Worker",
    "build_engine",
    "error_event",
    "sampling_params",
    "token_event",
]
