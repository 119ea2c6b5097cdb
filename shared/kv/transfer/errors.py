"""Why a KV pull failed, as one exception type the decode worker catches to fall back to recomputing."""

from __future__ import annotations

from enum import StrEnum

import grpc


class FailureReason(StrEnum):
    NOT_FOUND = "not_found"  # the prefill side has no KV for the request (never had, freed, lease expired)
    DENIED = "denied"  # ticket refused (none, forged, expired, another's): the KV stays with its holder
    INCOMPATIBLE = "incompatible"  # layout fingerprint or backend differ between the two sides
    IN_PROGRESS = "in_progress"  # another pull of the same request is in flight
    UNAVAILABLE = "unavailable"  # prefill worker unreachable, rendezvous failed, peer gone mid-transfer
    TIMEOUT = "timeout"  # an RPC, the rendezvous or the transfer ran past the client's timeout
    PROTOCOL = "protocol"  # a message one side cannot accept (bad announcement, call refused as malformed)


# gRPC status codes the server uses, and what they mean to a puller. ABORTED (the pair is gone) never
# reaches the caller: the client reconnects and retries once.
_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: FailureReason.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED: FailureReason.DENIED,
    grpc.StatusCode.PERMISSION_DENIED: FailureReason.DENIED,
    grpc.StatusCode.INVALID_ARGUMENT: FailureReason.PROTOCOL,
    grpc.StatusCode.FAILED_PRECONDITION: FailureReason.INCOMPATIBLE,
    grpc.StatusCode.ALREADY_EXISTS: FailureReason.IN_PROGRESS,
    grpc.StatusCode.DEADLINE_EXCEEDED: FailureReason.TIMEOUT,
}


class KvTransferError(Exception):
    """A pull failed; `reason` says why. The decode worker should recompute the prompt (or fail the request)."""

    def __init__(self, reason: FailureReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError, what: str) -> KvTransferError:
        reason = _BY_CODE.get(error.code(), FailureReason.UNAVAILABLE)
        return cls(reason, f"{what}: {error.code().name} {error.details()}")
