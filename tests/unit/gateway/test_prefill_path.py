"""The prefill path's rule (services/gateway/prefill_path.py) on recorded signals: heartbeats as workers send them,
read by path_signals.py with the documented defaults where nothing was measured, and the dispatch of each path."""

from __future__ import annotations

import pytest

from services.gateway.liveness import WorkerTable
from services.gateway.nats_backend import NatsBackend
from services.gateway.path_dispatch import LocalLoad, PathChooser, PlaneTime, dispatch, local_job
from services.gateway.path_signals import (
    DEFAULT_DECODE_STEP_MS,
    DEFAULT_PREFILL_STEP_MS,
    DEFAULT_PREFILL_TOKENS_PER_S,
    OwnLoad,
    PathSignals,
)
from services.gateway.prefill_path import (
    LOCAL_WINDOW_S,
    RELIEF_SHARE,
    TPOT_HEADROOM,
    DecodeSide,
    PathChoice,
    PlaneOverhead,
    PrefillSide,
    Slos,
    Transfer,
    choose_path,
)
from services.gateway.request_stream import Deadlines, RequestUpdates
from shared.messages import (
    DecodeJob,
    Heartbeat,
    PathCalibration,
    PrefillJob,
    Role,
    Sampling,
    Sibling,
    TakenEvent,
    TokensEvent,
    decode,
    decode_subject,
    encode,
    prefill_subject,
)
from shared.settings import GatewaySettings, PrefillPath, PrefillPathSettings

SLOS = Slos(ttft_s=2.5, tpot_s=0.1)  # the settings' defaults
SHORT, LONG = 16, 512


def _beat(role: Role, worker_id: str, running: int = 0, waiting_tokens: int = 0, **measured) -> Heartbeat:
    calibration = PathCalibration(**measured) if measured else None
    return Heartbeat(worker_id, role, "demo", "p:1" if role is Role.PREFILL else None, running=running,
                     block_size=16, total_blocks=64, free_blocks=64, path_calibration=calibration,
                     waiting_tokens=waiting_tokens)  # fmt: skip


# what an idle 1 prefill + 1 decode stack sends before it has computed anything (kv bytes: the tiny model's)
FRESH = [_beat(Role.PREFILL, "p", kv_bytes_per_token=512), _beat(Role.DECODE, "d", kv_bytes_per_token=512)]


def _choose(beats, prompt_tokens: int, live: bool = True, mode=PrefillPath.AUTO, slos=SLOS):
    s = PathSignals(beats, live)
    return choose_path(prompt_tokens, s.prefill(), s.decode(), s.transfer(), slos, mode)


def test_under_the_default_calibration_a_short_prompt_goes_local_and_a_long_one_remote():
    short = _choose(FRESH, SHORT)
    assert (short.path, short.reason) == (PrefillPath.LOCAL, "sooner")
    assert short.local is not None and short.remote is not None
    assert short.local.ready_s < short.remote.ready_s  # no hand-off
    assert short.predicted_ttft_s == short.local.ttft_s
    long = _choose(FRESH, LONG)
    assert (long.path, long.reason) == (PrefillPath.REMOTE, "stall")
    assert long.decode_slowdown_s == pytest.approx(LONG / DEFAULT_PREFILL_TOKENS_PER_S)
    assert long.predicted_ttft_s == long.remote.ttft_s  # pyright: ignore[reportOptionalMemberAccess]


def test_the_default_threshold_is_where_the_prompt_no_longer_fits_the_stall_bound():
    # decode step 8 ms + P / 1236 tokens/s <= 250 ms  ⇔  P <= 299.1
    edge = int((SLOS.stall_s - DEFAULT_DECODE_STEP_MS / 1e3) * DEFAULT_PREFILL_TOKENS_PER_S)
    assert edge == 299
    assert _choose(FRESH, edge).path is PrefillPath.LOCAL
    assert _choose(FRESH, edge + 1).reason == "stall"


def test_the_settings_remote_and_local_answer_their_path():
    assert _choose(FRESH, SHORT, mode=PrefillPath.REMOTE).path is PrefillPath.REMOTE
    forced = _choose(FRESH, LONG, mode=PrefillPath.LOCAL)
    assert (forced.path, forced.reason) == (PrefillPath.LOCAL, "setting")


def test_without_a_decode_or_a_prefill_worker_it_is_remote_a_mixed_worker_computes_it_where_it_decodes():
    mixed_only = [_beat(Role.MIXED, "m")]
    assert _choose(mixed_only, SHORT).reason == "no decode worker"
    assert _choose(mixed_only, SHORT, mode=PrefillPath.LOCAL).path is PrefillPath.REMOTE  # nobody to take it
    decode_and_mixed = [_beat(Role.MIXED, "m"), _beat(Role.DECODE, "d")]
    choice = _choose(decode_and_mixed, SHORT)
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "no prefill worker")
    assert _choose(decode_and_mixed, SHORT, mode=PrefillPath.LOCAL).path is PrefillPath.LOCAL


def test_a_queued_prefill_worker_puts_remote_far_behind_local():
    busy = [_beat(Role.PREFILL, "p", waiting_tokens=5000), FRESH[1]]
    choice = _choose(busy, 100)  # fits a TPOT step (8 + 81 ms); remote's first token waits 5000 queued tokens
    assert choice.path is PrefillPath.LOCAL
    assert choice.remote is not None and choice.remote.ttft_s > 4.0 > choice.local.ttft_s  # pyright: ignore


def test_a_busy_decode_batch_takes_a_short_prompt_only_when_the_hand_off_costs_more_than_it_delays_them():
    busy_decode = [FRESH[0], _beat(Role.DECODE, "d", running=8, kv_bytes_per_token=512)]
    choice = _choose(busy_decode, SHORT)  # saves ~2 ms for one request, delays 8 next tokens by ~13 ms each
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "slower")
    assert choice.decode_slowdown_s == pytest.approx(SHORT / DEFAULT_PREFILL_TOKENS_PER_S)
    queued = [_beat(Role.PREFILL, "p", waiting_tokens=5000), busy_decode[1]]
    relieved = _choose(queued, SHORT)  # remote's first token 4 s away: the decode worker's spare time takes it
    assert (relieved.path, relieved.reason) == (PrefillPath.LOCAL, "relief")


def test_the_stall_rule_holds_even_against_a_queued_prefill_worker():
    busy = [_beat(Role.PREFILL, "p", waiting_tokens=50_000), FRESH[1]]
    choice = _choose(busy, LONG)  # remote's TTFT ~40 s, but the prompt would stall the decode batch 0.4 s
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "stall")


def test_the_ttft_rule_keeps_a_slow_local_first_token_remote_where_remote_is_not_slower():
    slos = Slos(ttft_s=0.05, tpot_s=10.0)  # TPOT out of the way
    choice = _choose(FRESH, 200, slos=slos)  # equal rates: local TTFT 170 ms > 50 ms and >= remote's
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "ttft")


def test_a_decode_worker_slower_at_prompts_loses_to_the_hand_off():
    slow_decode = [FRESH[0], _beat(Role.DECODE, "d", prefill_tokens_per_s=100.0, kv_bytes_per_token=512)]
    choice = _choose(slow_decode, 8, slos=Slos(ttft_s=10.0, tpot_s=10.0))
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "slower")


def test_live_coefficients_move_the_threshold_and_are_ignored_when_live_calibration_is_off():
    # the tiny model as workers measure it: prompts at 20k tokens/s, 2 ms decode steps
    rates = {"prefill_tokens_per_s": 20_000.0, "kv_bytes_per_token": 512}
    pulls = {"kv_transfer_ms_per_mb": 1.0, "kv_pull_overhead_ms": 1.5}
    fast = [
        _beat(Role.PREFILL, "p", prefill_step_ms=2.0, **rates),
        _beat(Role.DECODE, "d", decode_step_ms=2.0, **rates, **pulls),
    ]
    assert _choose(fast, LONG).path is PrefillPath.LOCAL  # 2 + 25.6 ms fits a 250 ms stall
    assert _choose(fast, LONG, live=False).reason == "stall"  # the defaults: 8 + 414 ms does not


def test_a_decode_worker_that_never_prefilled_borrows_the_prefill_workers_rate():
    beats = [_beat(Role.PREFILL, "p", prefill_tokens_per_s=10_000.0), _beat(Role.DECODE, "d", decode_step_ms=3.0)]
    (side,) = PathSignals(beats, live=True).decode()
    assert side.prefill_tokens_per_s == 10_000.0 and side.step_s == pytest.approx(0.003)
    (default,) = PathSignals(beats, live=False).decode()
    assert default.prefill_tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S


def test_the_transfer_is_what_the_decode_workers_measured_and_moves_every_prompt_token():
    beats = [_beat(Role.PREFILL, "p"), _beat(Role.DECODE, "d", kv_transfer_ms_per_mb=2.0, kv_pull_overhead_ms=1.0,
                                            kv_bytes_per_token=1000)]  # fmt: skip
    transfer = PathSignals(beats, live=True).transfer()
    assert transfer == Transfer(s_per_byte=pytest.approx(2e-9), overhead_s=pytest.approx(1e-3), bytes_per_token=1000)
    sides = [PrefillSide("p", 0, 1000.0, 0.0, cached_tokens=900)]
    choice = choose_path(1000, sides, [DecodeSide("d", 0, 0.001, 1000.0)], transfer, SLOS)
    assert choice.remote is not None
    assert choice.remote.ttft_s == pytest.approx(0.1)  # 100 uncached tokens
    assert choice.remote.ready_s - choice.remote.ttft_s == pytest.approx(1e-3 + 1000 * 1000 * 2e-9)  # all 1000 move


def test_the_best_worker_of_each_side_is_the_one_assumed():
    prefill = [PrefillSide("busy", 10_000, 1000.0, 0.0), PrefillSide("idle", 0, 1000.0, 0.0)]
    decode = [DecodeSide("slow", 0, 0.05, 1000.0), DecodeSide("quick", 0, 0.001, 1000.0)]
    choice = choose_path(10, prefill, decode, Transfer(0.0, 0.0, 0), SLOS)
    assert choice.remote.worker_id == "idle" and choice.local.worker_id == "quick"  # pyright: ignore


def test_the_tpot_rule_counts_the_decode_workers_time_its_local_prompts_take():
    """A TPOT is a mean over a request's output: the local prompts cost the decode worker's requests the share of its
    time they take (over the last window), TPOT = step / (1 - share), kept under the headroom × the target."""
    step_ms = 50.0
    decode = _beat(Role.DECODE, "d", running=20, decode_step_ms=step_ms, kv_bytes_per_token=512)
    queued = [_beat(Role.PREFILL, "p", waiting_tokens=5000), decode]  # remote far behind: local would relieve it
    # step / (1 - u) <= 0.8 · 100 ms  ⇔  u <= 0.375: (recent + 100) / (1236 · 10 s) <= 0.375  ⇔  recent <= 4535
    budget = int((1 - step_ms / (TPOT_HEADROOM * SLOS.tpot_s * 1e3)) * DEFAULT_PREFILL_TOKENS_PER_S * LOCAL_WINDOW_S)
    assert budget - 100 == 4535
    s = PathSignals(queued, live=True, recent_local_tokens=4535)
    within = choose_path(100, s.prefill(), s.decode(), s.transfer(), SLOS)
    assert (within.path, within.reason) == (PrefillPath.LOCAL, "relief")
    assert within.decode_tpot_s is not None and within.decode_tpot_s <= TPOT_HEADROOM * SLOS.tpot_s
    s = PathSignals(queued, live=True, recent_local_tokens=4536)
    past = choose_path(100, s.prefill(), s.decode(), s.transfer(), SLOS)
    assert (past.path, past.reason) == (PrefillPath.REMOTE, "tpot")
    assert past.decode_tpot_s is not None and past.decode_tpot_s > TPOT_HEADROOM * SLOS.tpot_s
    two = [*queued, _beat(Role.DECODE, "d2", running=20, decode_step_ms=step_ms, kv_bytes_per_token=512)]
    shared = PathSignals(two, live=True, recent_local_tokens=4536)  # the shared decode queue: half each
    assert [w.recent_local_tokens for w in shared.decode()] == [2268, 2268]
    assert choose_path(100, shared.prefill(), shared.decode(), shared.transfer(), SLOS).reason == "relief"


def test_relief_only_where_the_remote_first_token_is_at_risk():
    """A busy decode batch takes a prompt to relieve the prefill queue once the remote TTFT passes a quarter of the
    target (and the local one is sooner); below it, the hand-off's saving must outweigh the batch's delay."""
    busy_decode = _beat(Role.DECODE, "d", running=64, kv_bytes_per_token=512)  # 64 · 13 ms of delay > the queue
    # remote TTFT = queued / 1236 + 8 ms + 16 / 1236; the relief line is 0.25 · 2.5 s = 625 ms
    edge = int((RELIEF_SHARE * SLOS.ttft_s - DEFAULT_PREFILL_STEP_MS / 1e3) * DEFAULT_PREFILL_TOKENS_PER_S) - SHORT
    below = _choose([_beat(Role.PREFILL, "p", waiting_tokens=edge - 1), busy_decode], SHORT)
    assert (below.path, below.reason) == (PrefillPath.REMOTE, "slower")
    above = _choose([_beat(Role.PREFILL, "p", waiting_tokens=edge + 2), busy_decode], SHORT)
    assert (above.path, above.reason) == (PrefillPath.LOCAL, "relief")


def test_local_prompts_queued_for_the_decode_worker_delay_the_local_first_token():
    waiting = [FRESH[0], _beat(Role.DECODE, "d", waiting_tokens=1000, kv_bytes_per_token=512)]
    in_engine = PathSignals(waiting, live=True).decode()
    in_queue = PathSignals(FRESH, live=True, decode_load=OwnLoad(queued={"d": 1000})).decode()
    assert [w.queued_tokens for w in in_engine] == [w.queued_tokens for w in in_queue] == [1000]
    choice = _choose(waiting, SHORT)  # its first token behind 1000 local prompt tokens: remote is sooner
    assert choice.local is not None and choice.local.ttft_s == pytest.approx(0.008 + 1016 / 1236)
    assert (choice.path, choice.reason) == (PrefillPath.REMOTE, "slower")


def test_the_local_load_is_the_window_of_prompts_sent_local():
    load = LocalLoad(window_s=10.0)
    load.add("demo", 100.0, 300)
    load.add("demo", 105.0, 200)
    load.add("other", 105.0, 7)
    assert load.recent("demo", 106.0) == 500 and load.recent("other", 106.0) == 7
    assert load.recent("demo", 110.0) == 200  # the first one left the window
    assert load.recent("demo", 116.0) == 0 and load.recent("unknown", 116.0) == 0


def test_the_chooser_sends_prompts_local_until_the_decode_worker_has_no_tpot_to_spare():
    """Each local choice is remembered: a burst of short prompts against a queued prefill worker fills the decode
    worker's TPOT budget, then goes remote."""
    table = WorkerTable(ttl_s=60.0)
    table.record(_beat(Role.PREFILL, "p", waiting_tokens=5000), now=100.0)
    table.record(_beat(Role.DECODE, "d", running=20, decode_step_ms=50.0, kv_bytes_per_token=512), now=100.0)
    chooser = PathChooser(PrefillPathSettings())
    reasons = [chooser.choose(table, "demo", 100, now=101.0).reason for _ in range(50)]
    assert reasons[:46] == ["relief"] * 46 and set(reasons[46:]) == {"tpot"}  # 46 · 100 <= 4635 tokens
    assert chooser.choose(table, "demo", 100, now=111.5).reason == "relief"  # the window has moved on


def test_the_serving_plane_time_is_learnt_from_first_tokens_per_path_and_added_to_its_predictions():
    """What the engines' model leaves out (hops, queues the signals miss) is measured: actual - predicted TTFT of
    this gateway's first tokens, per path, against the engines' part of each prediction."""
    plane = PlaneTime(alpha=0.5)
    first = _choose(FRESH, SHORT)  # local, nothing learnt yet
    assert first.path is PrefillPath.LOCAL and first.chosen is not None and first.chosen.plane_s == 0.0
    plane.observe(first, first.chosen.ttft_s + 0.040)  # 40 ms more than the engines' part
    assert plane.overhead() == PlaneOverhead(remote_s=0.0, local_s=pytest.approx(0.040))
    s = PathSignals(FRESH, live=True)
    second = choose_path(SHORT, s.prefill(), s.decode(), s.transfer(), SLOS, PrefillPath.AUTO, plane.overhead())
    assert second.local is not None and second.local.plane_s == pytest.approx(0.040)
    assert second.local.ttft_s == pytest.approx(first.chosen.ttft_s + 0.040)
    assert (second.path, second.reason) == (PrefillPath.REMOTE, "slower")  # 40 ms of hops: past the hand-off
    local_again = PathChoice(PrefillPath.LOCAL, "setting", None, second.local, None)
    plane.observe(local_again, second.local.ttft_s - 0.040 + 0.020)  # 20 ms over the engines' part this time
    assert plane.overhead().local_s == pytest.approx(0.030)  # halfway (alpha 0.5), not compounding the 40
    remote = _choose(FRESH, LONG)
    plane.observe(remote, remote.predicted_ttft_s + 0.1)  # pyright: ignore[reportOperatorIssue]
    assert plane.overhead().remote_s == pytest.approx(0.1)


def test_a_remote_path_slower_than_predicted_makes_local_the_sooner_one():
    """A learnt remote plane time moves the comparison: here the remote first token is 1 s later than its engines'
    part, past the relief line, and a busy decode worker takes the short prompt."""
    busy_decode = [FRESH[0], _beat(Role.DECODE, "d", running=64, kv_bytes_per_token=512)]
    s = PathSignals(busy_decode, live=True)
    plain = choose_path(SHORT, s.prefill(), s.decode(), s.transfer(), SLOS)
    assert (plain.path, plain.reason) == (PrefillPath.REMOTE, "slower")
    late = choose_path(SHORT, s.prefill(), s.decode(), s.transfer(), SLOS, PrefillPath.AUTO, PlaneOverhead(1.0))
    assert (late.path, late.reason) == (PrefillPath.LOCAL, "relief")


def test_the_chooser_learns_only_with_live_calibration():
    table = WorkerTable(ttl_s=60.0)
    for beat in FRESH:
        table.record(beat, now=100.0)
    for live in (True, False):
        chooser = PathChooser(PrefillPathSettings(prefill_path_live_calibration=live))
        chooser.plane.observe(chooser.choose(table, "demo", SHORT, now=101.0), 5.0)
        after = chooser.choose(table, "demo", SHORT, now=101.0)
        assert after.local is not None and (after.local.plane_s > 4.0) is live  # (learnt: then too slow, remote)


# ---- dispatch -------------------------------------------------------------------------------------------------


def _prefill_job() -> PrefillJob:
    return PrefillJob("r", "demo", [5, 6, 7], Sampling(max_tokens=4, seed=3), "pd.tokens.g.r", created_at=12.0,
                      siblings=[Sibling("r_c1", "pd.tokens.g.r_c1", 4)], cache_salt="tenant-a")  # fmt: skip


def test_a_local_request_is_a_decode_job_to_be_prefilled_where_it_is_taken():
    job = _prefill_job()
    subject, message = dispatch(_choose(FRESH, 3), job)
    assert subject == decode_subject("demo") and isinstance(message, DecodeJob)
    assert message == local_job(job)
    assert message.prefill_here and message.prefill_worker is None and message.output_token_ids == []
    assert (message.prompt_token_ids, message.sampling, message.created_at) == ([5, 6, 7], job.sampling, 12.0)
    assert message.cache_salt == "tenant-a"  # its prefix-cache hashes salted as on the remote path
    assert [(s.request_id, s.seed, s.output_token_ids) for s in message.siblings] == [("r_c1", 4, [])]
    assert decode(encode(message), DecodeJob) == message
    subject, same = dispatch(_choose(FRESH, LONG), job)
    assert (subject, same) == (prefill_subject("demo"), job)


def test_the_chooser_reads_the_live_workers_of_the_model():
    table = WorkerTable(ttl_s=5.0)
    for beat in FRESH:
        table.record(beat, now=100.0)
    chooser = PathChooser(PrefillPathSettings())
    assert chooser.choose(table, "demo", SHORT, now=101.0).path is PrefillPath.LOCAL
    assert chooser.choose(table, "demo", SHORT, now=106.0).reason == "no decode worker"  # both beats expired
    remote = PathChooser(PrefillPathSettings(prefill_path=PrefillPath.REMOTE))
    assert remote.choose(table, "demo", SHORT, now=101.0).path is PrefillPath.REMOTE


def test_a_prompt_cached_on_the_routed_prefill_worker_goes_remote_where_it_would_compute_locally():
    """KV-aware routing's expected hit on the prefill worker it chose is the remote side's `cached_tokens`: a
    cache-hot short prompt is ready sooner remote (its uncached tail and the hand-off) than computed whole on the
    decode worker, which holds none of it."""
    prompt = 96
    cold = _choose(FRESH, prompt)
    assert cold.path is PrefillPath.LOCAL
    s = PathSignals(FRESH, live=True, prefill_cached={"p": 80})
    hot = choose_path(prompt, s.prefill(), s.decode(), s.transfer(), SLOS, PrefillPath.AUTO)
    assert hot.path is PrefillPath.REMOTE and hot.remote is not None and cold.remote is not None
    assert hot.remote.ttft_s < cold.remote.ttft_s
    unrelated = PathSignals(FRESH, live=True, prefill_cached={"another": 80}).prefill()
    assert [w.cached_tokens for w in unrelated] == [0]


def test_prompts_waiting_in_the_job_queues_count_in_the_prefill_workers_queue():
    """Under load the backlog is in JetStream, where no heartbeat sees it: the gateway's own waiting prompts
    (PathSignals' prefill_load) add to the prefill side's queue, and so to the remote TTFT."""
    idle = PathSignals(FRESH, live=True).prefill()
    busy = PathSignals(FRESH, live=True, prefill_load=OwnLoad(queued={"p": 2472})).prefill()
    assert [w.queued_tokens for w in idle] == [0] and [w.queued_tokens for w in busy] == [2472]
    s = PathSignals(FRESH, live=True, prefill_load=OwnLoad(queued={"p": 2472}))
    queued = choose_path(LONG, s.prefill(), s.decode(), s.transfer(), SLOS, PrefillPath.AUTO)
    assert queued.remote is not None and _choose(FRESH, LONG).remote is not None
    assert queued.remote.ttft_s - _choose(FRESH, LONG).remote.ttft_s == pytest.approx(2472 / 1236)


def test_the_gateway_counts_its_remote_requests_no_prefill_worker_has_taken():
    backend = NatsBackend(GatewaySettings(model_name="demo", worker_ttl_s=60.0))
    now = 100.0
    for beat in (_beat(Role.PREFILL, "p1"), _beat(Role.PREFILL, "p2"), _beat(Role.DECODE, "d")):
        backend.workers.record(beat, now)
    remote = PathChoice(PrefillPath.REMOTE, "tpot", None, None, None)
    local = PathChoice(PrefillPath.LOCAL, "sooner", None, None, None)

    def stream(rid: str, tokens: int, path: PathChoice) -> RequestUpdates:
        job = PrefillJob(rid, "demo", list(range(tokens)), Sampling(max_tokens=4), f"pd.tokens.g.{rid}")
        s = RequestUpdates(rid, Deadlines(60, 60), lambda _: None, lambda _: None, job=job)
        s.prefill_path = path
        backend._streams[rid] = s
        return s

    stream("shared-a", 100, remote)
    stream("shared-b", 300, remote)
    stream("local", 500, local)  # waits in the decode queue: not prefill work
    stream("routed", 40, remote).routed("p1")  # in p1's own queue
    stream("taken", 700, remote).push(TakenEvent("taken", 0, 0, "p2"))  # in p2's engine, first token not out yet
    stream("answered", 900, remote).push(TokensEvent("answered", 0, 0, [3], worker_id="p1"))  # prefilled
    stream("local-taken", 60, local).push(TakenEvent("local-taken", 0, 0, "d"))
    prefill, decode = (
        backend._own_load("demo", now, PrefillPath.REMOTE),
        backend._own_load("demo", now, PrefillPath.LOCAL),
    )
    assert prefill == OwnLoad(queued={"p1": 40 + 200, "p2": 200}, taken={"p2": 700})
    assert decode == OwnLoad(queued={"d": 500}, taken={"d": 60})  # the decode worker's to compute


def test_a_worker_s_queue_is_its_heartbeat_or_what_it_took_since_whichever_is_larger_plus_the_job_queues():
    """The heartbeat (once a second) counts every gateway's requests in the engine; this gateway's own taken ones
    reach it before the next beat. Both count the same requests, so the larger is the engine's queue."""
    load = OwnLoad(queued={"p": 100}, taken={"p": 700})
    assert load.queue("p", heartbeat_tokens=0) == 800  # taken since the last beat
    assert load.queue("p", heartbeat_tokens=2000) == 2100  # other gateways' requests too
    assert load.queue("other", heartbeat_tokens=30) == 30
