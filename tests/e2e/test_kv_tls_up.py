"""`pdserve up --kv-tls` as users run it: the real command, whose prefill and decode workers get a CA and a
certificate generated in its run directory, and move every prompt's KV with the KV transfer gRPC speaking
mutual TLS only.

Proven here: the files (0700 directory, 0600 key, no CA key left), every prefill and decode worker's
environment names them and the gateway's does not; completions are served, each one's KV pulled (the decode
worker's pull count and its heartbeat: no prompt computed there, no pull failed); the prefill worker's KV
port answers a client holding the generated certificate, and refuses plaintext and a TLS client without a
certificate — so every one of those pulls went over mutual TLS. (The KV bytes themselves travel over gloo or
shared memory, which TLS does not cover: docs/security.md.)"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from services.local.children import descendants
from services.local.infra import free_port
from shared.urls import with_credentials
from tests.e2e_support import heartbeats, kv_connect_status, scraped_total

pytestmark = pytest.mark.slow  # a real `pdserve up` with two workers: ~40 s on the shared 2-core machine

PROMPTS = ["over mutual TLS", "and once more, a little longer this time"]


def _wait_ready(proc: subprocess.Popen, out: Path, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while "pdserve is ready" not in (text := out.read_text(errors="replace") if out.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"pdserve up --kv-tls did not get ready:\n{text[-4000:]}")
        time.sleep(0.3)
    return text


def _services(pid: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """`pdserve <role>` children of `pid` by role (the first of each): their arguments and environment."""
    found: dict[str, tuple[list[str], dict[str, str]]] = {}
    for child in descendants(pid):
        try:
            args = [a.decode() for a in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0") if a]
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[1:3] == ["-m", "services.cli"] and len(args) > 3:
            env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
            found.setdefault(args[3], (args, env))
    return found


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_up_kv_tls_moves_every_kv_over_mutual_tls(model_dir, tmp_path):
    port, log_dir, out = free_port(), tmp_path / "logs", tmp_path / "up.txt"
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--port", str(port),
           "--threads-per-worker", "1", "--drain-timeout-s", "3", "--log-dir", str(log_dir), "--kv-tls"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_KV_TLS_")}
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        ready = _wait_ready(proc, out)
        files = log_dir / "kv-tls"
        ca, cert, key = (str(files / name) for name in ("ca.pem", "cert.pem", "key.pem"))
        assert f"KV transfer: mutual TLS (CA {ca}, certificate {cert})" in ready
        assert sorted(p.name for p in files.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]  # the CA's key is gone
        assert stat.S_IMODE(files.stat().st_mode) == 0o700 and stat.S_IMODE(os.stat(key).st_mode) == 0o600

        services = _services(proc.pid)
        assert set(services) == {"prefill", "decode", "gateway"}, services.keys()
        tls_env = {"PDSERVE_KV_TLS_CA": ca, "PDSERVE_KV_TLS_CERT": cert, "PDSERVE_KV_TLS_KEY": key}
        for role in ("prefill", "decode"):
            assert {k: v for k, v in services[role][1].items() if k.startswith("PDSERVE_KV_TLS_")} == tls_env, role
        assert not any(k.startswith("PDSERVE_KV_TLS_") for k in services["gateway"][1])

        with httpx.Client(timeout=120) as client:
            for prompt in PROMPTS:
                body = {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                r = client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 6

        decode_args, decode_env = services["decode"]
        metrics = f"http://127.0.0.1:{_flag(decode_args, '--metrics-port')}/metrics"
        assert scraped_total(metrics, "pdserve:kv_transfer_seconds_count", role="decode") == len(PROMPTS)
        assert scraped_total(metrics, "pdserve:kv_transfer_failures_total") == 0
        nats_url = with_credentials(decode_env["PDSERVE_NATS_URL"], decode_env["PDSERVE_NATS_USER"],
                                    decode_env["PDSERVE_NATS_PASSWORD"])  # fmt: skip
        beats = list(heartbeats(nats_url).values())
        (decode,) = [b for b in beats if b.role == "decode"]
        assert decode.prefill_tokens == 0 and decode.decode_tokens > 0  # every prompt's KV was pulled, none recomputed

        (prefill,) = [b for b in beats if b.role == "prefill"]
        assert prefill.rpc_address
        ours = grpc.ssl_channel_credentials(
            Path(ca).read_bytes(), private_key=Path(key).read_bytes(), certificate_chain=Path(cert).read_bytes()
        )
        assert kv_connect_status(prefill.rpc_address, ours) == "INVALID_ARGUMENT"  # through TLS to the server's checks
        assert kv_connect_status(prefill.rpc_address, None) == "UNAVAILABLE"  # plaintext: no handshake
        anonymous = grpc.ssl_channel_credentials(Path(ca).read_bytes())  # trusts the server, presents nothing
        assert kv_connect_status(prefill.rpc_address, anonymous) == "UNAVAILABLE"
    except BaseException:
        print(out.read_text(errors="replace")[-4000:] if out.exists() else "(no output)")
        for log in sorted(log_dir.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
