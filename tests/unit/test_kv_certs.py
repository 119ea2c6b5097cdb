"""`pdserve up --kv-tls`'s certificates (services/local/kv_certs.py) and how they reach the workers: the
generated certificate verifies against its CA for both server and client use, names the hosts decode workers
dial, and carries a mutual-TLS handshake (Python's ssl, checked by host name and by IP); keys are 0600 in a
0700 directory and the CA's key is gone; the user's own files are checked up front; a missing openssl, a
failing one, conflicting settings and partial flags are clear errors. The stack's workers over TLS:
tests/e2e/test_kv_tls_up.py."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from services.cli import main as cli_main
from services.local import kv_certs
from services.local.kv_certs import KvCertError, KvTlsFiles, OpensslMissing, dialled_hosts, generate
from services.local.stack import Stack, StackSpec

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the generator needs the openssl command")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> KvTlsFiles:
    return generate(
        tmp_path_factory.mktemp("run") / "kv-tls", ["127.0.0.1", "localhost", "prefill.internal", "10.1.2.3"]
    )


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@needs_openssl
def test_the_files_keys_and_directory_modes(made):
    directory = Path(made.ca).parent
    assert sorted(p.name for p in directory.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]  # no CA key, no config
    assert _mode(directory) == 0o700 and _mode(made.key) == 0o600
    assert all(Path(p).is_absolute() for p in (made.ca, made.cert, made.key))
    assert made.env() == {
        "PDSERVE_KV_TLS_CA": made.ca,
        "PDSERVE_KV_TLS_CERT": made.cert,
        "PDSERVE_KV_TLS_KEY": made.key,
    }
    assert b"-----BEGIN PRIVATE KEY-----" in Path(made.key).read_bytes()


@needs_openssl
@pytest.mark.parametrize("purpose", ["sslserver", "sslclient"])
def test_the_certificate_verifies_against_its_ca_for_both_ends(made, purpose):
    done = subprocess.run(["openssl", "verify", "-CAfile", made.ca, "-purpose", purpose, made.cert],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith(": OK"), done.stdout + done.stderr


@needs_openssl
def test_the_certificate_names_every_host_and_the_ca_is_a_ca(made):
    cert = ssl._ssl._test_decode_cert(made.cert)  # type: ignore[attr-defined]  # the stdlib's own decoder
    assert set(cert["subjectAltName"]) == {("IP Address", "127.0.0.1"), ("DNS", "localhost"),
                                           ("DNS", "prefill.internal"), ("IP Address", "10.1.2.3")}  # fmt: skip
    ca = ssl._ssl._test_decode_cert(made.ca)  # type: ignore[attr-defined]
    assert cert["issuer"] == ca["subject"] != cert["subject"]
    text = subprocess.run(["openssl", "x509", "-in", made.ca, "-noout", "-text"], capture_output=True, text=True).stdout
    assert "CA:TRUE" in text and "Certificate Sign" in text
    text = subprocess.run(
        ["openssl", "x509", "-in", made.cert, "-noout", "-text"], capture_output=True, text=True
    ).stdout
    assert "CA:FALSE" in text and "TLS Web Server Authentication, TLS Web Client Authentication" in text


def _handshake(server: KvTlsFiles, client: KvTlsFiles | None, ca: str, name: str) -> dict[str, str | None]:
    """One mutual-TLS exchange over loopback: a server presenting `server`'s certificate and requiring one of
    its CA from the client; a client trusting `ca`, checking the name `name`, presenting `client`'s (or none).
    → each side's error (None: it completed the exchange)."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=server.ca)
    server_ctx.load_cert_chain(server.cert, server.key)
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if client is not None:
        client_ctx.load_cert_chain(client.cert, client.key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    errors: dict[str, str | None] = {"client": None, "server": None}

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(tls.recv(4))
        except (ssl.SSLError, OSError) as e:
            errors["server"] = str(e)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(b"ping")  # TLS 1.3: a refused client certificate shows at the first read
                if tls.recv(4) != b"ping":
                    errors["client"] = "no echo"
    except (ssl.SSLError, OSError) as e:
        errors["client"] = str(e)
    finally:
        thread.join(10)
        listener.close()
    return errors


@needs_openssl
@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "prefill.internal", "10.1.2.3"])
def test_a_mutual_tls_handshake_with_the_certificate_at_each_name(made, name):
    assert _handshake(made, made, made.ca, name) == {"client": None, "server": None}


@needs_openssl
def test_other_names_other_cas_and_no_client_certificate_are_refused(made, tmp_path):
    wrong_name = _handshake(made, made, made.ca, "elsewhere.example")  # not in subjectAltName
    assert "Hostname mismatch" in (wrong_name["client"] or "")
    other = generate(tmp_path / "other", ["127.0.0.1"])  # every generation is a CA of its own
    untrusted = _handshake(made, made, other.ca, "127.0.0.1")  # the server's CA is not the client's
    assert "certificate verify failed" in (untrusted["client"] or "")
    foreign = _handshake(made, other, made.ca, "127.0.0.1")  # the client's certificate is another CA's
    assert "certificate verify failed" in (foreign["server"] or "") and foreign["client"] is not None
    anonymous = _handshake(made, None, made.ca, "127.0.0.1")  # no client certificate at all
    assert "certificate" in (anonymous["server"] or "") and anonymous["client"] is not None


@needs_openssl
def test_generating_again_replaces_every_file_and_tightens_modes(tmp_path):
    directory = tmp_path / "kv-tls"
    first = generate(directory, ["127.0.0.1"])
    before = {p: Path(p).read_bytes() for p in (first.ca, first.cert, first.key)}
    os.chmod(directory, 0o755)
    os.chmod(first.key, 0o644)
    second = generate(directory, ["127.0.0.1"])
    assert second == first  # the same paths, new contents
    assert all(Path(p).read_bytes() != data for p, data in before.items())
    assert _mode(directory) == 0o700 and _mode(second.key) == 0o600


def test_a_host_no_certificate_can_name_fails_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="neither an IP address nor a host name"):
        generate(tmp_path / "kv-tls", ["127.0.0.1", "bad host/name"])
    assert not (tmp_path / "kv-tls").exists()


def test_no_openssl_says_what_to_install_or_which_files_to_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_certs.shutil, "which", lambda _name: None)
    with pytest.raises(OpensslMissing) as caught:
        generate(tmp_path / "kv-tls", ["127.0.0.1"])
    message = str(caught.value)
    assert "openssl" in message and "install OpenSSL" in message
    assert "--kv-tls-ca" in message and "--kv-tls-cert" in message and "--kv-tls-key" in message
    assert isinstance(caught.value, FileNotFoundError)  # `pdserve` prints it as an error, no traceback


def test_a_failing_openssl_names_the_step_and_leaves_no_ca_key(tmp_path, monkeypatch):
    fake = tmp_path / "openssl"
    fake.write_text("#!/bin/sh\necho 'pretend failure' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(kv_certs, "find_openssl", lambda: str(fake))
    with pytest.raises(KvCertError, match="could not make a key.*exit code 3.*pretend failure"):
        generate(tmp_path / "kv-tls", ["127.0.0.1"])
    assert list((tmp_path / "kv-tls").iterdir()) == []


def test_dialled_hosts():
    assert dialled_hosts({}) == ["127.0.0.1", "localhost"]
    env = {"PDSERVE_ADVERTISE_HOST": "prefill.svc", "PDSERVE_RPC_HOST": "10.0.0.5"}
    assert dialled_hosts(env) == ["127.0.0.1", "localhost", "prefill.svc", "10.0.0.5"]
    # flags win over variables, the last one as argparse keeps it; [::1] is an address, without brackets
    flags = ["--advertise-host", "a.example", "--advertise-host=b.example", "--rpc-host", "[::1]"]
    assert dialled_hosts(env, flags) == ["127.0.0.1", "localhost", "b.example", "::1"]
    # a wildcard bind with no advertised host advertises this machine's name
    assert dialled_hosts({"PDSERVE_RPC_HOST": "0.0.0.0"}) == list(
        dict.fromkeys(["127.0.0.1", "localhost", socket.getfqdn()])  # the name may be localhost itself
    )
    assert dialled_hosts({"PDSERVE_RPC_HOST": "0.0.0.0", "PDSERVE_ADVERTISE_HOST": "x"}) == [
        "127.0.0.1",
        "localhost",
        "x",
    ]


@needs_openssl
def test_given_files_are_checked_and_named_by_flag(made, monkeypatch):
    assert KvTlsFiles.given(None, None, None) is None
    with pytest.raises(ValueError, match="--kv-tls-ca given without --kv-tls-cert, --kv-tls-key"):
        KvTlsFiles.given(made.ca, None, None)
    with pytest.raises(ValueError, match=r"--kv-tls-cert /nonexistent.pem: cannot be read"):
        KvTlsFiles.given(made.ca, "/nonexistent.pem", made.key)
    with pytest.raises(ValueError, match="--kv-tls-cert .*holds no PEM certificate"):
        KvTlsFiles.given(made.ca, made.key, made.key)
    with pytest.raises(ValueError, match="--kv-tls-key .*holds no PEM private key"):
        KvTlsFiles.given(made.ca, made.cert, made.cert)
    monkeypatch.chdir(Path(made.ca).parent)
    assert KvTlsFiles.given("ca.pem", "cert.pem", "key.pem") == made  # relative paths resolved


def test_a_stack_with_kv_tls_refuses_the_same_settings_given_another_way(tmp_path):
    model = str(tmp_path)
    with pytest.raises(ValueError, match="drop PDSERVE_KV_TLS_CA"):
        StackSpec(model=model, kv_tls=True, env={"PDSERVE_KV_TLS_CA": "x"})
    with pytest.raises(ValueError, match="drop --kv-tls-cert"):
        StackSpec(model=model, kv_tls=True, role_args={"decode": ("--kv-tls-cert=x",)})
    StackSpec(model=model, env={"PDSERVE_KV_TLS_CA": "x"})  # without kv_tls: the workers' own settings
    with pytest.raises(ValueError, match="drop PDSERVE_KV_TLS_SERVER_NAME"):  # generated files name every host
        StackSpec(model=model, kv_tls=True, env={"PDSERVE_KV_TLS_SERVER_NAME": "x"})
    own = KvTlsFiles("/ca.pem", "/cert.pem", "/key.pem")  # the user's own files may need a name of the user's
    StackSpec(model=model, kv_tls=own, env={"PDSERVE_KV_TLS_SERVER_NAME": "x"}, worker_args=("--kv-tls-server-name=x",))
    with pytest.raises(ValueError, match="drop --kv-tls-key"):
        StackSpec(model=model, kv_tls=own, worker_args=("--kv-tls-key", "/other.key"))


@needs_openssl
def test_a_stack_generates_in_its_run_directory_and_only_workers_get_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_TLS_SERVER_NAME", "inherited.example")  # meant for another deployment
    spec = StackSpec(model=str(tmp_path), kv_tls=True, role_args={"prefill": ("--advertise-host", "p.example")})
    stack = Stack(spec, log_dir=str(tmp_path / "run"))
    assert stack.worker_env() == {}  # nothing before launch
    stack.prepare_kv_tls()
    assert stack.kv_tls is not None and Path(stack.kv_tls.ca).parent == tmp_path / "run" / "kv-tls"
    names = {v for _, v in ssl._ssl._test_decode_cert(stack.kv_tls.cert)["subjectAltName"]}  # type: ignore[attr-defined]
    assert names == {"127.0.0.1", "localhost", "p.example"}
    assert stack.worker_env() == stack.kv_tls.env()
    assert not any(k.startswith("PDSERVE_KV_TLS_") for k in stack.service_env())  # the gateway's: none
    # with the user's own files an inherited server name stays (theirs to set); the files are replaced
    monkeypatch.setenv("PDSERVE_KV_TLS_CA", "/inherited/ca.pem")
    own = Stack(StackSpec(model=str(tmp_path), kv_tls=stack.kv_tls), log_dir=str(tmp_path / "own"))
    own.prepare_kv_tls()
    assert own.worker_env() == stack.kv_tls.env()
    assert {k: v for k, v in own.service_env().items() if k.startswith("PDSERVE_KV_TLS_")} == {
        "PDSERVE_KV_TLS_SERVER_NAME": "inherited.example"
    }
    # without kv_tls the inherited settings pass through, as before
    plain = Stack(StackSpec(model=str(tmp_path)), log_dir=str(tmp_path / "plain"))
    plain.prepare_kv_tls()
    assert plain.worker_env() == {} and plain.service_env()["PDSERVE_KV_TLS_SERVER_NAME"] == "inherited.example"


class _Captured:
    """Stand-ins for Stack and Supervisor: `up` builds its spec and stops there."""

    spec: StackSpec | None = None

    def __init__(self, monkeypatch) -> None:
        captured = self

        class Stack:
            def __init__(self, spec, **_kw) -> None:
                captured.spec = spec

        class Supervisor:
            def __init__(self, *_a, **_kw) -> None: ...

            def run(self) -> int:
                return 0

        monkeypatch.setattr("services.local.stack.Stack", Stack)
        monkeypatch.setattr("services.local.supervisor.Supervisor", Supervisor)
        monkeypatch.setattr("services.local.preflight.preflight", lambda *_a, **_kw: None)  # no checkpoint here


@needs_openssl
def test_up_flags(made, tmp_path, monkeypatch, capsys):
    up = ["up", "--model", str(tmp_path)]
    seen = _Captured(monkeypatch)
    assert cli_main(up) == 0 and seen.spec is not None and seen.spec.kv_tls is False
    assert cli_main([*up, "--kv-tls"]) == 0 and seen.spec.kv_tls is True
    files = ["--kv-tls-ca", made.ca, "--kv-tls-cert", made.cert, "--kv-tls-key", made.key]
    assert cli_main([*up, *files]) == 0 and seen.spec.kv_tls == made  # --kv-tls implied
    assert cli_main([*up, "--kv-tls", *files]) == 0 and seen.spec.kv_tls == made  # the user's files, not generated
    assert cli_main([*up, *files[:4]]) == 2
    assert "--kv-tls-key" in capsys.readouterr().err
    monkeypatch.setattr(kv_certs.shutil, "which", lambda _name: None)
    assert cli_main([*up, "--kv-tls"]) == 2  # before anything starts
    assert "install OpenSSL" in capsys.readouterr().err
    assert cli_main([*up, *files]) == 0  # the user's files need no openssl
