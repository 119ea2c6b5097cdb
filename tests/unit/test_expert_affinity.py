"""Decode routed by expert affinity, on recorded signals: a request's summary, a decode worker's decayed window, the
overlap and the choice (shared/expert_affinity.py); the gateway's candidates (services/gateway/decode_router.py);
the switch's settings; the new message fields round-trip and an older reader ignores them."""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.decode_router import affinity
from shared import expert_affinity
from shared.expert_affinity import HotExpertsWindow, choose, overlap, summarise
from shared.messages import (
    AffinityCandidate,
    DecodeAffinity,
    DecodeJob,
    Heartbeat,
    HotExperts,
    PrefillJob,
    Role,
    Sampling,
    decode,
    encode,
)
from shared.settings import GatewaySettings

# Signals in the shape the tiny Qwen3-MoE gives (2 sparse layers, 8 experts, top-2), written by hand: a prompt's
# prefill routing, and two decode workers' last beats, one serving prompts like it (layer 0's experts 1 and 6, layer
# 1's 5 hot) and one serving others
PROMPT = {0: [0, 19, 2, 0, 1, 0, 15, 3], 1: [4, 0, 0, 12, 0, 22, 1, 1]}
LIKE = {0: [2, 40, 6, 1, 0, 0, 31, 4], 1: [3, 0, 1, 20, 2, 47, 0, 3]}
OTHER = {0: [1, 2, 3, 38, 44, 2, 1, 5], 1: [30, 1, 41, 0, 3, 0, 2, 19]}


def test_a_summary_is_the_heaviest_pairs_first() -> None:
    hot = summarise(PROMPT, top_k=3)
    assert hot == HotExperts(layers=[1, 0, 0], experts=[5, 1, 6], tokens=[22, 19, 15])
    assert summarise({0: [0, 0]}, top_k=3) is None  # nothing routed
    with pytest.raises(ValueError, match="top_k"):
        summarise(PROMPT, top_k=0)


def test_overlap_is_the_intersection_of_shares() -> None:
    a = summarise(PROMPT, 8)
    assert a is not None
    assert overlap(a, a) == pytest.approx(1.0)
    like, other = summarise(LIKE, 32), summarise(OTHER, 32)
    assert like is not None and other is not None
    assert overlap(a, like) > 0.5 > overlap(a, other)
    assert overlap(a, HotExperts([1], [7], [10])) == pytest.approx(0.0)  # a pair the prompt never named


def test_the_choice_prefers_the_best_match_then_the_fewest_running() -> None:
    request = summarise(PROMPT, 8)
    like, other = summarise(LIKE, 32), summarise(OTHER, 32)
    assert like is not None and other is not None
    candidates = [AffinityCandidate("d-other", 0, other), AffinityCandidate("d-like", 3, like)]
    assert choose(request, candidates) == "d-like"  # the match wins over a worker a little less busy
    slack = expert_affinity.RUNNING_SLACK
    busy = [AffinityCandidate("d-other", 0, other), AffinityCandidate("d-like", slack + 1, like)]
    assert choose(request, busy) == "d-other"  # ... but not over one much less busy: affinity never piles work up
    tie = [AffinityCandidate("d-a", 3, like), AffinityCandidate("d-b", 1, like)]
    assert choose(request, tie) == "d-b"
    disjoint = [AffinityCandidate("d-x", 0, HotExperts([1], [7], [10]))]
    assert choose(request, disjoint) is None  # no overlap: the shared queue
    assert choose(None, candidates) is None  # a prompt with no summary (a dense model)


def test_a_decode_workers_window_decays_to_its_recent_load() -> None:
    window = HotExpertsWindow(top_k=2, decay=0.8)
    assert window.add(OTHER) == HotExperts([0, 1], [4, 2], [44, 41])
    for _ in range(2):  # its traffic changed: two beats of the other kind of load take over
        window.add(LIKE)
    assert window.hot is not None and window.hot.experts == [5, 1] and window.hot.layers == [1, 0]
    for _ in range(25):  # idle: the decayed load drops below one token, and the summary with it
        window.add({})
    assert window.hot is None
    with pytest.raises(ValueError, match="decay"):
        HotExpertsWindow(decay=1.0)


def _beat(worker: str, hot: HotExperts | None, free_blocks: int = 100, role: Role = Role.DECODE) -> Heartbeat:
    return Heartbeat(worker, role, "demo", None, free_blocks=free_blocks, block_size=4, hot_experts=hot)


def test_the_gateways_candidates_have_room_and_a_summary() -> None:
    like, other = summarise(LIKE, 32), summarise(OTHER, 32)
    beats = [_beat("a", like), _beat("b", other), _beat("cold", None), _beat("full", like, free_blocks=2)]
    got = affinity(prompt_tokens=40, beats=beats, top_k=8)
    assert got == DecodeAffinity(8, [AffinityCandidate("a", 0, like), AffinityCandidate("b", 0, other)])  # type: ignore[arg-type]
    assert affinity(40, beats[:1] + beats[2:], 8) is None  # one candidate: no choice to make


def test_bad_settings_are_clear_errors() -> None:
    assert GatewaySettings().expert_affinity_routing is False  # off by default
    for bad in (0, 257):
        with pytest.raises(ValueError, match="expert_affinity_top_k must be in 1-256"):
            GatewaySettings(expert_affinity_top_k=bad)
    with pytest.raises(msgspec.ValidationError):  # a job's top_k out of range is refused at decode
        decode(b'{"top_k": 0, "candidates": []}', DecodeAffinity)


class _OldPrefillJob(msgspec.Struct, frozen=True):  # a reader from before the field
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling
    reply_subject: str


def test_the_new_fields_round_trip_and_older_readers_ignore_them() -> None:
    hot = summarise(PROMPT, expert_affinity.REQUEST_TOP_K)
    assert hot is not None
    job = PrefillJob("r", "demo", [1, 2], Sampling(max_tokens=4), "pd.tokens.g.r",
                     decode_affinity=DecodeAffinity(8, [AffinityCandidate("d", 1, hot)]))  # fmt: skip
    assert decode(encode(job), PrefillJob) == job
    assert decode(encode(job), _OldPrefillJob).request_id == "r"
    djob = DecodeJob("r", "demo", [1, 2], [3], Sampling(max_tokens=4), "s", hot_experts=hot)
    assert decode(encode(djob), DecodeJob) == djob
    assert len(encode(hot)) < 80  # compact: three arrays of top-k ints
    beat = _beat("d", hot)
    assert decode(encode(beat), Heartbeat) == beat


def test_hot_experts_of_unequal_lengths_are_refused_on_the_wire() -> None:
    with pytest.raises(msgspec.ValidationError, match="one layer, expert and token count per pair"):
        decode(b"[[0],[1,2],[3]]", HotExperts)
