"""The planner's hands: a role switch through the cluster's role control (shared/role_control), the same safe call
the gateway's admin API makes: under the deployment's lock, refused for the last live worker of a needed role,
signed with the cluster secret, answered once the worker serves its new role."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from shared.messages import Role
from shared.redis_client import redis_client
from shared.role_control import switch_role
from shared.settings import PlannerSettings


class SwitchFailed(RuntimeError):
    """The switch was refused (its outcome and why) or did not complete."""


class RoleControl:
    def __init__(self, nc: NATS, settings: PlannerSettings) -> None:
        if settings.cluster_secret is None:
            raise ValueError("switching roles needs the cluster_secret")
        self.nc = nc
        self.secret = settings.cluster_secret
        self.redis = redis_client(settings, socket_connect_timeout=1.0, socket_timeout=5.0)

    async def switch(self, worker_id: str, role: Role) -> None:
        result = await switch_role(self.nc, self.redis, worker_id, role, self.secret, holder="planner")
        if not result.switched:
            raise SwitchFailed(f"{result.outcome.value}: {result.detail}")
