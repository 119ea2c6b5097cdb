"""The checked-in gRPC stubs are what proto/ generates today, and they import as shared.rpc.*."""

from __future__ import annotations

from shared.rpc import kv_transfer_pb2, kv_transfer_pb2_grpc
from shared.rpc.generate import PACKAGE_PATH, ROOT, generate


def test_checked_in_stubs_are_fresh(tmp_path):
    written = generate(tmp_path)
    assert written, "the generator wrote nothing"
    stale = []
    for path in written:
        checked_in = ROOT / path.relative_to(tmp_path)
        if not checked_in.is_file() or checked_in.read_bytes() != path.read_bytes():
            stale.append(str(checked_in.relative_to(ROOT)))
    assert not stale, f"stale gRPC stubs {stale}: run `python -m shared.rpc.generate` and commit the result"
    generated = {p.name for p in (tmp_path / PACKAGE_PATH).iterdir()}
    on_disk = {p.name for p in (ROOT / PACKAGE_PATH).glob("*_pb2*")}
    assert on_disk == generated, f"stubs without a proto: {sorted(on_disk - generated)}"


def test_stubs_describe_the_kv_transfer_service():
    service = kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"]
    assert service.full_name == "pdserve.kv.v1.KvTransfer"
    assert {m.name for m in service.methods} == {"Connect", "Pull", "PullStream"}
    assert kv_transfer_pb2_grpc.KvTransferStub.__module__ == "shared.rpc.kv_transfer_pb2_grpc"
    reply = kv_transfer_pb2.PullReply(num_tokens=3, shape=[2, 2, 1, 16, 2, 16], dtype="float32", tag=7)
    assert kv_transfer_pb2.PullReply.FromString(reply.SerializeToString()) == reply
