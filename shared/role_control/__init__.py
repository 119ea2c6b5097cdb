"""Role switching from outside a worker: the signed order, the safety rule, the deployment's lock and the call that
puts them together (docs/architecture.md, "Role switching"). The gateway's admin API and the planner use
`switch_role`; the worker side (shared/worker/host.py) checks orders with `ControlSigner` and `NonceMemory`.

client.py   switch_role (lock → live workers → safety → order → answer → settle), request_switch, SwitchResult
signing.py  ControlSigner: orders signed with the cluster secret (HMAC), checked by the worker; NonceMemory
safety.py   switch_refusal: the last live worker of a needed role is kept
lock.py     pd:admin:role-lock: one switch at a time across gateways and the planner
"""

from shared.role_control.client import SwitchResult, live_workers, request_switch, switch_role
from shared.role_control.lock import LOCK_KEY, LockTaken, role_lock
from shared.role_control.safety import switch_refusal
from shared.role_control.signing import ControlSigner, NonceMemory, OrderRefused

__all__ = [
    "LOCK_KEY",
    "ControlSigner",
    "LockTaken",
    "NonceMemory",
    "OrderRefused",
    "SwitchResult",
    "live_workers",
    "request_switch",
    "role_lock",
    "switch_refusal",
    "switch_role",
]
