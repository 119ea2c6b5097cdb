"""The decode-job routing policy (services/gateway/decode_router.py): the decode worker holding most of the prompt,
among those with room for the rest; the shared queue when no one holds any or has room."""

from __future__ import annotations

from services.gateway.decode_router import DecodeCandidate, choose_decode


def c(worker_id: str, cached: int, free: int = 10_000, running: int = 0) -> DecodeCandidate:
    return DecodeCandidate(worker_id, cached, free, running)


def test_the_worker_holding_most_of_the_prompt_wins():
    chosen = choose_decode(200, [c("d1", 64), c("d2", 128), c("d3", 0)])
    assert chosen is not None and chosen.worker_id == "d2"


def test_nothing_cached_anywhere_goes_to_the_shared_queue():
    assert choose_decode(200, [c("d1", 0), c("d2", 0)]) is None
    assert choose_decode(200, []) is None


def test_a_holder_without_room_for_the_rest_is_passed_over():
    chosen = choose_decode(200, [c("d1", 128, free=16), c("d2", 64, free=512)])
    assert chosen is not None and chosen.worker_id == "d2"
    assert choose_decode(200, [c("d1", 128, free=71)]) is None  # 72 tokens to import, 71 free
    assert choose_decode(200, [c("d1", 128, free=72)]) is not None


def test_ties_go_to_the_fewest_running_then_the_name():
    chosen = choose_decode(200, [c("d2", 64, running=3), c("d1", 64, running=5), c("d3", 64, running=3)])
    assert chosen is not None and chosen.worker_id == "d2"
