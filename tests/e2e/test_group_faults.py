"""A worker group under fault: with decode workers that are TP = 2 groups (two processes each), the follower rank
of the busiest one is killed mid-stream. Its leader notices at once and exits, the gateway moves the group's
requests to the other decode group, and every stream completes token for token as the single-process engine
writes it, with no position repeated or missing (tests/chaos.py checks the positions)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.local.cluster_state import heartbeats
from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.chaos import EventWatch, Load, settled
from tests.e2e import test_faults
from tests.e2e.test_faults import FAST, MAX_TOKENS, SHORT, busiest, check, moves, prompts
from tests.e2e_support import start_stack

pytestmark = pytest.mark.slow  # worker groups: ranks spawned per scenario (make test-slow)

reference = test_faults.reference  # the single-process engine's outputs (a module fixture)
EXIT_WITHIN_S = 10.0  # the leader's watch exits at once; the slack is this loaded 2-core machine


def _rank_pids(stack, name: str) -> tuple[int, ...]:
    """The worker group's process ids from its heartbeat (leader first)."""
    worker_pid = stack.procs[name].pid
    for beat in heartbeats(stack.nats_url).values():
        if beat.rank_pids and beat.rank_pids[0] == worker_pid:
            return beat.rank_pids
    raise AssertionError(f"no heartbeat of {name} (pid {worker_pid}) carries its ranks' pids")


@pytest.fixture(scope="module")
def stack_1p2d_tp2(model_dir):
    spec = StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=2, threads_per_worker=2,
                     parallel={"decode": (2, 1)}, env=FAST)  # fmt: skip
    stack = start_stack(spec)
    yield stack
    stack.stop()


def test_a_killed_follower_rank_takes_its_group_down_and_its_streams_move(stack_1p2d_tp2, reference):
    stack = stack_1p2d_tp2
    moved = moves(stack)
    # Read before the load: listening for heartbeats takes seconds (2.5 s), in which the tiny model streams all of
    # its 128 tokens — read after the load started, the kill came when the streams had (nearly) ended, and the
    # move counter stayed at 0 because nothing was left to move (the "moves counter mystery").
    pids = {name: _rank_pids(stack, name) for name in stack.procs if name.startswith("decode")}
    watch = EventWatch(stack.nats_url)
    try:
        load = Load(stack.url, prompts(SHORT), MAX_TOKENS)
        load.progress.wait(lambda p: min(p.counts) >= 3)
        victim = busiest(stack, watch, "decode")
        _, follower = pids[victim]
        os.kill(follower, signal.SIGKILL)
        killed_at = time.monotonic()
        # the victim's streams at the kill: all of them unfinished, 3 tokens or so into their 128
        held = [rid for rid, worker in watch.holders().items() if worker.startswith(f"{victim}-")]
        stack.procs[victim].wait(EXIT_WITHIN_S)  # raises TimeoutExpired if the group hangs on
        exited_after = time.monotonic() - killed_at
        outcomes = load.results()
    finally:
        watch.close()
    assert stack.procs[victim].returncode != 0, "the group's leader must exit non-zero when a rank dies"
    assert exited_after < EXIT_WITHIN_S
    assert held, "the busiest decode group held no stream when its rank was killed"
    moved = moves(stack) - moved
    check(outcomes, reference, "decode group's follower rank killed mid-stream", moved)
    # every stream it held was mid-stream (a few tokens of 128): the gateway moved each (the counter counts them)
    assert moved == len(held), f"the gateway moved {moved} requests; the dead group held {len(held)}"
    settled(stack)
