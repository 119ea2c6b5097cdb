"""The replicated control plane (`pdserve up --ha`, StackSpec.ha) under streaming load, nodes killed for real:

  - it comes up replicated: 3 nats-server nodes in one cluster, the services' streams and their consumers at 3
    replicas, every service given the three seeds; a Redis primary, its replica and 3 Sentinels that know them;
  - kill -9 of one NATS node (the gateway's, or the jobs stream's leader) while streams run, new requests arrive
    and clients leave: no job and no cancel is lost and no client sees a position twice (the gateway drops the
    duplicates JetStream's redeliveries and the workers' resends put on the wire); token events, being core NATS,
    are lost with the dead node and resent when the gateway asks (shared/worker/resend.py): no request fails;
  - kill -9 of the Redis primary right after a hand-off, under a stream of new requests: the Sentinels promote
    the replica, the services follow, every request completes token-exact (none fails: a KV location lost with
    the old primary is recomputed), hand-offs resume through the new primary, nothing is left behind;
  - kill -9 of the Redis replica, or of the Sentinel every service asks first, under the same load: nothing
    visible (no failover, no request fails, a client opened meanwhile finds the primary); the node rejoins;
  - `pdserve up --ha` restarts a killed NATS node, which rejoins the cluster, and a killed Redis primary, which
    comes back as the new primary's replica.

Each kill reports the stall (longest gap between two tokens of a stream) at p50 / p99 over the open streams, and
the Redis one the time from the kill to the first KV location read on the new primary (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from services.local.children import descendants, running
from services.local.infra import free_port
from services.local.replicated import RedisSentinels
from services.local.stack import Stack, StackSpec
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.messages import CANCELS_STREAM, JOBS_STREAM, FinishedEvent, QueuedEvent, TokensEvent
from shared.model.tokenizer import Tokenizer
from shared.redis_client import redis_client
from shared.settings import GatewaySettings, from_env
from tests.chaos import EventWatch, Load, Outcome, percentile, settled, stream_completion, tally
from tests.e2e_support import scraped_total, start_stack

pytestmark = pytest.mark.slow  # an 8-server control plane and a stack, nodes killed: minutes on 2 cores


N = 6  # streams open at each kill
MAX_TOKENS = 128
PROMPTS = ["The quick brown fox", "héllo wörld, 世界", "Tell me a story about disaggregation", "a b c d e f g"]
HAND_OFF_TOKENS = 48  # the Redis scenario's requests: short, so that hand-offs keep coming
LEAVER_MAX_TOKENS = 1800  # long enough that a lost cancel would show: its worker would run them all
FAST = {
    "PDSERVE_WORKER_TTL_S": "2",
    "PDSERVE_STALL_TIMEOUT_S": "10",
    "PDSERVE_KV_LEASE_S": "4",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "5",
    "PDSERVE_JOB_ACK_WAIT_S": "6",
    "PDSERVE_FIRST_TOKEN_TIMEOUT_S": "60",
    "PDSERVE_DRAIN_TIMEOUT_S": "5",
}


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[tuple[str, int], str]:
    """Greedy text of every prompt at the lengths asked here, from the single-process engine."""
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, max_model_len=2048)
    outputs = engine.generate(
        [tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    lengths = (MAX_TOKENS, HAND_OFF_TOKENS, 24)
    return {(p, n): tok.decode(out[:n]) for p, out in zip(PROMPTS, outputs, strict=True) for n in lengths}


@pytest.fixture(scope="module")
def ha_stack(model_dir):
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=1, threads_per_worker=1, env=FAST,
                     ha=True)  # fmt: skip
    stack = start_stack(spec)
    yield stack
    stack.stop()


def prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def report(what: str, **numbers: object) -> None:
    """A measurement, printed (run with -s to see it) and appended to $HA_REPORT when set (docs/reliability.md)."""
    line = json.dumps({"scenario": what, **numbers})
    print(line)
    if path := os.environ.get("HA_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")


def stream_info(stack: Stack, stream: str):
    async def ask():
        nc = await nats.connect(stack.nats_url.split(","))
        try:
            return await nc.jetstream().stream_info(stream)
        finally:
            await nc.close()

    return asyncio.run(ask())


def consumers(stack: Stack, stream: str) -> list:
    async def ask():
        nc = await nats.connect(stack.nats_url.split(","))
        try:
            return await nc.jetstream().consumers_info(stream)
        finally:
            await nc.close()

    return asyncio.run(ask())


def node_serving(stack: Stack, client_prefix: str) -> str:
    """The NATS node a client (by connection name, e.g. the gateway's `gateway-…`) is connected to."""
    assert stack.nats_cluster is not None
    for node, monitor in stack.nats_cluster.monitor_urls.items():
        connections = httpx.get(f"{monitor}/connz?limit=1024", timeout=5).json().get("connections") or []
        if any((c.get("name") or "").startswith(client_prefix) for c in connections):
            return node
    raise AssertionError(f"no NATS node serves a client named {client_prefix}*")


def wait_current(monitor: str, timeout_s: float = 60.0) -> float:
    """Until a NATS node's /healthz says it is current (routes up, JetStream caught up with the meta leader and its
    streams); seconds it took."""
    start = time.monotonic()
    while True:
        try:
            if httpx.get(f"{monitor}/healthz", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{monitor}/healthz not ok after {timeout_s:g} s")
        time.sleep(0.2)


class Leaver:
    """A client that streams a long completion, reads a few tokens, then hangs up when told: the gateway cancels."""

    def __init__(self, url: str, prompt: str) -> None:
        self.request_id: str | None = None
        self.left_at: float | None = None
        self.started = threading.Event()
        self.leave = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, prompt), daemon=True)
        self._thread.start()

    def _run(self, url: str, prompt: str) -> None:
        body = {"model": "demo", "prompt": prompt, "max_tokens": LEAVER_MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.request_id = json.loads(line[6:])["id"]
                    self.started.set()
                    break
            self.leave.wait(120)
            self.left_at = time.monotonic()  # leaving the `with`: the connection closes

    def join(self) -> None:
        self._thread.join(30)


def wire_duplicates(watch: EventWatch) -> int:
    """Token positions that reached the gateway's subjects more than once (the gateway must drop all but one)."""
    outputs = [e for e in watch.snapshot() if isinstance(e, TokensEvent | FinishedEvent)]
    seen = Counter((e.request_id, e.seq + i) for e in outputs for i in range(len(e.token_ids)))
    return sum(n - 1 for n in seen.values() if n > 1)


def check_streams(outcomes: list[Outcome], reference, what: str) -> tuple[dict[str, int], list[str]]:
    """No stream lost or broken (never: positions once each, complete, [DONE]), every completed one equal to the
    engine's; the failures' errors, for the caller to judge."""
    counts = tally(outcomes)
    lost = [(o.prompt[:20], o.status, o.exception, o.error, len(o.pieces)) for o in outcomes if o.verdict == "lost"]
    assert not lost, f"{what}: lost {lost}"
    for o in outcomes:
        if o.verdict == "completed":
            assert o.text == reference[(o.prompt, o.max_tokens)], f"{what}: {o.prompt!r} differs from the engine's"
    return counts, [o.error or "" for o in outcomes if o.verdict == "failed_cleanly"]


def test_ha_stack_is_replicated(ha_stack):
    stack = ha_stack
    assert stack.nats_cluster is not None and stack.redis_sentinels is not None
    env = stack.service_env()
    assert len(env["PDSERVE_NATS_URL"].split(",")) == 3  # every service is given the three seeds
    assert env["PDSERVE_JETSTREAM_REPLICAS"] == "3"
    assert env["PDSERVE_REDIS_SENTINELS"] == stack.redis_sentinels.addresses
    for node, monitor in stack.nats_cluster.monitor_urls.items():  # one cluster: each node routes to the others
        routes = httpx.get(f"{monitor}/routez", timeout=5).json()["routes"]
        assert {r["remote_name"] for r in routes} == set(stack.nats_cluster.monitor_urls) - {node}, node
    for name in (JOBS_STREAM, CANCELS_STREAM):
        info = stream_info(stack, name)
        assert info.config.num_replicas == 3, name
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2, info.cluster
        for consumer in consumers(stack, name):  # the workers' job queues, and each worker's cancel reader
            assert consumer.cluster is not None and len(consumer.cluster.replicas or []) == 2, consumer
    assert len(consumers(stack, CANCELS_STREAM)) == 2  # one reader per worker, each at 3 replicas
    primary = stack.redis_sentinels.primary()
    assert primary is not None and primary.name == "redis-0"
    info = Redis.from_url(stack.redis_url).info("replication")
    assert info["role"] == "master" and info["connected_slaves"] == 1
    for sentinel in stack.redis_sentinels.sentinels:
        with Redis(sentinel.host, sentinel.port, password=stack.redis_sentinels.password) as client:
            state = client.sentinel_master("pdserve")
        assert state["num-slaves"] == 1 and state["num-other-sentinels"] == 2, state
    outcome = stream_completion(stack.url, PROMPTS[0], 24)
    assert outcome.verdict == "completed", outcome


@pytest.mark.parametrize("victim", ["gateway-node", "jobs-leader"])
def test_a_nats_node_killed_under_streaming_load(ha_stack, reference, victim):
    """kill -9 of one NATS node while N streams run; right after it N more requests arrive (their jobs published
    while the stream may have no leader) and two clients hang up (their cancels likewise)."""
    stack = ha_stack
    assert stack.nats_cluster is not None
    watch = EventWatch(stack.nats_url)
    leavers = [Leaver(stack.url, p) for p in PROMPTS[:2]]
    try:
        for leaver in leavers:
            assert leaver.started.wait(60)
        load = Load(stack.url, prompts(N), MAX_TOKENS)
        load.progress.wait(lambda p: min(p.counts) >= 8)
        if victim == "gateway-node":
            node = node_serving(stack, "gateway-")
        else:
            leader = stream_info(stack, JOBS_STREAM).cluster
            assert leader is not None and leader.leader is not None
            node = leader.leader
        server = next(s for s in stack.infra if s.name == node)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        server.proc.wait(10)
        newcomers = Load(stack.url, prompts(N), 24)  # jobs published as the cluster reacts
        for leaver in leavers:  # cancels likewise
            leaver.leave.set()
        outcomes, arrived = load.results(), newcomers.results()
        for leaver in leavers:
            leaver.join()
        server.restart()  # as `pdserve up` does: same ports, same store; it rejoins
        rejoined_s = wait_current(stack.nats_cluster.monitor_urls[node])

        counts, failures = check_streams(outcomes, reference, f"{node} killed ({victim})")
        new_counts, new_failures = check_streams(arrived, reference, f"arrivals after {node} killed")
        stalls = [o.longest_gap_s for o in outcomes if o.verdict == "completed"]  # each was open at the kill
        report(
            f"nats node killed ({victim})",
            node=node,
            streams=counts,
            new_requests=new_counts,
            stall_p50_s=round(percentile(stalls, 50), 3) if stalls else None,
            stall_p99_s=round(percentile(stalls, 99), 3) if stalls else None,
            new_requests_first_token_max_s=round(
                max((o.arrivals[0] - killed_at for o in arrived if o.arrivals), default=-1), 2
            ),
            wire_duplicates=wire_duplicates(watch),
            rejoined_s=round(rejoined_s, 2),
        )
        # no job lost: every request got its first token (a lost job would fail on the first-token timeout)
        assert all(o.pieces for o in outcomes + arrived), "a request never got its first token"
        settled(stack)  # nothing held or left behind: every KV block free, no pd:* key
        # no cancel lost: the leavers' requests ended with their cancels, long before their max_tokens
        finished = {e.request_id for e in watch.snapshot() if isinstance(e, FinishedEvent)}
        assert not finished & {leaver.request_id for leaver in leavers}, "a cancel never reached its worker"
        # token events sent through the dead node were lost (core NATS): the workers resent them when asked
        assert not failures + new_failures, failures + new_failures
    finally:
        watch.close()


def wait_watched(plane: RedisSentinels, timeout_s: float = 60.0) -> float:
    """Until every Sentinel answers and sees the replica up and in sync, and the other Sentinels up (a failover needs
    them all); seconds it took."""
    start = time.monotonic()
    while True:
        views = []
        for sentinel in plane.sentinels:
            with (
                contextlib.suppress(RedisError),  # not up yet: refused, or no answer
                Redis(sentinel.host, sentinel.port, password=plane.password, socket_timeout=1) as c,
            ):
                replicas: Any = c.sentinel_slaves(plane.master)  # redis-py parses each into a dict
                others: Any = c.sentinel_sentinels(plane.master)
                views.append(
                    len(replicas) == len(plane.nodes) - 1
                    and all(not r["is_sdown"] and r.get("master-link-status") == "ok" for r in replicas)
                    and len(others) == len(plane.sentinels) - 1
                    and all(not o["is_sdown"] for o in others)
                )
        if len(views) == len(plane.sentinels) and all(views):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"the Sentinels do not all see the replica and each other up after {timeout_s:g} s")
        time.sleep(0.2)


@pytest.mark.parametrize("victim", ["redis-replica", "sentinel"])
def test_the_redis_replica_or_a_sentinel_killed_under_streaming_load(ha_stack, reference, victim):
    """kill -9 of the Redis replica, or of the Sentinel every service asks first, while N streams run and N more
    requests arrive (their hand-offs written while it is down): nothing visible. The primary serves, 2 Sentinels
    still make a quorum, no failover happens; a Redis client opened now (as a starting service's) finds the
    primary through the Sentinels left. Started again, the node rejoins: the replica resyncs, the Sentinel sees the
    others."""
    stack = ha_stack
    plane = stack.redis_sentinels
    assert plane is not None
    primary = plane.primary()
    assert primary is not None
    server = next(n for n in plane.nodes if n is not primary) if victim == "redis-replica" else plane.sentinels[0]
    assert server.proc is not None
    watch = EventWatch(stack.nats_url)
    try:
        load = Load(stack.url, prompts(N), MAX_TOKENS)
        load.progress.wait(lambda p: min(p.counts) >= 8)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        newcomers = Load(stack.url, prompts(N), 24)  # hand-offs through Redis while the node is down
        outcomes, arrived = load.results(), newcomers.results()
        settings = from_env(GatewaySettings, stack.service_env())

        async def probe() -> bytes | str | None:  # what a service opening its Redis client now would get
            client = redis_client(settings, socket_timeout=2.0, socket_connect_timeout=1.0)
            try:
                await client.set("probe:node-loss", victim, ex=60)
                return await client.get("probe:node-loss")
            finally:
                await client.delete("probe:node-loss")
                await client.aclose()

        assert asyncio.run(probe()) == victim.encode()
        assert plane.primary() is primary  # no failover
        server.restart()  # as `pdserve up` does (a replica comes back following the Sentinels' primary)
        rejoined_s = wait_watched(plane)
    finally:
        watch.close()
    counts, failures = check_streams(outcomes, reference, f"{victim} killed")
    new_counts, new_failures = check_streams(arrived, reference, f"arrivals after {victim} killed")
    stalls = [o.longest_gap_s for o in outcomes if o.verdict == "completed"]  # each was open at the kill
    report(
        f"{victim} killed",
        node=server.name,
        streams=counts,
        new_requests=new_counts,
        stall_p50_s=round(percentile(stalls, 50), 3) if stalls else None,
        stall_p99_s=round(percentile(stalls, 99), 3) if stalls else None,
        wire_duplicates=wire_duplicates(watch),
        rejoined_s=round(rejoined_s, 2),
    )
    assert not failures + new_failures, failures + new_failures
    assert counts["completed"] == counts["sent"] == N and new_counts["completed"] == new_counts["sent"] == N
    settled(stack)  # nothing held or left behind: every KV block free, no pd:* key
    if victim == "redis-replica":
        with Redis.from_url(stack.redis_url) as client:
            assert client.info("replication")["connected_slaves"] == 1


def test_the_redis_primary_killed_at_a_hand_off(ha_stack, reference):
    """kill -9 of the Redis primary right after a prefill worker recorded a KV location, under a stream of new
    requests (4 clients back to back): the Sentinels promote the replica; every request completes token-exact,
    none fails; those whose location was lost are recomputed; hand-offs resume through the new primary."""
    stack = ha_stack
    plane = stack.redis_sentinels
    assert plane is not None
    old = plane.primary()
    assert old is not None and old.proc is not None
    new = next(n for n in plane.nodes if n is not old)
    decode_metrics = f"http://127.0.0.1:{stack.metrics_ports['decode-1']}/metrics"
    recomputed_before = scraped_total(decode_metrics, "pdserve:prompt_tokens_total")
    pulls_before = scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count")
    watch = EventWatch(stack.nats_url)
    outcomes: list[Outcome] = []
    lock, stop = threading.Lock(), threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            outcome = stream_completion(stack.url, PROMPTS[i % len(PROMPTS)], HAND_OFF_TOKENS)
            with lock:
                outcomes.append(outcome)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in clients:
        t.start()
    try:

        def hand_offs(w: EventWatch) -> int:  # a prefill worker publishes one when it has recorded a KV location
            return sum(isinstance(e, QueuedEvent) for e in w.snapshot())

        watch.wait_for(lambda w: hand_offs(w) >= 3)  # the clients are under way
        seen = hand_offs(watch)
        watch.wait_for(lambda w: hand_offs(w) > seen)
        old.proc.send_signal(signal.SIGKILL)  # right after a hand-off's location was written
        killed_at = time.monotonic()
        old.proc.wait(10)
        promoted_s = first_read_s = None
        with Redis.from_url(new.url) as probe:  # reads on the new primary are the decode workers' lookups
            while time.monotonic() - killed_at < 60 and first_read_s is None:
                if promoted_s is None and plane.primary() is new:
                    promoted_s = time.monotonic() - killed_at
                with contextlib.suppress(RedisConnectionError):  # promoting it, a Sentinel hangs up its clients
                    if probe.info("stats")["keyspace_hits"] > 0:
                        first_read_s = time.monotonic() - killed_at
                time.sleep(0.02)
        time.sleep(3)  # more requests through the new primary
    finally:
        stop.set()
        for t in clients:
            t.join(150)
        watch.close()
    assert promoted_s is not None, "the Sentinels never promoted the replica"
    assert first_read_s is not None, "no KV location was ever read on the new primary"
    counts, failures = check_streams(outcomes, reference, "redis primary killed")
    stalls = [
        o.longest_gap_s for o in outcomes if o.started < killed_at < (o.arrivals or [0.0])[-1]
    ]  # open at the kill
    recomputed = scraped_total(decode_metrics, "pdserve:prompt_tokens_total") - recomputed_before
    pulls = scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count") - pulls_before
    report(
        "redis primary killed at a hand-off",
        requests=counts,
        promoted_s=round(promoted_s, 2),
        first_handoff_on_new_primary_s=round(first_read_s, 2),
        recomputed_prompt_tokens=recomputed,
        kv_pulls=pulls,
        stall_p50_s=round(percentile(stalls, 50), 3) if stalls else None,
        stall_p99_s=round(percentile(stalls, 99), 3) if stalls else None,
    )
    assert not failures, failures  # a missing location is recomputed, never an error
    assert counts["completed"] == counts["sent"] >= 8
    assert recomputed > 0  # the hand-offs caught by the failover were recomputed by the decode worker
    settled(stack)  # leases still end: no KV held, no pd:* key on the new primary
    assert scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count") > pulls_before  # tickets still work
    old.restart()  # as `pdserve up` does: it comes back as the new primary's replica
    with Redis.from_url(old.url) as client:
        assert client.info("replication")["role"] == "slave"
    assert plane.primary() is new


def test_up_ha_restarts_a_dead_node(tmp_path, model_dir):
    """`pdserve up --ha`: a NATS node and the Redis primary killed; the supervisor restarts each; the NATS node
    rejoins (its /healthz: current), the Redis node comes back once the replica was promoted; the stack serves."""
    port, log_dir = free_port(), tmp_path / "logs"
    cmd = [sys.executable, "-m", "services.cli", "up", "--ha", "--model", str(model_dir), "--port", str(port),
           "--mixed", "1", "--drain-timeout-s", "3", "--log-dir", str(log_dir)]  # fmt: skip
    out = tmp_path / "up.txt"
    with open(out, "wb") as sink:
        up = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=os.environ | FAST)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while "pdserve is ready" not in out.read_text():
            assert up.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.3)
        text = out.read_text()
        nats_line = re.search(r"NATS cluster, monitoring: (.*)", text)[1] + " "
        monitors = dict(re.findall(r"(nats-\d) (http://\S+?)[,\s]", nats_line))
        assert sorted(monitors) == ["nats-0", "nats-1", "nats-2"], text
        redis_nodes = dict(re.findall(r"(redis-\d) (\S+?:\d+)", re.search(r"Redis: (.*)", text)[1]))
        assert sorted(redis_nodes) == ["redis-0", "redis-1"], text
        metrics = re.search(r"supervisor: (\S+/metrics)", text)[1]
        seen |= set(descendants(up.pid))

        def pid_of(marker: str) -> int:
            """The pid of the server whose command line holds `marker`: a nats-server's data directory (named after
            the node), a redis-server's address (it puts that in its process title)."""
            for pid in descendants(up.pid):
                try:
                    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if marker in args:
                    return pid
            raise AssertionError(f"no process with {marker!r} on its command line")

        def restarts(service: str) -> float:
            return scraped_total(metrics, "pdserve:supervisor_restarts_total", service=service)

        def wait(predicate, what: str, timeout_s: float = 60) -> None:
            end = time.monotonic() + timeout_s
            while not predicate():
                assert time.monotonic() < end, f"{what}: not within {timeout_s:g} s\n{out.read_text()[-3000:]}"
                time.sleep(0.2)

        os.kill(pid_of("pdserve-nats-1-"), signal.SIGKILL)
        wait(lambda: restarts("nats-1") == 1, "nats-1 restarted")
        wait_current(monitors["nats-1"])  # rejoined: routed, JetStream current
        assert len(httpx.get(f"{monitors['nats-1']}/routez", timeout=5).json()["routes"]) >= 2
        os.kill(pid_of(f" {redis_nodes['redis-0']}"), signal.SIGKILL)
        wait(lambda: restarts("redis-0") == 1, "redis-0 restarted")  # after the Sentinels promoted redis-1
        assert "redis-0 exited (killed by SIGKILL)" in out.read_text()
        again = stream_completion(f"http://127.0.0.1:{port}", PROMPTS[0], 24)
        assert again.verdict == "completed", again
        assert restarts("mixed-0") == 0 and restarts("gateway") == 0  # the services rode it out
        seen |= set(descendants(up.pid))
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        for pid in [up.pid, *seen, *descendants(up.pid)]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait(30)
