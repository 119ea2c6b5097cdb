"""The KV transfer plane: decode workers pull a request's KV from the prefill worker holding it.

gRPC (proto/kv_transfer.proto) negotiates a two-rank torch.distributed group per (prefill, decode) pair (gloo
between CPU processes, NCCL between GPUs); each pull's bytes move by one of the transports behind one interface
(transports/: the borrowed pool, a shared segment, the pair's sends). docs/kv_transfer.md has the protocol.
"""

from shared.kv.transfer.client import ClientStats, KvTransferClient
from shared.kv.transfer.errors import FailureReason, KvTransferError
from shared.kv.transfer.pair import TransferBackend
from shared.kv.transfer.send_stream import SendStream
from shared.kv.transfer.server import KvTransferServer, ServerStats
from shared.kv.transfer.source import AlreadySending, EngineKvBlocks, KvBlocks, KvSource

__all__ = [
    "TransferBackend",
    "ClientStats",
    "AlreadySending",
    "EngineKvBlocks",
    "FailureReason",
    "KvBlocks",
    "KvSource",
    "KvTransferClient",
    "KvTransferError",
    "KvTransferServer",
    "SendStream",
    "ServerStats",
]
