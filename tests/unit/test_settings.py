"""Settings declared once (shared/config_fields.py): environment names, flags and help come from the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from services.cli import main as cli_main
from shared.config_fields import add_flags, flat, from_args, from_env, knobs, section
from shared.engine.config import Dtype, EngineConfig
from shared.settings import GatewaySettings, KvBackend, KvFallback, WorkerRole, WorkerSettings

SECRET = "s" * 16


# ---- the mechanism, on a settings class made here -----------------------------------------------------


@dataclass(frozen=True)
class Inner:
    depth: int = 2
    """How deep it goes."""
    legacy: str = flat("old_name", "x")
    """Named as before the section existed."""


@dataclass(frozen=True)
class Toy:
    speed: float = 1.5
    """How fast, in widgets per second (100% of them)."""
    tags: tuple[str, ...] = ()
    """Labels, comma-separated."""
    limit: int | None = None
    """An upper bound; empty = none."""
    enable_turbo: bool = True
    """Turbo mode."""
    token: str | None = field(default=None, repr=False)
    """A secret."""
    inner: Inner = section(Inner, prefix="in_")


def _parser(cls: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, cls)
    return p


def test_a_field_gets_an_env_name_a_flag_and_its_docstring_as_help():
    by_name = {k.name: k for k in knobs(Toy)}
    assert by_name["speed"].env == "PDSERVE_SPEED" and by_name["speed"].flags == ["--speed"]
    assert by_name["speed"].doc == "How fast, in widgets per second (100% of them)."
    help_text = _parser(Toy).format_help()
    assert "How fast, in widgets per second (100% of them)." in " ".join(help_text.split())
    assert "PDSERVE_SPEED" in help_text and "default 1.5" in help_text


def test_sections_prefix_their_knobs_unless_a_knob_keeps_a_flat_name():
    by_name = {k.name: k for k in knobs(Toy)}
    assert by_name["in_depth"].path == ("inner", "depth") and by_name["in_depth"].env == "PDSERVE_IN_DEPTH"
    assert by_name["old_name"].path == ("inner", "legacy")
    toy = from_env(Toy, {"PDSERVE_IN_DEPTH": "5", "PDSERVE_OLD_NAME": "y", "PDSERVE_SPEED": "2"})
    assert toy == Toy(speed=2.0, inner=Inner(depth=5, legacy="y"))
    args = _parser(Toy).parse_args(["--in-depth", "7", "--old-name", "z"])
    assert from_args(Toy, args, {}).inner == Inner(depth=7, legacy="z")


def test_values_parse_by_type():
    toy = from_env(Toy, {"PDSERVE_TAGS": "a, b,,c", "PDSERVE_LIMIT": "", "PDSERVE_ENABLE_TURBO": "no"})
    assert toy.tags == ("a", "b", "c") and toy.limit is None and toy.enable_turbo is False
    assert from_env(Toy, {"PDSERVE_LIMIT": "9"}).limit == 9


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_SPEED": "fast"}, "PDSERVE_SPEED='fast' is not a valid float"),
        ({"PDSERVE_IN_DEPTH": "1.5"}, "PDSERVE_IN_DEPTH='1.5' is not a valid int"),
        ({"PDSERVE_ENABLE_TURBO": "maybe"}, "PDSERVE_ENABLE_TURBO='maybe' is not a valid bool"),
        ({"PDSERVE_TRANSFER_BACKEND": "tcp"}, "PDSERVE_TRANSFER_BACKEND='tcp' is not a valid gloo | nccl"),
    ],
)
def test_parse_errors_name_the_variable(env, message):
    cls = WorkerSettings if "PDSERVE_TRANSFER_BACKEND" in env else Toy
    with pytest.raises(ValueError) as exc:
        from_env(cls, env)
    assert str(exc.value) == message


def test_flag_parse_errors_name_the_flag():
    with pytest.raises(ValueError, match=r"--speed='fast' is not a valid float"):
        from_args(Toy, _parser(Toy).parse_args(["--speed", "fast"]), {})


def test_secret_files_and_secrets_out_of_reprs_and_flags(tmp_path):
    path = tmp_path / "token"
    path.write_text("hunter2-hunter2\n")
    toy = from_env(Toy, {"PDSERVE_TOKEN_FILE": str(path)})
    assert toy.token == "hunter2-hunter2" and "hunter2" not in repr(toy)
    assert from_env(Toy, {"PDSERVE_TOKEN": "direct", "PDSERVE_TOKEN_FILE": str(path)}).token == "direct"
    with pytest.raises(ValueError, match="PDSERVE_TOKEN_FILE='/nonexistent' cannot be read"):
        from_env(Toy, {"PDSERVE_TOKEN_FILE": "/nonexistent"})
    assert "--token" not in _parser(Toy).format_help()  # a command line is visible to every user


def test_cli_overrides_env_and_an_unset_flag_leaves_it():
    env = {"PDSERVE_SPEED": "3", "PDSERVE_IN_DEPTH": "4"}
    toy = from_args(Toy, _parser(Toy).parse_args(["--speed", "9", "--no-turbo"]), env)
    assert toy.speed == 9.0 and toy.inner.depth == 4 and toy.enable_turbo is False


def test_enable_flags_answer_to_the_short_form_both_ways():
    p = _parser(Toy)
    assert from_args(Toy, p.parse_args(["--no-turbo"]), {"PDSERVE_ENABLE_TURBO": "1"}).enable_turbo is False
    assert from_args(Toy, p.parse_args(["--turbo"]), {"PDSERVE_ENABLE_TURBO": "0"}).enable_turbo is True
    assert from_args(Toy, p.parse_args([]), {"PDSERVE_ENABLE_TURBO": "0"}).enable_turbo is False


def test_an_override_that_is_no_setting_is_an_error():
    with pytest.raises(TypeError, match="no setting 'speeed'"):
        from_env(Toy, {}, speeed=1)


def test_two_knobs_with_one_name_are_refused():
    @dataclass(frozen=True)
    class Clash:
        depth: int = 1
        inner: Inner = section(Inner, prefix="")

    with pytest.raises(ValueError, match="depth"):
        knobs(Clash)


# ---- the services' settings ----------------------------------------------------------------------------


def test_existing_environment_names_still_work(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    password = tmp_path / "nats"
    password.write_text("nats-pw")
    env = {
        "PDSERVE_KV_LEASE_S": "7.5",
        "PDSERVE_TRANSFER_BACKEND": "nccl",
        "PDSERVE_MAX_NUM_SEQS": "3",
        "PDSERVE_MAX_NUM_BATCHED_TOKENS": "99",
        "PDSERVE_ENABLE_CHUNKED_PREFILL": "false",
        "PDSERVE_CLUSTER_SECRET_FILE": str(secret),
        "PDSERVE_NATS_PASSWORD_FILE": str(password),
        "PDSERVE_MODEL": "/models/m",
        "PDSERVE_DTYPE": "bfloat16",
        "PDSERVE_THREADS": "2",
        "PDSERVE_DEVICE": "cuda",
        "PDSERVE_RPC_HOST": "0.0.0.0",
        "PDSERVE_RPC_PORT": "5000",
        "PDSERVE_ADVERTISE_HOST": "prefill",
        "PDSERVE_KV_TRANSFER_TIMEOUT_S": "4",
        "PDSERVE_KV_CHUNK_BYTES": "0",
        "PDSERVE_KV_SHM_BYTES": "0",
        "PDSERVE_KV_FALLBACK": "fail",
        "PDSERVE_FAULT_KV_SEND_MIDWAY": "1",
        "PDSERVE_METRICS_PORT": "9100",
        "PDSERVE_JOB_ACK_WAIT_S": "8",
    }
    s = from_env(WorkerSettings, env, role="prefill")
    assert s.role is WorkerRole.PREFILL and s.cluster_secret == SECRET and s.nats_password == "nats-pw"
    e = s.engine
    assert (e.model, e.dtype, e.threads, e.device) == ("/models/m", Dtype.BFLOAT16, 2, "cuda")
    sched = s.engine.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.enable_chunked_prefill) == (3, 99, False)
    kv = s.kv
    assert (kv.lease_s, kv.backend, kv.rpc_host, kv.rpc_port) == (7.5, KvBackend.NCCL, "0.0.0.0", 5000)
    assert kv.advertise_host == "prefill"
    assert (kv.timeout_s, kv.chunk_bytes, kv.fallback, kv.fault_send_midway) == (4.0, 0, KvFallback.FAIL, True)
    assert kv.shm_bytes == 0
    assert s.metrics_port == 9100 and s.job_ack_wait_s == 8.0 and s.served_model_name == "m"
    assert SECRET not in repr(s) and "nats-pw" not in repr(s)

    g = from_env(GatewaySettings, {"PDSERVE_API_KEYS": "k1,k2", "PDSERVE_MODEL": "/models/m", "PDSERVE_PORT": "81"})
    assert g.api_keys == ("k1", "k2") and g.port == 81 and g.served_model_name == "m" and "k1" not in repr(g)


def test_every_service_setting_has_help():
    for cls in (GatewaySettings, WorkerSettings):
        assert [k.name for k in knobs(cls) if not k.doc] == [], cls.__name__


def test_closed_sets_are_the_transfer_planes_and_the_loaders():
    from shared.kv.transfer import TransferBackend
    from shared.model.loader import DTYPES

    assert {b.value for b in KvBackend} == {b.value for b in TransferBackend}
    assert {d.value for d in Dtype} == set(DTYPES)


def test_worker_validation_keeps_its_messages():
    with pytest.raises(ValueError, match="a decode worker needs cluster_secret"):
        from_env(WorkerSettings, {}, role="decode")
    with pytest.raises(ValueError, match="kv_lease_s must be positive"):
        from_env(WorkerSettings, {"PDSERVE_KV_LEASE_S": "0"})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        from_env(WorkerSettings, {"PDSERVE_CLUSTER_SECRET": "short"})
    with pytest.raises(ValueError, match="port must be 1-65535"):
        from_env(GatewaySettings, {"PDSERVE_PORT": "0"})
    with pytest.raises(ValueError, match=r"--dtype='float8' is not a valid float32 \| bfloat16 \| float16"):
        from_env(WorkerSettings, {}, dtype="float8")
    with pytest.raises(ValueError, match="unsupported dtype"):  # built directly, not parsed
        EngineConfig(model="m", dtype="float8")


def test_ticket_secret_is_the_cluster_secret_of_a_role_that_signs_tickets():
    assert from_env(WorkerSettings, {"PDSERVE_CLUSTER_SECRET": SECRET}, role="decode").ticket_secret == SECRET
    with pytest.raises(ValueError, match="a mixed worker has no cluster_secret"):
        _ = WorkerSettings().ticket_secret


def _parsed(monkeypatch, argv: list[str]) -> argparse.Namespace:
    """The arguments `pdserve <argv>` would start its service with (the service itself is not started)."""
    import services.cli as cli
    import services.gateway.main as gateway_main

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(gateway_main, "run", seen.append)
    monkeypatch.setattr(cli, "_worker", seen.append)
    cli.main(argv)
    return seen[0]


def test_existing_cli_flags_still_work(monkeypatch):
    monkeypatch.setattr("os.environ", {"PDSERVE_CLUSTER_SECRET": SECRET})
    argv = ["prefill", "--model", "/m", "--worker-id", "w1", "--threads", "2", "--dtype", "float16"]
    argv += ["--block-size", "8", "--kv-cache-bytes", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    argv += ["--no-chunked-prefill", "--max-model-len", "64", "--rpc-host", "0.0.0.0", "--rpc-port", "7"]
    argv += ["--advertise-host", "me", "--kv-lease-s", "3", "--metrics-host", "0.0.0.0", "--metrics-port", "9"]
    argv += ["--nats-url", "nats://n:1", "--redis-url", "redis://r:2", "--trace-file", "t.jsonl", "--model-name", "x"]
    s = from_args(WorkerSettings, _parsed(monkeypatch, argv))
    assert s.role is WorkerRole.PREFILL and s.worker_id == "w1" and s.served_model_name == "x"
    e = s.engine
    assert (e.model, e.threads, e.dtype, e.block_size, e.kv_cache_bytes, e.max_model_len) == (
        "/m", 2, "float16", 8, 1024, 64
    )  # fmt: skip
    assert e.scheduler.max_num_seqs == 4 and e.scheduler.max_num_batched_tokens == 64
    assert e.scheduler.enable_chunked_prefill is False
    assert (s.kv.rpc_host, s.kv.rpc_port, s.kv.advertise_host, s.kv.lease_s) == ("0.0.0.0", 7, "me", 3.0)
    assert (s.metrics_host, s.metrics_port, s.nats_url, s.redis_url, s.trace_file) == (
        "0.0.0.0", 9, "nats://n:1", "redis://r:2", "t.jsonl"
    )  # fmt: skip

    argv = ["gateway", "--model", "/m", "--host", "127.0.0.1", "--port", "8001", "--api-keys", "a,b"]
    argv += ["--max-pending-requests", "4", "--kv-overcommit", "2", "--drain-timeout-s", "5"]
    g = from_args(GatewaySettings, _parsed(monkeypatch, argv))
    assert (g.model, g.host, g.port, g.api_keys) == ("/m", "127.0.0.1", 8001, ("a", "b"))
    assert (g.max_pending_requests, g.kv_overcommit, g.drain_timeout_s) == (4, 2.0, 5.0)


def test_worker_help_shows_the_docstrings(capsys):
    with pytest.raises(SystemExit):
        cli_main(["decode", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Prefill workers free a request's KV if no decode worker pulled it within this time." in out
    assert "PDSERVE_KV_LEASE_S" in out and "--kv-fallback {recompute,fail}" in out
    assert "--role" not in out  # the subcommand is the role


def test_prefix_caching_is_on_by_default_and_one_flag_or_variable_turns_it_off(monkeypatch):
    monkeypatch.setattr("os.environ", {})
    assert from_env(WorkerSettings, {}).engine.enable_prefix_caching is True
    assert from_env(WorkerSettings, {"PDSERVE_ENABLE_PREFIX_CACHING": "0"}).engine.enable_prefix_caching is False
    s = from_args(WorkerSettings, _parsed(monkeypatch, ["mixed", "--model", "/m", "--no-prefix-caching"]))
    assert s.engine.enable_prefix_caching is False
    with pytest.raises(SystemExit):  # the hash root is the served model name (engine_factory.py), no flag
        _parsed(monkeypatch, ["mixed", "--model", "/m", "--prefix-cache-namespace", "x"])
