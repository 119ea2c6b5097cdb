"""Whether a role switch may go ahead, from the live workers' heartbeats: a pure rule (no I/O, no clock).

A deployment serves a model with mixed workers, or with prefill and decode workers together: a prefill worker
hands every request on to a decode worker, and a decode worker takes only what a prefill worker (or the gateway's
local path) hands it. So after a switch, with the switching worker counted in its new role and every draining or
switching worker in none:

- prefill is needed while a decode worker remains, decode while a prefill worker remains, and mixed while no
  prefill and decode pair remains;
- a switch that leaves a needed role with no worker is refused (UNSAFE), naming the role.

A deployment already short of a role (its last decode worker died, say) may switch a worker into it: the rule
judges the state after the switch, not the change. A draining worker (shutting down) or one switching already is
refused too; a worker of that role already is SAME_ROLE.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from shared.messages import Heartbeat, Role, SwitchOutcome, subject_token


def switch_refusal(workers: Iterable[Heartbeat], worker_id: str, role: Role) -> tuple[SwitchOutcome, str] | None:
    """Why switching `worker_id` to `role` must not happen, given the live workers' latest heartbeats; None: it
    may. Workers of other models than the target's do not count."""
    beats = list(workers)
    target = next((b for b in beats if b.worker_id == worker_id), None)
    if target is None:
        return SwitchOutcome.UNKNOWN_WORKER, f"no live worker {worker_id!r}"
    if target.switching_to is not None:
        return SwitchOutcome.BUSY, f"worker {worker_id!r} is switching to {target.switching_to} already"
    if target.draining:
        return SwitchOutcome.STOPPING, f"worker {worker_id!r} is draining (shutting down)"
    if target.role is role:
        return SwitchOutcome.SAME_ROLE, f"worker {worker_id!r} is a {role} worker already"
    model = subject_token(target.model)
    after = Counter(
        b.role
        for b in beats
        if b.worker_id != worker_id and subject_token(b.model) == model and not b.draining and b.switching_to is None
    )
    after[role] += 1
    short = [r for r in needed(after) if not after[r]]
    if short:
        left = ", ".join(f"{after[r]} {r}" for r in Role if after[r])
        return SwitchOutcome.UNSAFE, (
            f"worker {worker_id!r} is the last live {target.role} worker, and the deployment needs one: after the "
            f"switch it would have {left} (at least one worker of every needed role is kept)"
        )
    return None


def needed(counts: Counter[Role]) -> list[Role]:
    """The roles a deployment with these workers per role cannot do without (see the module)."""
    roles = []
    if counts[Role.DECODE]:
        roles.append(Role.PREFILL)
    if counts[Role.PREFILL]:
        roles.append(Role.DECODE)
    if not (counts[Role.PREFILL] and counts[Role.DECODE]):
        roles.append(Role.MIXED)
    return roles
