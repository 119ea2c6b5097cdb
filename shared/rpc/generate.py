"""Regenerate the gRPC stubs of proto/ into shared/rpc/: `python -m shared.rpc.generate`.

The proto is mapped to the virtual path shared/rpc/ (`-Ishared/rpc=proto`), so the generated modules import
each other as `shared.rpc.kv_transfer_pb2` with no post-processing. The output depends on the grpcio-tools
version pinned in pyproject; tests/test_proto_stubs.py fails when the checked-in stubs are stale.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
PACKAGE_PATH = "shared/rpc"  # where the stubs live, relative to the repository root (= their import path)
PROTOS = ("kv_transfer.proto",)


def generate(out_root: Path = ROOT) -> list[Path]:
    """Write the stubs under out_root/shared/rpc/; return their paths. Raises RuntimeError if protoc fails."""
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto, should a proto import them
    written = []
    for name in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PACKAGE_PATH}={PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            f"{PACKAGE_PATH}/{name}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on proto/{name}")
        stem = name.removesuffix(".proto")
        written += [out_root / PACKAGE_PATH / f"{stem}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def main() -> None:
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)


if __name__ == "__main__":
    main()
