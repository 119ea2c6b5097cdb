"""Role switching's pure parts: the role state machine a worker process goes through (shared/worker/role_state.py),
the safety rule that keeps a worker of every needed role (shared/role_control/safety.py), and the signed orders a
worker obeys (shared/role_control/signing.py)."""

from __future__ import annotations

import msgspec
import pytest

from shared.messages import Heartbeat, Role, RoleControl, SwitchOutcome
from shared.role_control.safety import needed, switch_refusal
from shared.role_control.signing import ControlSigner, NonceMemory, OrderRefusal, OrderRefused
from shared.worker.role_state import Phase, RoleState

SECRET = "a-cluster-secret-of-the-tests"
P, D, M = Role.PREFILL, Role.DECODE, Role.MIXED

# ---- the state machine ------------------------------------------------------------------------------------


def test_a_switch_goes_leaving_starting_serving_and_counts_once():
    state = RoleState(P)
    assert state.switching_to is None
    assert state.begin(D) is None
    assert (state.phase, state.role, state.switching_to) == (Phase.LEAVING, P, D)  # the old role serves its work
    state.left()
    assert (state.phase, state.role, state.switching_to) == (Phase.STARTING, P, D)
    state.started(D)
    assert (state.phase, state.role, state.switching_to, state.switches) == (Phase.SERVING, D, None, 1)


def test_only_one_switch_at_a_time_and_none_to_the_same_role():
    state = RoleState(D)
    assert state.begin(D) == (SwitchOutcome.SAME_ROLE, "a decode worker already")
    assert state.phase is Phase.SERVING
    assert state.begin(P) is None
    outcome, detail = state.begin(M) or (None, "")
    assert outcome is SwitchOutcome.BUSY and "from decode to prefill" in detail
    state.left()
    assert (state.begin(M) or (None,))[0] is SwitchOutcome.BUSY  # starting the new role: still busy
    assert state.target is P


def test_a_leave_that_does_not_settle_resumes_the_old_role():
    state = RoleState(D)
    state.begin(P)
    state.resumed()
    assert (state.phase, state.role, state.switching_to, state.switches) == (Phase.SERVING, D, None, 0)
    assert state.begin(P) is None  # and it may be asked again


def test_a_target_that_fails_to_start_leaves_the_old_role_serving_uncounted():
    state = RoleState(P)
    state.begin(M)
    state.left()
    state.started(P)  # the mixed role's setup failed: the prefill role serves again
    assert (state.phase, state.role, state.switches) == (Phase.SERVING, P, 0)


def test_a_stop_calls_a_switch_off_and_refuses_later_ones():
    state = RoleState(P)
    assert state.stop() is False  # nothing to call off
    state = RoleState(P)
    state.begin(D)
    assert state.stop() is True and state.phase is Phase.STOPPING and state.switching_to is None
    assert (state.begin(D) or (None,))[0] is SwitchOutcome.STOPPING
    with pytest.raises(ValueError, match="phase stopping"):
        state.left()  # the host checks the phase before it moves on


@pytest.mark.parametrize("wrong", ["left", "resumed", "started"])
def test_transitions_out_of_order_are_bugs(wrong):
    state = RoleState(P)
    with pytest.raises(ValueError, match="in phase serving"):
        getattr(state, wrong)(*([D] if wrong == "started" else []))


# ---- the safety rule ---------------------------------------------------------------------------------------


def beats(*roles: Role, model: str = "demo", **extra) -> list[Heartbeat]:
    return [Heartbeat(worker_id=f"w{i}", role=r, model=model, rpc_address=None, **extra) for i, r in enumerate(roles)]


@pytest.mark.parametrize(
    ("roles", "who", "to", "refused"),
    [
        ((P, D), "w0", D, SwitchOutcome.UNSAFE),  # the only prefill worker while a decode worker is there
        ((P, D), "w1", P, SwitchOutcome.UNSAFE),  # the only decode worker
        ((P, D), "w1", M, SwitchOutcome.UNSAFE),  # mixed workers take no decode job: the prefill one needs decode
        ((P, P, D), "w0", D, None),
        ((P, D, D), "w1", P, None),
        ((M,), "w0", P, SwitchOutcome.UNSAFE),  # a prefill worker alone serves nothing
        ((M, M), "w0", P, SwitchOutcome.UNSAFE),  # ... nor beside mixed workers: its decode jobs have no taker
        ((M, P, D), "w0", D, None),  # a prefill and decode pair remains: mixed is not needed
        ((M, P, D), "w1", D, SwitchOutcome.UNSAFE),  # the decode workers would wait for prefill forever
        ((P, P), "w0", D, None),  # short of decode (its worker died): switching one in is allowed
        ((P, D), "w0", P, SwitchOutcome.SAME_ROLE),
        ((P, D), "w9", D, SwitchOutcome.UNKNOWN_WORKER),
    ],
)
def test_the_last_live_worker_of_a_needed_role_is_kept(roles, who, to, refused):
    verdict = switch_refusal(beats(*roles), who, to)
    assert (verdict[0] if verdict else None) is refused, verdict


def test_draining_and_switching_workers_count_for_no_role():
    workers = beats(P, P, D)
    draining = [workers[0], msgspec.structs.replace(workers[1], draining=True), workers[2]]
    verdict = switch_refusal(draining, "w0", D)
    assert verdict is not None and verdict[0] is SwitchOutcome.UNSAFE
    assert "last live prefill worker" in verdict[1] and "2 decode" in verdict[1]
    switching = [workers[0], msgspec.structs.replace(workers[1], switching_to=D), workers[2]]
    assert (switch_refusal(switching, "w0", D) or (None,))[0] is SwitchOutcome.UNSAFE
    assert (switch_refusal(switching, "w1", M) or (None,))[0] is SwitchOutcome.BUSY
    assert (switch_refusal(draining, "w1", D) or (None,))[0] is SwitchOutcome.STOPPING


def test_workers_of_another_model_do_not_count():
    other = [Heartbeat(worker_id=f"x{i}", role=r, model="other", rpc_address=None) for i, r in enumerate((P, P))]
    assert (switch_refusal(beats(P, D) + other, "w0", D) or (None,))[0] is SwitchOutcome.UNSAFE


def test_needed_roles():
    from collections import Counter

    assert needed(Counter({P: 1, D: 1})) == [P, D]
    assert needed(Counter({M: 2})) == [M]
    assert needed(Counter({D: 1, M: 1})) == [P, M]


# ---- signed orders --------------------------------------------------------------------------------------------


def test_an_order_signed_with_the_secret_passes_once():
    signer = ControlSigner(SECRET)
    control = signer.sign("w0", D, finish_s=2.5, now=1000.0)
    order = signer.verify(control, "w0", now=1001.0)
    assert (order.worker_id, order.role, order.finish_s) == ("w0", D, 2.5)
    nonces = NonceMemory()
    nonces.admit(order, now=1001.0)
    with pytest.raises(OrderRefused) as refused:
        nonces.admit(order, now=1002.0)
    assert refused.value.reason is OrderRefusal.REPLAYED
    nonces.admit(signer.verify(signer.sign("w0", D, now=1000.0), "w0", now=1001.0), now=1001.0)  # a new one passes


def test_forged_misaddressed_expired_and_malformed_orders_are_refused():
    signer = ControlSigner(SECRET)
    control = signer.sign("w0", D, now=1000.0)

    def refusal(c: RoleControl, worker: str = "w0", now: float = 1001.0) -> OrderRefusal:
        with pytest.raises(OrderRefused) as refused:
            signer.verify(c, worker, now=now)
        assert "order" in str(refused.value) and c.order not in str(refused.value)  # never repeats the order
        return refused.value.reason

    assert refusal(ControlSigner("another-secret-entirely").sign("w0", D)) is OrderRefusal.FORGED
    other = ControlSigner(SECRET).sign("w0", P, now=1000.0)
    assert refusal(RoleControl(other.order, control.mac)) is OrderRefusal.FORGED  # the order altered
    assert refusal(control, worker="w1") is OrderRefusal.WRONG_WORKER
    assert refusal(control, now=1000.0 + 60 + 6) is OrderRefusal.EXPIRED  # lifetime 60 s, skew 5 s
    assert refusal(RoleControl(control.order, "not base64!")) is OrderRefusal.MALFORMED
    assert refusal(RoleControl("x" * 5000, control.mac)) is OrderRefusal.MALFORMED
    assert refusal(RoleControl(control.order, control.mac[:-2] + "AA")) is OrderRefusal.FORGED  # the MAC altered


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ControlSigner("short")


def test_the_cluster_view_shows_each_workers_role_now():
    from services.local.cluster_state import describe

    workers = beats(P, D)
    workers[0] = msgspec.structs.replace(workers[0], switching_to=D, draining=True, running=1, total_blocks=8)
    workers[1] = msgspec.structs.replace(workers[1], parallel="tp=2 ep=1", free_blocks=6, total_blocks=8)
    assert describe({b.worker_id: b for b in workers}) == [
        "w0: prefill → decode (switching), 1 running, 0 waiting, 8/8 KV blocks used, 0 held",
        "w1: decode [tp=2 ep=1], 0 running, 0 waiting, 2/8 KV blocks used, 0 held",
    ]
