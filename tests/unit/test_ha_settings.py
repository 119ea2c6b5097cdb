"""The replicated control plane's settings and wiring, without servers: the NATS seeds and JetStream replicas, the
Redis Sentinels (a client that asks them for the primary), and `pdserve up --ha`."""

from __future__ import annotations

import pytest
from redis.asyncio.sentinel import SentinelConnectionPool

from shared import bus
from shared.redis_client import redis_client
from shared.settings import GatewaySettings, WorkerSettings, from_env

SECRET = "s" * 16


def test_the_replicated_planes_settings_parse():
    env = {
        "PDSERVE_NATS_URL": "nats://a:4222, nats://b:4222,nats://c:4222",
        "PDSERVE_JETSTREAM_REPLICAS": "3",
        "PDSERVE_REDIS_SENTINELS": "s1:26379, s2:26379,s3:26379",
        "PDSERVE_REDIS_SENTINEL_MASTER": "mymaster",
    }
    gateway = from_env(GatewaySettings, env)
    assert gateway.jetstream_replicas == 3
    assert gateway.redis_sentinels == ("s1:26379", "s2:26379", "s3:26379")
    assert gateway.redis_sentinel_master == "mymaster"
    assert bus._servers_and_credentials(gateway.nats_url)[0] == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    worker = from_env(WorkerSettings, env | {"PDSERVE_CLUSTER_SECRET": SECRET}, role="decode")
    assert (worker.jetstream_replicas, worker.redis_sentinels) == (3, gateway.redis_sentinels)
    defaults = from_env(GatewaySettings, {})
    assert (defaults.jetstream_replicas, defaults.redis_sentinels, defaults.redis_sentinel_master) == (1, (), "pdserve")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_JETSTREAM_REPLICAS": "0"}, "jetstream_replicas must be 1-5"),
        ({"PDSERVE_JETSTREAM_REPLICAS": "6"}, "jetstream_replicas must be 1-5"),
        ({"PDSERVE_REDIS_SENTINELS": "s1:26379,s2"}, "'s2' is not host:port"),
        ({"PDSERVE_REDIS_SENTINELS": "s1:port"}, "'s1:port' is not host:port"),
    ],
)
def test_bad_values_are_refused_by_every_service(env, message):
    with pytest.raises(ValueError, match=message):
        from_env(GatewaySettings, env)
    with pytest.raises(ValueError, match=message):
        from_env(WorkerSettings, env | {"PDSERVE_CLUSTER_SECRET": SECRET}, role="prefill")


def test_with_sentinels_the_client_asks_them_for_the_primary():
    env = {
        "PDSERVE_REDIS_URL": "redis://ignored-host:6379/2",
        "PDSERVE_REDIS_PASSWORD": "pw",
        "PDSERVE_REDIS_SENTINELS": "127.0.0.1:26379,127.0.0.1:26380",
    }
    client = redis_client(from_env(GatewaySettings, env), socket_timeout=2.0)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.is_master
    assert pool.service_name == "pdserve"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["socket_timeout"] == 2.0
    sentinels = pool.sentinel_manager.sentinels  # asked with the same password and timeouts
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]  # fmt: skip
    assert all(s.connection_pool.connection_kwargs["password"] == "pw" for s in sentinels)
    assert all(s.connection_pool.connection_kwargs["socket_timeout"] == 2.0 for s in sentinels)
    plain = redis_client(from_env(GatewaySettings, {"PDSERVE_REDIS_URL": "redis://h:6379/0"}))
    assert not isinstance(plain.connection_pool, SentinelConnectionPool)


def test_up_ha_asks_the_stack_for_the_replicated_servers(monkeypatch, tmp_path):
    import services.cli as cli
    import services.local.supervisor as supervisor

    specs = []

    class FakeSupervisor:
        def __init__(self, stack, *args, **kwargs) -> None:
            specs.append(stack.spec)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", FakeSupervisor)
    monkeypatch.setattr("services.local.preflight.preflight", lambda *_a, **_kw: None)  # no checkpoint here
    model = tmp_path / "m"
    model.mkdir()
    assert cli.main(["up", "--model", str(model), "--ha"]) == 0
    assert cli.main(["up", "--model", str(model)]) == 0
    assert [spec.ha for spec in specs] == [True, False]
