"""Mutual TLS on the KV transfer gRPC: who may even speak to a prefill worker's transfer port.

A throwaway PKI made with the `openssl` command (the `cryptography` package is not installed): a CA, a
server certificate for 127.0.0.1 / localhost, one naming only `kv-prefill.test`, a client certificate, and
a second CA with a client certificate of its own. A server with TLS refuses a plaintext client, a TLS client
without a certificate and one whose certificate another CA signed; the KV stays held through all of them,
and a client with a valid certificate then pulls it byte for byte. Settings half set, or files that cannot
be read, are refused at start with the setting's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.config_fields import from_env
from shared.engine.config import EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.kv.held import HeldKv
from shared.kv.tickets import Tickets
from shared.kv.transfer import EngineKvBlocks, FailureReason, KvTransferClient, KvTransferError, KvTransferServer
from shared.kv.transfer.channel_tls import KvTls
from shared.model.loader import load_model
from shared.rpc import kv_transfer_pb2 as pb
from shared.rpc import kv_transfer_pb2_grpc as pb_grpc
from shared.settings import KvTransferSettings, WorkerSettings

SECRET = b"tls-test-cluster-secret-0123"
TIMEOUT_S = 20.0
ENGINE_OPTS = dict(num_kv_blocks=32, max_model_len=256, scheduler=SchedulerConfig(max_num_batched_tokens=128))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make test certificates with")
    d = tmp_path_factory.mktemp("kv-pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-days", "1", "-subj", f"/CN=pdserve kv {ca}", "-keyout", f"{ca}.key",
            "-out", f"{ca}.pem", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    leaves = (  # name, signing CA, usage, subjectAltName
        ("server", "ca", "serverAuth", "IP:127.0.0.1,DNS:localhost"),
        ("named-server", "ca", "serverAuth", "DNS:kv-prefill.test"),
        ("client", "ca", "clientAuth", None),
        ("foreign-client", "other-ca", "clientAuth", None),
    )
    for name, ca, usage, alt in leaves:
        run("req", *ec, "-subj", f"/CN=pdserve kv {name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ext = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"] + ([f"subjectAltName={alt}"] if alt else [])
        (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext")  # fmt: skip
    return {p.name: str(p) for p in d.iterdir()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = write_demo_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", size="tiny")
    return path, load_model(path)


def _tls(pki, who: str, ca: str = "ca", server_name: str | None = None) -> KvTls:
    tls = KvTls.load(pki[f"{ca}.pem"], pki[f"{who}.pem"], pki[f"{who}.key"], server_name)
    assert tls is not None
    return tls


@contextlib.asynccontextmanager
async def tls_server(model_dir, tls: KvTls):
    path, model = model_dir
    engine = Engine.build(EngineConfig(model=str(path), **ENGINE_OPTS), model)
    source = HeldKv(EngineKvBlocks(engine), lease_s=600.0)
    server = KvTransferServer("127.0.0.1", 0, source, secret=SECRET, timeout_s=TIMEOUT_S, tls=tls)
    address = await server.start()
    try:
        prompt = torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(15)).tolist()
        engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
        while engine.has_unfinished():
            engine.step()
        expected = engine.export_kv("r").blocks.clone()
        assert await source.hold("r", "r", 0)
        yield engine, source, server, address, expected
    finally:
        await server.stop()


async def _connect_code(channel: grpc.aio.Channel, layout_fingerprint: str) -> grpc.StatusCode:
    request = pb.ConnectRequest(
        decode_worker_id="decode-a",
        backend=pb.BACKEND_GLOO,
        layout_fingerprint=layout_fingerprint,
        ticket=Tickets(SECRET).mint("decode-a"),
    )
    try:
        await pb_grpc.KvTransferStub(channel).Connect(request, timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close()
    return grpc.StatusCode.OK


def test_only_clients_with_a_certificate_of_our_ca_reach_the_server_and_the_kv_arrives_whole(pki, model_dir):
    async def run():
        async with tls_server(model_dir, _tls(pki, "server")) as (engine, source, server, address, expected):
            ca = Path(pki["ca.pem"]).read_bytes()
            foreign = _tls(pki, "foreign-client")
            strangers = {
                "plaintext": grpc.aio.insecure_channel(address),
                "no certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)),
                "another CA's certificate": grpc.aio.secure_channel(
                    address, grpc.ssl_channel_credentials(ca, foreign.key, foreign.cert)
                ),
            }
            for who, channel in strangers.items():
                code = await _connect_code(channel, engine.layout.fingerprint)
                assert code is grpc.StatusCode.UNAVAILABLE, (who, code)  # the handshake fails: no call is made
            assert server.stats.pairs_created == 0 and server.stats.refused == 0 and list(source.keys()) == ["r"]
            impostor = KvTransferClient("decode-a", secret=SECRET, timeout_s=TIMEOUT_S, tls=foreign)
            with pytest.raises(KvTransferError) as refused:
                await impostor.pull(address, "r", engine.layout)
            assert refused.value.reason is FailureReason.UNAVAILABLE
            await impostor.close()

            client = KvTransferClient("decode-a", secret=SECRET, timeout_s=TIMEOUT_S, tls=_tls(pki, "client"))
            try:
                kv = await client.pull(address, "r", engine.layout)
            finally:
                await client.close()
            assert kv.num_tokens == 40 and torch.equal(kv.blocks, expected)  # byte for byte

    asyncio.run(run())


def test_the_server_certificate_must_name_the_host_dialled_or_the_configured_name(pki, model_dir):
    async def run():
        async with tls_server(model_dir, _tls(pki, "named-server")) as (engine, _, _server, address, _expected):
            # The certificate names kv-prefill.test, we dial 127.0.0.1: refused unless told the name to expect.
            wrong = _tls(pki, "client")
            check = grpc.aio.secure_channel(address, wrong.channel_credentials(), options=wrong.channel_options())
            assert await _connect_code(check, engine.layout.fingerprint) is grpc.StatusCode.UNAVAILABLE
            named = _tls(pki, "client", server_name="kv-prefill.test")
            client = KvTransferClient("decode-a", secret=SECRET, timeout_s=TIMEOUT_S, tls=named)
            try:
                assert (await client.pull(address, "r", engine.layout)).num_tokens == 40
            finally:
                await client.close()

    asyncio.run(run())


def test_half_set_or_unreadable_tls_settings_are_refused_with_their_names(pki, tmp_path):
    ca, cert, key = pki["ca.pem"], pki["client.pem"], pki["client.key"]
    assert KvTls.load(None, None, None) is None  # nothing set: plaintext
    for args, named in (
        ((ca, None, None), "PDSERVE_KV_TLS_CERT, PDSERVE_KV_TLS_KEY"),
        ((None, cert, key), "PDSERVE_KV_TLS_CA"),
        ((ca, cert, None), "PDSERVE_KV_TLS_KEY"),
    ):
        with pytest.raises(ValueError, match=named):
            KvTls.load(*args)
        with pytest.raises(ValueError, match=named.split(",")[-1].strip()):
            KvTransferSettings(tls_ca=args[0], tls_cert=args[1], tls_key=args[2])
    with pytest.raises(ValueError, match="PDSERVE_KV_TLS_SERVER_NAME"):
        KvTls.load(None, None, None, "kv-prefill.test")
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    for args, named in (
        (("/nonexistent/ca.pem", cert, key), "PDSERVE_KV_TLS_CA='/nonexistent/ca.pem' cannot be read"),
        ((str(not_pem), cert, key), "PDSERVE_KV_TLS_CA=.* holds no PEM certificate"),
        ((ca, key, key), "PDSERVE_KV_TLS_CERT=.* holds no PEM certificate"),
        ((ca, cert, cert), "PDSERVE_KV_TLS_KEY=.* holds no PEM private key"),
    ):
        with pytest.raises(ValueError, match=named):
            KvTls.load(*args)
    # The environment reaches the kv section under these names.
    env = {"PDSERVE_ROLE": "decode", "PDSERVE_CLUSTER_SECRET": SECRET.decode(), "PDSERVE_KV_TLS_CA": ca}
    with pytest.raises(ValueError, match="PDSERVE_KV_TLS_CERT"):
        from_env(WorkerSettings, env)
    full = from_env(WorkerSettings, env | {"PDSERVE_KV_TLS_CERT": cert, "PDSERVE_KV_TLS_KEY": key})
    assert full.kv.tls_files == (ca, cert, key, None)
