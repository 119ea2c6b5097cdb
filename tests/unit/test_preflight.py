"""`pdserve up`'s preflight (services/local/preflight.py): what every service would refuse is said before anything
starts — a checkpoint that does not load, settings or flags that do not parse, a port in use — and a good
configuration passes."""

from __future__ import annotations

import socket

import pytest

from services.cli import _worker_settings
from services.local.infra import free_port
from services.local.preflight import preflight
from services.local.stack import StackSpec


def spec(model, **kwargs) -> StackSpec:
    return StackSpec(model=str(model), port=kwargs.pop("port", free_port()), **kwargs)


def test_a_good_configuration_passes(model_dir):
    preflight(spec(model_dir, role_args={"decode": ("--kv-lease-s", "5")}), _worker_settings)


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        preflight(spec(tmp_path / "nonexistent"), _worker_settings)


def test_a_config_json_that_does_not_load_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')  # no sizes
    with pytest.raises(ValueError, match="config.json"):
        preflight(spec(tmp_path), _worker_settings)


@pytest.mark.parametrize(
    ("role_args", "message"),
    [
        ({"decode": ("--bogus", "3")}, "the decode workers' settings: unrecognized arguments: --bogus 3"),
        ({"prefill": ("--kv-lease-s", "-1")}, "the prefill workers' settings: kv_lease_s must be positive"),
        ({"prefill": ("--kv-lease-s",)}, "expected one argument"),
    ],
)
def test_a_flag_a_worker_would_refuse_is_named(model_dir, role_args, message):
    with pytest.raises(ValueError, match=message):
        preflight(spec(model_dir, role_args=role_args), _worker_settings)


def test_a_setting_in_the_environment_is_checked_for_every_service(model_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_BLOCK_SIZE", "not-a-number")
    with pytest.raises(ValueError, match="PDSERVE_BLOCK_SIZE"):
        preflight(spec(model_dir), _worker_settings)
    monkeypatch.delenv("PDSERVE_BLOCK_SIZE")
    with pytest.raises(ValueError, match="the gateway's settings: PDSERVE_MAX_PENDING_REQUESTS"):
        preflight(spec(model_dir, env={"PDSERVE_MAX_PENDING_REQUESTS": "many"}), _worker_settings)


def test_a_port_in_use_is_named_with_its_flag(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            preflight(spec(model_dir, port=port), _worker_settings)
        with pytest.raises(ValueError, match="--supervisor-metrics-port"):
            preflight(spec(model_dir), _worker_settings, [(port, "--supervisor-metrics-port")])
    preflight(spec(model_dir), _worker_settings, [(0, "--supervisor-metrics-port")])  # 0: any free one, unchecked
