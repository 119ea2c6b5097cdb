"""The admin API (docs/api.md, "Admin API"): the live workers, and a worker's role switched while it runs.

    GET  /admin/workers                  every live worker: id, role (and the role it is switching to), group
                                         layout, load, from the heartbeats this gateway receives
    POST /admin/workers/{id}/role        {"role": "decode", "finish_s": 5}: switch it; answered once the switch
                                         is done (200), or why not (4xx/5xx with the switch's result)

Every call needs `Authorization: Bearer <admin key>` (GatewaySettings.admin_keys; none configured: 403, the API is
off). A switch goes through shared/role_control's `switch_role`: the deployment's lock (pd:admin:role-lock, shared
with other gateways and the planner), the safety rule (the last live worker of a needed role stays), the order
signed with the cluster secret, the worker's answer. Not in the OpenAPI document: it is the operator's API, not
the OpenAI surface.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec
from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from services.gateway.backend import BackendUnavailable, GatewayBackend
from services.gateway.errors import APIError, error_body
from shared.messages import Heartbeat, Role, SwitchOutcome
from shared.role_control import SwitchResult

# what each outcome answers: the worker's state made it impossible (409), no such worker (404), the gateway's
# secret is not the workers' (502), no answer in time (504)
STATUS = {
    SwitchOutcome.SWITCHED: 200,
    SwitchOutcome.UNKNOWN_WORKER: 404,
    SwitchOutcome.SAME_ROLE: 409,
    SwitchOutcome.BUSY: 409,
    SwitchOutcome.LOCKED: 409,
    SwitchOutcome.UNSAFE: 409,
    SwitchOutcome.INVALID: 409,
    SwitchOutcome.TIMED_OUT: 409,
    SwitchOutcome.STOPPING: 409,
    SwitchOutcome.REFUSED: 502,
    SwitchOutcome.NO_REPLY: 504,
}


@runtime_checkable
class AdminBackend(Protocol):
    """What the admin API needs of the backend (NatsBackend has it)."""

    def live_workers(self) -> list[tuple[Heartbeat, float]]:
        """Every live worker's latest heartbeat and its age in seconds."""
        ...

    async def switch_role(self, worker_id: str, role: Role, finish_s: float | None) -> SwitchResult:
        """Switch one worker (shared/role_control.switch_role); BackendUnavailable when it cannot be asked."""
        ...


class RoleChange(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    finish_s: float | None = None


@get("/workers", include_in_schema=False)
async def list_workers(backend: NamedDependency[GatewayBackend]) -> dict[str, Any]:
    """Every live worker, from its latest heartbeat; `roles` counts those serving (not draining or switching)."""
    admin = _admin(backend)
    workers = sorted(admin.live_workers(), key=lambda wa: wa[0].worker_id)
    serving = [b for b, _ in workers if not b.draining and b.switching_to is None]
    return {
        "object": "list",
        "data": [worker_json(beat, age) for beat, age in workers],
        "roles": {role.value: sum(b.role is role for b in serving) for role in Role},
    }


@post("/workers/{worker_id:str}/role", include_in_schema=False, status_code=200)
async def switch_worker_role(
    worker_id: FromPath[str], request: Request[Any, Any, Any], backend: NamedDependency[GatewayBackend]
) -> Response[Any]:
    """Switch a live worker's role; the answer comes once the switch is done (or refused)."""
    admin = _admin(backend)
    change = _role_change(await request.body())
    try:
        role = Role(change.role)
    except ValueError:
        roles = ", ".join(r.value for r in Role)
        raise APIError(400, f"unknown role {change.role!r}: one of {roles}", "role") from None
    if change.finish_s is not None and change.finish_s < 0:
        raise APIError(400, "finish_s must be >= 0", "finish_s")
    if all(beat.worker_id != worker_id for beat, _ in admin.live_workers()):
        raise APIError(404, f"no live worker {worker_id!r} (GET /admin/workers lists them)", "worker_id")
    try:
        result = await admin.switch_role(worker_id, role, change.finish_s)
    except BackendUnavailable as exc:
        raise APIError(503, str(exc)) from exc
    status = STATUS[result.outcome]
    if status == 200:
        return Response(result.as_dict(), status_code=200)
    body = msgspec.to_builtins(error_body(status, result.detail or result.outcome.value)) | {"switch": result.as_dict()}
    return Response(body, status_code=status)


def worker_json(beat: Heartbeat, age_s: float) -> dict[str, Any]:
    """One worker as GET /admin/workers lists it."""
    usage = 1 - beat.free_blocks / beat.total_blocks if beat.total_blocks else 0.0
    return {
        "id": beat.worker_id,
        "role": beat.role.value,
        "switching_to": None if beat.switching_to is None else beat.switching_to.value,
        "draining": beat.draining,
        "model": beat.model,
        "group": {
            "parallel": beat.parallel or "tp=1 ep=1",
            "ranks": max(1, len(beat.rank_pids)),
            "rank_pids": list(beat.rank_pids),
        },  # fmt: skip
        "load": {
            "running": beat.running,
            "waiting": beat.waiting,
            "waiting_tokens": beat.waiting_tokens,
            "held_kv": beat.held_kv,
            "kv_usage": round(usage, 4),
            "free_blocks": beat.free_blocks,
            "total_blocks": beat.total_blocks,
        },
        "last_heartbeat_s": round(age_s, 3),
    }


def _admin(backend: GatewayBackend) -> AdminBackend:
    if not isinstance(backend, AdminBackend):
        raise APIError(503, "this gateway's backend has no admin plane")
    return backend


def _role_change(body: bytes) -> RoleChange:
    try:
        return msgspec.json.decode(body, type=RoleChange)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"invalid body: {exc}") from None
    except msgspec.DecodeError:
        raise APIError(400, 'the body must be a JSON object such as {"role": "decode"}') from None


ADMIN_ROUTES = [list_workers, switch_worker_role]
