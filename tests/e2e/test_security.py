"""Who may talk to what, and what is written down: NATS and Redis credentials and TLS with real servers, a real
stack with private credentials (right ones serve; wrong ones are refused with a clear reason in /ready and the
log), the gateway's limits on what a client sends, and prompts kept out of every log unless asked for.

The TLS cases make a throwaway CA and certificates with the `openssl` command."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from redis.asyncio import Redis

from services.gateway.errors import APIError
from services.gateway.prepare import MAX_STOP_CHARS, MAX_STOP_STRINGS, prepare_chat, prepare_completion
from services.gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.gateway.served_model import ServedModel
from services.local.infra import ServerTls, free_port, start_nats, start_redis
from services.local.stack import StackSpec
from shared import bus
from shared.redis_client import explain_redis_error, redis_client
from shared.settings import CommonSettings, GatewaySettings, from_env
from shared.urls import redact, split_credentials, with_credentials
from tests.e2e_support import heartbeats, start_stack

CONNECT_TIMEOUT_S = 1.5  # a refused client retries forever: give up on it after this long


async def _connects(settings: CommonSettings, name: str) -> bool:
    """Connect, round-trip one message, close; False when the client is still not connected after a while."""
    try:
        nc = await asyncio.wait_for(bus.connect(settings, name), CONNECT_TIMEOUT_S)
    except TimeoutError:
        return False
    try:
        sub = await nc.subscribe("security.echo")
        await nc.publish("security.echo", b"ping")
        return (await sub.next_msg(timeout=2)).data == b"ping"
    finally:
        await nc.close()


async def _redis_answer(settings: CommonSettings) -> str:
    client = redis_client(settings, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        return "PONG" if await client.ping() else "no answer"
    except Exception as exc:
        return explain_redis_error(exc)
    finally:
        await client.aclose()


# ---- URLs and credentials ------------------------------------------------------------------------------


def test_urls_credentials_and_redaction():
    assert split_credentials("nats://u:p%40ss@h:4222") == ("nats://h:4222", "u", "p@ss")
    assert split_credentials("redis://:pw@h:6379/0") == ("redis://h:6379/0", None, "pw")
    assert split_credentials("nats://h:4222") == ("nats://h:4222", None, None)
    assert with_credentials("redis://x:y@h/0", None, "a b:c") == "redis://:a%20b%3Ac@h/0"
    assert split_credentials(with_credentials("nats://h:1", "us er", "p@:/")) == ("nats://h:1", "us er", "p@:/")
    assert redact("nats://u:secret@h:1,nats://h2:2") == "nats://***@h:1,nats://h2:2"
    assert redact("redis://:secret@h/0") == "redis://***@h/0"
    assert redact("nats://token@h:1") == "nats://***@h:1"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_nats_credentials_settings_win_and_no_password_is_logged(caplog):
    server = start_nats(user="pd", password="right-pw")
    bare = split_credentials(server.url)[0]
    try:
        caplog.set_level(logging.INFO, logger="shared.bus")
        assert asyncio.run(_connects(CommonSettings(nats_url=server.url), "url-credentials"))
        # settings win over credentials in the URL
        wrong_url = with_credentials(bare, "pd", "wrong-pw")
        right = CommonSettings(nats_url=wrong_url, nats_user="pd", nats_password="right-pw")
        assert asyncio.run(_connects(right, "settings-win"))
        assert not asyncio.run(_connects(CommonSettings(nats_url=server.url, nats_password="wrong-pw"), "wrong"))
        problem = bus.connection_problem("wrong")
        assert "refused the credentials" in problem and "PDSERVE_NATS_PASSWORD" in problem
        assert not asyncio.run(_connects(CommonSettings(nats_url=bare), "anonymous"))
        assert "refused the credentials" in bus.connection_problem("anonymous")
    finally:
        server.stop()
    text = caplog.text
    assert "right-pw" not in text and "wrong-pw" not in text
    assert "url-credentials: connecting to NATS at nats://127.0.0.1" in text and "(as pd)" in text
    # a refused client logs its problem once, not once per attempt (it retries every 0.5 s)
    assert sum("wrong: cannot connect to NATS" in r.getMessage() for r in caplog.records) == 1


def test_nats_token():
    server = start_nats(password="just-a-token")
    try:
        assert server.url.startswith("nats://just-a-token@")
        bare = split_credentials(server.url)[0]
        assert asyncio.run(_connects(CommonSettings(nats_url=bare, nats_password="just-a-token"), "token"))
        assert not asyncio.run(_connects(CommonSettings(nats_url=bare), "no-token"))
    finally:
        server.stop()


def test_redis_credentials_settings_win():
    server = start_redis(password="redis-pw")
    bare = split_credentials(server.url)[0]
    try:
        assert asyncio.run(_redis_answer(CommonSettings(redis_url=server.url))) == "PONG"
        wrong_url = with_credentials(bare, None, "nope")
        assert asyncio.run(_redis_answer(CommonSettings(redis_url=wrong_url, redis_password="redis-pw"))) == "PONG"
        for settings in (CommonSettings(redis_url=wrong_url), CommonSettings(redis_url=bare)):
            answer = asyncio.run(_redis_answer(settings))
            assert "Redis refused the credentials" in answer and "PDSERVE_REDIS_PASSWORD" in answer
        # a named ACL user (redis_username), as Redis 6+ has them
        asyncio.run(_acl_user(server.url))
        named = CommonSettings(redis_url=bare, redis_username="pdserve", redis_password="user-pw")
        assert asyncio.run(_redis_answer(named)) == "PONG"
    finally:
        server.stop()


async def _acl_user(admin_url: str) -> None:
    admin = Redis.from_url(admin_url)
    try:
        await admin.execute_command("ACL", "SETUSER", "pdserve", "on", ">user-pw", "~pd:*", "+@all")
    finally:
        await admin.aclose()


def test_secrets_from_files(tmp_path, monkeypatch):
    """PDSERVE_<FIELD>_FILE (Docker secrets): the passwords come from files, not the environment."""
    nats_server, redis_server = start_nats(user="pd", password="nats-file-pw"), start_redis(password="redis-file-pw")
    try:
        (tmp_path / "nats").write_text("nats-file-pw\n")
        (tmp_path / "redis").write_text("redis-file-pw\n")
        env = {
            "PDSERVE_NATS_URL": split_credentials(nats_server.url)[0],
            "PDSERVE_NATS_USER": "pd",
            "PDSERVE_NATS_PASSWORD_FILE": str(tmp_path / "nats"),
            "PDSERVE_REDIS_URL": split_credentials(redis_server.url)[0],
            "PDSERVE_REDIS_PASSWORD_FILE": str(tmp_path / "redis"),
        }
        settings = from_env(CommonSettings, env)
        assert settings.nats_password == "nats-file-pw" and settings.redis_password == "redis-file-pw"
        assert asyncio.run(_connects(settings, "from-files"))
        assert asyncio.run(_redis_answer(settings)) == "PONG"
        with pytest.raises(ValueError, match="PDSERVE_REDIS_PASSWORD_FILE"):
            from_env(CommonSettings, env | {"PDSERVE_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})
    finally:
        nats_server.stop()
        redis_server.stop()


# ---- TLS -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 / localhost and a client certificate, signed by it."""
    openssl = shutil.which("openssl") or "/usr/bin/openssl"
    if not Path(openssl).exists():
        pytest.skip("no openssl command to make test certificates with")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-days", "1", "-subj", "/CN=pdserve test CA", "-keyout", "ca.key", "-out", "ca.pem",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, usage, alt in (("server", "serverAuth", "IP:127.0.0.1,DNS:localhost"), ("client", "clientAuth", None)):
        run("req", *ec, "-subj", f"/CN=pdserve test {name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        ext = [f"extendedKeyUsage={usage}", "authorityKeyIdentifier=keyid,issuer", "basicConstraints=CA:FALSE"]
        (d / f"{name}.ext").write_text("\n".join(ext + ([f"subjectAltName={alt}"] if alt else [])) + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext")  # fmt: skip
    return {name: str(d / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_nats_tls(pki):
    server = start_nats(user="pd", password="tls-pw", tls=ServerTls(pki["server.pem"], pki["server.key"]))
    try:
        assert server.url.startswith("tls://")
        bare = split_credentials(server.url)[0]
        creds = {"nats_user": "pd", "nats_password": "tls-pw"}
        assert asyncio.run(_connects(CommonSettings(nats_url=bare, nats_tls_ca=pki["ca.pem"], **creds), "tls"))
        # a nats:// URL with the CA set: TLS all the same (the server asks for it, the CA verifies it)
        plain_url = bare.replace("tls://", "nats://")
        assert asyncio.run(_connects(CommonSettings(nats_url=plain_url, nats_tls_ca=pki["ca.pem"], **creds), "ca"))
        # without the CA the server's certificate does not verify (the system's CAs did not sign it)
        assert not asyncio.run(_connects(CommonSettings(nats_url=bare, **creds), "tls-no-ca"))
        problem = bus.connection_problem("tls-no-ca")
        assert "TLS failed" in problem and "PDSERVE_NATS_TLS_CA" in problem and "CERTIFICATE_VERIFY_FAILED" in problem
    finally:
        server.stop()


def test_tls_files_that_are_not_certificates_are_named():
    settings = CommonSettings(nats_tls_ca=__file__, redis_tls_ca="/nonexistent/ca.pem")
    with pytest.raises(ValueError, match="PDSERVE_NATS_TLS_CA"):  # said at once, not retried forever
        asyncio.run(_connects(settings, "bad-ca"))
    with pytest.raises(ValueError, match="PDSERVE_REDIS_TLS_CA"):
        redis_client(settings)


def test_nats_tls_downgrade_withholds_credentials(pki):
    """TLS asked for (a CA set) and a server that does not offer it: the password is never sent."""
    server = start_nats(user="pd", password="not-in-clear")
    bare = split_credentials(server.url)[0]
    try:
        wanted = CommonSettings(nats_url=bare, nats_user="pd", nats_password="not-in-clear", nats_tls_ca=pki["ca.pem"])
        assert not asyncio.run(_connects(wanted, "downgraded"))
        assert "did not offer TLS" in bus.connection_problem("downgraded")
    finally:
        server.stop()


def test_nats_mutual_tls(pki):
    tls = ServerTls(pki["server.pem"], pki["server.key"], ca=pki["ca.pem"], verify_clients=True)
    server = start_nats(user="pd", password="mtls-pw", tls=tls)
    bare = split_credentials(server.url)[0]
    common = {"nats_url": bare, "nats_user": "pd", "nats_password": "mtls-pw", "nats_tls_ca": pki["ca.pem"]}
    try:
        client = {"nats_tls_cert": pki["client.pem"], "nats_tls_key": pki["client.key"]}
        assert asyncio.run(_connects(CommonSettings(**common, **client), "mtls"))
        assert not asyncio.run(_connects(CommonSettings(**common), "mtls-no-cert"))
    finally:
        server.stop()
    with pytest.raises(ValueError, match="go together"):
        asyncio.run(_connects(CommonSettings(**common, nats_tls_cert=pki["client.pem"]), "half"))


def test_redis_tls(pki):
    tls = ServerTls(pki["server.pem"], pki["server.key"], ca=pki["ca.pem"])
    try:
        server = start_redis(password="tls-redis-pw", tls=tls)
    except RuntimeError as exc:  # a redis-server built without TLS refuses the tls-* options
        if "tls" not in str(exc).lower():
            raise
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    try:
        assert server.url.startswith("rediss://")
        bare = split_credentials(server.url)[0]
        right = {"redis_password": "tls-redis-pw", "redis_tls_ca": pki["ca.pem"]}
        assert asyncio.run(_redis_answer(CommonSettings(redis_url=bare, **right))) == "PONG"
        # a redis:// URL with a CA set speaks TLS
        plain_url = bare.replace("rediss://", "redis://")
        assert asyncio.run(_redis_answer(CommonSettings(redis_url=plain_url, **right))) == "PONG"
        answer = asyncio.run(_redis_answer(CommonSettings(redis_url=bare, redis_password="tls-redis-pw")))
        assert "TLS failed" in answer and "PDSERVE_REDIS_TLS_CA" in answer
        wrong = asyncio.run(_redis_answer(CommonSettings(redis_url=bare, **right | {"redis_password": "no"})))
        assert "Redis refused the credentials" in wrong
    finally:
        server.stop()


# ---- a real stack: private credentials, refused strangers, limits, logs -------------------------------------


MAX_BODY = 64 << 10
MAX_PROMPT_TOKENS = 100


@pytest.fixture(scope="module")
def stack(model_dir):
    env = {"PDSERVE_MAX_BODY_BYTES": str(MAX_BODY), "PDSERVE_MAX_PROMPT_TOKENS": str(MAX_PROMPT_TOKENS)}
    spec = StackSpec(model=str(model_dir), port=free_port(), threads_per_worker=1, env=env)
    stack = start_stack(spec)
    yield stack
    stack.stop()


def _ready(url: str) -> tuple[int, str]:
    try:
        r = httpx.get(f"{url}/ready", timeout=2)
    except httpx.HTTPError as exc:
        return 0, str(exc)
    return r.status_code, r.text


def _wait_ready_answer(url: str, wanted: str, timeout_s: float = 60) -> str:
    """The gateway's /ready body once it contains `wanted` (a 503)."""
    deadline = time.monotonic() + timeout_s
    status, body = 0, ""
    while time.monotonic() < deadline:
        status, body = _ready(url)
        if status == 503 and wanted in body:
            return body
        time.sleep(0.3)
    raise AssertionError(f"/ready never said {wanted!r}; last: {status} {body}")


def test_private_infrastructure_requires_the_generated_credentials(stack):
    # the stack serves: its services got the credentials
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    # a stranger without them is refused by both servers
    nats_bare, redis_bare = split_credentials(stack.nats_url)[0], split_credentials(stack.redis_url)[0]
    assert not asyncio.run(_connects(CommonSettings(nats_url=nats_bare), "stranger"))
    assert "refused the credentials" in asyncio.run(_redis_answer(CommonSettings(redis_url=redis_bare)))
    # no password on any command line (any local user can read those)
    secrets = [split_credentials(stack.nats_url)[2], split_credentials(stack.redis_url)[2], stack.cluster_secret]
    assert all(secrets)
    pids = [p.pid for p in stack.procs.values()] + [s.proc.pid for s in stack.infra]
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(secret in cmdline for secret in secrets), cmdline


def test_wrong_credentials_are_named_in_ready_and_the_log(stack):
    """A gateway with a wrong NATS password and one with a wrong Redis password: neither crashes, each keeps
    retrying and says why in /ready and in its log — once, not per attempt. (Workers connect through the same
    shared.bus.connect and redis_client.)"""
    gateway = ["gateway", "--host", stack.spec.host, "--model", stack.spec.model]
    wrong = {"bad-nats": {"PDSERVE_NATS_PASSWORD": "wrong-nats-pw"}, "bad-redis": {"PDSERVE_REDIS_PASSWORD": "no"}}
    ports = {name: free_port() for name in wrong}
    procs = {name: stack.spawn(f"gateway-{name}", [*gateway, "--port", str(ports[name])], env)
             for name, env in wrong.items()}  # fmt: skip
    try:
        body = _wait_ready_answer(f"http://{stack.spec.host}:{ports['bad-nats']}", "refused the credentials")
        assert "PDSERVE_NATS_PASSWORD" in body and "wrong-nats-pw" not in body
        body = _wait_ready_answer(f"http://{stack.spec.host}:{ports['bad-redis']}", "Redis refused the credentials")
        assert "PDSERVE_REDIS_PASSWORD" in body
        time.sleep(1.5)  # a few more attempts (every 0.5 s)
        assert all(proc.poll() is None for proc in procs.values())
        log = (stack.log_dir / "gateway-bad-nats.log").read_text()
        assert log.count("cannot connect to NATS: the server refused the credentials") == 1, log
        assert "Traceback" not in log and "wrong-nats-pw" not in log, log
        assert _ready(stack.url)[0] == 200  # the stack itself still serves
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=20)


def test_body_and_prompt_limits(stack):
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "x" * (MAX_BODY + 1)}, timeout=30)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]["message"]
    # one token per byte in the demo tokenizer
    r = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "y" * (MAX_PROMPT_TOKENS + 1)}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error"
    assert f"at most {MAX_PROMPT_TOKENS} tokens" in error["message"]
    chat = {"messages": [{"role": "user", "content": "z" * MAX_PROMPT_TOKENS}]}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def _send_marked(url: str, marker: str) -> list[str]:
    """Chat and completion requests, streamed and not, plus refused ones, all carrying `marker`; returns the
    completion texts."""
    texts = []
    chat = {"messages": [{"role": "user", "content": f"remember {marker}"}], "max_tokens": 24, "ignore_eos": True}
    completion = {"prompt": f"say {marker}", "max_tokens": 24, "ignore_eos": True}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        texts.append(choice["message"]["content"] if "message" in choice else choice["text"])
        with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=60) as s:
            assert s.status_code == 200 and "[DONE]" in s.read().decode()
    refused = [
        {"messages": [{"role": marker, "content": marker}]},  # unknown role
        {"messages": [{"role": "user", "content": marker * 40}]},  # over the prompt limit
        {"messages": [{"role": "user", "content": marker}], "stop": [marker] * (MAX_STOP_STRINGS + 1)},
    ]
    for body in refused:
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 400
    return texts


def test_prompts_stay_out_of_logs_unless_asked(stack):
    marker = f"MARK{uuid.uuid4().hex[:12]}"
    texts = _send_marked(stack.url, marker)
    # a second gateway on the same workers, asked to log prompts (what PDSERVE_LOG_PROMPTS=1 does)
    port = free_port()
    logged = stack.spawn("gateway-log-prompts", ["gateway", "--host", stack.spec.host, "--port", str(port),
                         "--model", stack.spec.model], {"PDSERVE_LOG_PROMPTS": "1"})  # fmt: skip
    try:
        url = f"http://{stack.spec.host}:{port}"
        deadline = time.monotonic() + 60
        while _ready(url)[0] != 200:
            assert time.monotonic() < deadline and logged.poll() is None, "the logging gateway never got ready"
            time.sleep(0.3)
        logged_marker = f"LOGGED{uuid.uuid4().hex[:12]}"
        logged_texts = _send_marked(url, logged_marker)
    finally:
        logged.terminate()
        logged.wait(timeout=20)
    time.sleep(0.5)  # the workers' last lines
    quiet_logs = {p.name: p.read_text(errors="replace") for p in stack.log_dir.glob("*.log")}
    asked = quiet_logs.pop("gateway-log-prompts.log")
    assert {"gateway.log", "prefill-0.log", "decode-1.log"} <= set(quiet_logs)
    for name, text in quiet_logs.items():
        assert marker not in text and logged_marker not in text, f"{name} logged a prompt"
        for completion in texts + logged_texts:
            quoted = json.dumps(completion, ensure_ascii=False)[1:-1]
            assert len(quoted) < 12 or quoted not in text, f"{name} logged a completion"
    # asked for: every accepted request's prompt and completion, at INFO, quoted (one line each)
    assert asked.count(f"remember {logged_marker}") == 2 and asked.count(f"say {logged_marker}") == 2
    for completion in logged_texts:
        assert json.dumps(completion, ensure_ascii=False) in asked
    assert "INFO services.gateway.prompt_log" in asked


# ---- limits, unit by unit ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(model_dir) -> ServedModel:
    return ServedModel.load(GatewaySettings(model=str(model_dir), model_name="demo", max_prompt_tokens=10))


def _refusal(call, *args) -> APIError:
    with pytest.raises(APIError) as exc:
        call(*args)
    assert exc.value.status == 400
    return exc.value


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def test_prompt_token_limit(model_dir, limited):
    assert limited.max_prompt_tokens == 10
    prepare_completion(CompletionRequest(prompt=[65] * 10), limited)
    error = _refusal(prepare_completion, CompletionRequest(prompt=[65] * 11), limited)
    assert error.param == "prompt" and "at most 10 tokens" in error.message and "11 tokens" in error.message
    assert _refusal(prepare_completion, CompletionRequest(prompt="a" * 11), limited).param == "prompt"
    error = _refusal(prepare_chat, ChatCompletionRequest(messages=_user("hi")), limited)  # the template's tokens
    assert error.param == "messages" and "at most 10 tokens" in error.message
    # no setting: the context less one token; a setting past the context is held to it
    for setting in (None, 10**9):
        model = ServedModel.load(GatewaySettings(model=str(model_dir), max_prompt_tokens=setting))
        assert model.max_prompt_tokens == model.max_model_len - 1
        error = _refusal(prepare_completion, CompletionRequest(prompt=[65] * model.max_model_len), model)
        assert "maximum context length" in error.message


def test_text_too_long_is_refused_before_tokenizing(limited, monkeypatch):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(limited.tokenizer, "encode", no_tokenizing)
    monkeypatch.setattr(limited.tokenizer, "apply_chat_template", no_tokenizing)
    too_long = "w" * (limited.max_prompt_chars + 1)
    assert "characters cannot fit" in _refusal(prepare_completion, CompletionRequest(prompt=too_long), limited).message
    error = _refusal(prepare_chat, ChatCompletionRequest(messages=_user(too_long)), limited)
    assert error.param == "messages" and "characters cannot fit" in error.message
    many = [ChatMessage(role="user", content="") for _ in range(limited.max_prompt_tokens + 1)]
    error = _refusal(prepare_chat, ChatCompletionRequest(messages=many), limited)
    assert error.param == "messages" and "too many messages" in error.message


def test_stop_lists_are_bounded(model_dir):
    model = ServedModel.load(GatewaySettings(model=str(model_dir)))

    def completion(**kw) -> CompletionRequest:
        return CompletionRequest(prompt="hi", **kw)

    prepare_completion(completion(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=[1] * 256), model)
    assert _refusal(prepare_completion, completion(stop=["s"] * (MAX_STOP_STRINGS + 1)), model).param == "stop"
    assert _refusal(prepare_completion, completion(stop="s" * (MAX_STOP_CHARS + 1)), model).param == "stop"
    error = _refusal(prepare_completion, completion(stop_token_ids=[1] * 257), model)
    assert error.param == "stop_token_ids"


def test_kv_moves_between_real_workers_over_mutual_tls(pki, model_dir):
    """A 1p1d stack whose KV transfer gRPC speaks only mutual TLS: the prefill worker serves with the server
    certificate, the decode worker pulls with the client certificate, and every prompt's KV is pulled (the
    decode worker computes no prompt)."""
    role_args = {
        "prefill": ("--kv-tls-cert", pki["server.pem"], "--kv-tls-key", pki["server.key"]),
        "decode": ("--kv-tls-cert", pki["client.pem"], "--kv-tls-key", pki["client.key"]),
    }
    spec = StackSpec(
        model=str(model_dir), port=free_port(), threads_per_worker=1, env={"PDSERVE_KV_TLS_CA": pki["ca.pem"]},
        role_args=role_args,
    )  # fmt: skip
    stack = start_stack(spec)
    try:
        for prompt in ("over TLS", "and once more"):
            body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        time.sleep(0.5)
        beats = list(heartbeats(stack.nats_url).values())
        decode = [b for b in beats if b.role == "decode"]
        assert len(decode) == 1 and decode[0].prefill_tokens == 0 and decode[0].decode_tokens > 0
        # The port speaks TLS only: a plaintext call does not get through the handshake.
        (prefill,) = [b for b in beats if b.role == "prefill"]
        assert prefill.rpc_address and _plaintext_call_code(prefill.rpc_address) == "UNAVAILABLE"
    finally:
        stack.stop()


def _plaintext_call_code(address: str) -> str:
    """The status of a plaintext Connect with an empty body (INVALID_ARGUMENT from a plaintext server)."""

    async def call() -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await channel.unary_unary("/pdserve.kv.v1.KvTransfer/Connect")(b"", timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return "OK"

    return asyncio.run(call())
