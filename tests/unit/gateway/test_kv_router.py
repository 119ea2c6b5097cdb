"""KV-aware routing's policy (kv_router.py) and the gateway's routing over a recorded index (kv_routing.py): the
worker holding the longest prefix wins unless its queue costs more than the cache saves or it is overloaded;
ties go to the least loaded; nothing cached → the shared queue, unless prompt_cache_key pins a worker."""

from __future__ import annotations

from services.gateway.backend import GenerationJob
from services.gateway.kv_router import SHARED, Candidate, How, Route, affinity_worker, choose
from services.gateway.kv_routing import KvRouting, SharedQueue, _lazy_block_hashes, prefill_routing, route_subject
from shared.messages import Heartbeat, KvBlockEvents, Role, Sampling
from shared.prefix_hash import block_hashes, request_salt, root_hash
from shared.settings import GatewaySettings


def c(worker: str, cached: int = 0, queued: int = 0, running: int = 0, overloaded: bool = False) -> Candidate:
    return Candidate(worker, cached, queued, running, overloaded)


def test_the_worker_holding_the_longest_prefix_wins():
    route = choose(1000, [c("a", cached=800), c("b", cached=200), c("c")])
    assert route == Route("a", How.PREFIX, 800)


def test_a_long_queue_outweighs_the_tokens_the_cache_saves():
    # a: 800 cached but 900 queued → 1100 to compute; b: nothing cached, idle → 1000
    assert choose(1000, [c("a", cached=800, queued=900), c("b")]) == SHARED  # the cheapest holds nothing
    # c holds less but is idle: 1000 - 400 = 600 beats a's 1100
    assert choose(1000, [c("a", cached=800, queued=900), c("c", cached=400)]) == Route("c", How.PREFIX, 400)


def test_an_overloaded_worker_gets_nothing_for_its_cache():
    route = choose(1000, [c("a", cached=900, overloaded=True), c("b", cached=100)])
    assert route == Route("b", How.PREFIX, 100)
    assert choose(1000, [c("a", cached=900, overloaded=True)]) == SHARED


def test_ties_go_to_the_least_loaded():
    # equal cost (a: 100 queued + 500 uncached = b: 300 queued + 300 uncached): the shorter queue wins
    route = choose(1000, [c("a", cached=500, queued=100), c("b", cached=700, queued=300)])
    assert route.worker_id == "a"
    route = choose(1000, [c("a", cached=500, running=3), c("b", cached=500, running=1)])
    assert route.worker_id == "b"


def test_nothing_cached_anywhere_goes_to_the_shared_queue():
    assert choose(1000, [c("a"), c("b")]) == SHARED
    assert choose(1000, []) == SHARED


def test_a_cache_key_sticks_to_one_worker_while_nobody_holds_more():
    workers = [c("a"), c("b"), c("c")]
    home = affinity_worker("conv-42", workers).worker_id
    assert choose(1000, workers, "conv-42") == Route(home, How.AFFINITY, 0)
    # the key's worker holds the prefix now: it keeps the key whatever the others' load
    warmed = [c(w.worker_id, cached=600 if w.worker_id == home else 0) for w in workers]
    assert choose(1000, warmed, "conv-42") == Route(home, How.PREFIX, 600)
    # another worker holds a longer prefix: the prefix wins
    other = next(w.worker_id for w in workers if w.worker_id != home)
    longer = [c(w.worker_id, cached=900 if w.worker_id == other else 0) for w in workers]
    assert choose(1000, longer, "conv-42").worker_id == other


def test_a_key_moves_only_when_its_worker_leaves():
    workers = [c(f"w{i}") for i in range(5)]
    keys = [f"k{i}" for i in range(200)]
    before = {k: affinity_worker(k, workers).worker_id for k in keys}
    assert len(set(before.values())) == 5  # spread over every worker
    gone = "w2"
    after = {k: affinity_worker(k, [w for w in workers if w.worker_id != gone]).worker_id for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != gone)


# ---- the gateway's routing over a recorded index ---------------------------------------------------------------

BS = 4
MODEL = "m"


def beat(worker: str, waiting_tokens: int = 0, role: Role = Role.PREFILL, draining: bool = False) -> Heartbeat:
    return Heartbeat(worker, role, MODEL, None, block_size=BS, waiting_tokens=waiting_tokens, draining=draining,
                     kv_blocks_epoch="e", kv_blocks_seq=1)  # fmt: skip


def gen_job(prompt: list[int], cache_key: str | None = None, salt: str = "") -> GenerationJob:
    return GenerationJob("r", MODEL, prompt, Sampling(max_tokens=4), cache_key=cache_key, cache_salt=salt)


def routing(**overrides) -> KvRouting:
    settings = GatewaySettings(model_name=MODEL, **overrides)
    r = prefill_routing(settings)
    assert isinstance(r, KvRouting)
    return r


def holds(r: KvRouting, worker: str, prompt: list[int], blocks: int, salt: str = "") -> None:
    hashes = block_hashes(prompt, BS, root_hash(MODEL, salt))[:blocks]
    r.sync.on_update(KvBlockEvents(worker, "e", 1, BS, stored=hashes))


def test_routing_sends_a_prompt_to_the_worker_that_announced_its_prefix():
    r = routing()
    prompt = list(range(100, 140))  # 10 blocks
    holds(r, "p1", prompt, 8)
    holds(r, "p2", prompt, 3)
    serving = [beat("p1"), beat("p2"), beat("d1", role=Role.DECODE)]
    route = r.route(gen_job(prompt), serving, {})
    assert route == Route("p1", How.PREFIX, 32)
    assert route_subject(MODEL, route) == "pd.jobs.prefill.m.p1"
    # p1's queue (heartbeat + routed, not taken) now outweighs what it saves
    assert r.route(gen_job(prompt), [beat("p1", waiting_tokens=30), beat("p2")], {}).worker_id == "p2"
    assert r.route(gen_job(prompt), [beat("p1", waiting_tokens=10), beat("p2")], {"p1": 20}).worker_id == "p2"


def test_an_overloaded_or_absent_holder_is_passed_over():
    r = routing(kv_routing_max_queued_tokens=100)
    prompt = list(range(40))
    holds(r, "p1", prompt, 10)
    assert r.route(gen_job(prompt), [beat("p1", waiting_tokens=100), beat("p2")], {}) == SHARED
    assert r.route(gen_job(prompt), [beat("p2")], {}) == SHARED  # p1 is not live: not a candidate


def test_a_whole_cached_prompt_still_computes_its_last_token():
    r = routing()
    prompt = list(range(40))  # exactly 10 blocks
    holds(r, "p1", prompt, 10)
    assert r.route(gen_job(prompt), [beat("p1")], {}).hit_tokens == 39


def test_another_salt_hits_nothing():
    r = routing()
    prompt = list(range(40))
    holds(r, "p1", prompt, 10, salt=request_salt("tenant-a", None))
    assert r.route(gen_job(prompt, salt=request_salt("tenant-b", None)), [beat("p1")], {}) == SHARED
    route = r.route(gen_job(prompt, salt=request_salt("tenant-a", None)), [beat("p1")], {})
    assert route.worker_id == "p1"


def test_a_draining_worker_leaves_the_index_with_its_heartbeat():
    r = routing()
    prompt = list(range(40))
    holds(r, "p1", prompt, 10)
    r.on_heartbeat(beat("p1", draining=True))
    assert r.index.workers() == set()


def test_routing_off_sends_everything_to_the_shared_queue():
    r = prefill_routing(GatewaySettings(model_name=MODEL, kv_aware_routing=False))
    assert type(r) is SharedQueue
    assert r.route(gen_job(list(range(40)), cache_key="k"), [beat("p1")], {}) == SHARED
    assert route_subject(MODEL, SHARED) == "pd.jobs.prefill.m"


def test_the_lazy_hashes_are_the_shared_definition():
    prompt = list(range(1000, 1037))  # 9 full blocks and a partial one
    root = root_hash(MODEL, request_salt("t", "s"))
    assert list(_lazy_block_hashes(prompt, BS, root)) == block_hashes(prompt, BS, root)
