"""How the server reads a KvTransfer call before its handler sees it: a message that does not parse becomes
`Unreadable` (the handler refuses it with INVALID_ARGUMENT; gRPC itself would answer INTERNAL and log a
traceback), and untrusted ids are shortened for the log."""

from __future__ import annotations

from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

MAX_MESSAGE_BYTES = 64 << 10  # our requests are a few hundred bytes; a bigger one is refused unread


class FromWorker(Protocol):
    """What every KvTransfer request carries: the calling decode worker's id."""

    decode_worker_id: str


Call = TypeVar("Call", bound=FromWorker)  # a KvTransfer request message (ConnectRequest, PullRequest)


class Unreadable:
    """What a request that does not parse becomes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def handler(method, request_type, reply_type, *, streaming: bool = False) -> grpc.RpcMethodHandler:
    """A unary handler (streaming: a stream-stream one) whose requests parse into `request_type`, or
    `Unreadable`."""

    def parse(raw: bytes):
        try:
            return request_type.FromString(raw)
        except DecodeError:
            return Unreadable(request_type.__name__)

    make = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
    return make(method, request_deserializer=parse, response_serializer=reply_type.SerializeToString)


def short(text: str, limit: int = 80) -> str:
    """repr of an untrusted id, cut short: log lines stay one readable line."""
    return repr(text if len(text) <= limit else text[:limit] + "…")
