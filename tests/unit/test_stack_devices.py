"""`pdserve up --prefill-devices ... --decode-devices ...`: each worker gets its device, workers sharing a GPU
split the memory share, disjoint GPUs move KV over NCCL, and the flags parse into each worker's settings."""

from __future__ import annotations

import pytest

from services.local.stack import Stack, StackSpec, device_name
from shared.settings import WorkerSettings, from_args

pytestmark = pytest.mark.unit


def worker_settings(monkeypatch, stack: Stack) -> list[WorkerSettings]:
    """Every worker's settings, parsed from the command line the stack would start it with."""
    import services.cli as cli

    parsed: list = []
    monkeypatch.setattr(cli, "_worker", parsed.append)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s" * 32)
    for role, device in zip(stack.spec.roles(), stack.spec.worker_devices(), strict=True):
        cli.main([role, *stack._worker_flags(role, device)])
    return [from_args(WorkerSettings, a) for a in parsed]


def up(monkeypatch, *argv: str) -> Stack:
    """The Stack `pdserve up <argv>` would supervise."""
    import services.cli as cli
    import services.local.supervisor as supervisor

    stacks = []

    class FakeSupervisor:
        def __init__(self, stack, *args, **kwargs) -> None:
            stacks.append(stack)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(supervisor, "Supervisor", FakeSupervisor)
    monkeypatch.setattr("services.local.preflight.preflight", lambda *_a, **_kw: None)  # no checkpoint here
    assert cli.main(["up", "--model", "m", *argv]) == 0
    return stacks[0]


def test_each_role_on_its_own_gpu_moves_kv_over_nccl(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRANSFER_BACKEND", raising=False)
    stack = up(monkeypatch, "--prefill-devices", "0", "--decode-devices", "cuda:1")
    prefill, decode = worker_settings(monkeypatch, stack)
    assert (prefill.engine.device, decode.engine.device) == ("cuda:0", "cuda:1")
    assert prefill.kv.backend == decode.kv.backend == "nccl"
    assert prefill.engine.gpu_memory_utilization == decode.engine.gpu_memory_utilization == 0.9  # nobody shares


def test_workers_sharing_a_gpu_split_its_memory_and_keep_gloo(monkeypatch):
    monkeypatch.delenv("PDSERVE_TRANSFER_BACKEND", raising=False)
    monkeypatch.delenv("PDSERVE_GPU_MEMORY_UTILIZATION", raising=False)
    stack = up(monkeypatch, "--prefill", "2", "--decode", "1", "--prefill-devices", "0", "--decode-devices", "0")
    settings = worker_settings(monkeypatch, stack)
    assert [s.engine.device for s in settings] == ["cuda:0"] * 3
    assert [s.engine.gpu_memory_utilization for s in settings] == [0.3] * 3
    assert {s.kv.backend for s in settings} == {"gloo"}  # NCCL refuses a pair's two ranks on one GPU


def test_round_robin_over_fewer_devices_than_workers():
    spec = StackSpec(model="m", prefill=3, decode=2, devices={"prefill": ("0", "1"), "decode": ("2",)})
    assert spec.worker_devices() == ["cuda:0", "cuda:1", "cuda:0", "cuda:2", "cuda:2"]
    assert spec.shared_gpus() == {"cuda:0": 2, "cuda:2": 2}
    assert spec.nccl_pairs()  # prefill on 0 and 1, decode on 2


def test_a_budget_the_user_gave_wins_over_the_split(monkeypatch):
    stack = up(monkeypatch, "--prefill", "2", "--prefill-devices", "0", "--prefill-args=--gpu-memory-utilization 0.6")
    prefill = worker_settings(monkeypatch, stack)[:2]
    assert [s.engine.gpu_memory_utilization for s in prefill] == [0.6, 0.6]
    shared = Stack(StackSpec(model="m", prefill=2, devices={"prefill": ("0",)}))
    assert "--gpu-memory-utilization" in shared._worker_flags("prefill", "cuda:0")
    monkeypatch.setenv("PDSERVE_KV_CACHE_BYTES", str(1 << 30))  # a budget in the environment reaches every worker
    assert "--gpu-memory-utilization" not in shared._worker_flags("prefill", "cuda:0")


def test_cpu_workers_and_roles_without_devices_keep_their_own_settings(monkeypatch):
    spec = StackSpec(model="m", devices={"decode": ("cpu",)})
    assert spec.worker_devices() == [None, "cpu"]
    assert not spec.nccl_pairs() and not spec.shared_gpus()
    assert "--device" not in Stack(spec)._worker_flags("prefill", None)


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", "cpu:1", ""])
def test_unknown_devices_are_refused(bad):
    with pytest.raises(ValueError, match="unknown device|at least one device"):
        StackSpec(model="m", devices={"prefill": (bad,)} if bad else {"prefill": ()})


def test_device_names():
    names = [device_name(d) for d in ("3", "cuda", "cuda:2", "cpu", " 1 ")]
    assert names == ["cuda:3", "cuda", "cuda:2", "cpu", "cuda:1"]


def test_up_tp_flags_make_each_role_a_worker_group(monkeypatch) -> None:
    stack = up(monkeypatch, "--decode-tp", "2", "--decode", "2", "--prefill-ep", "2", "--decode-devices", "0,1,2,3")
    assert stack.spec.parallel == {"decode": (2, 1), "prefill": (1, 2)}
    assert stack.spec.worker_devices() == [None, "cuda:0", "cuda:2"]  # each decode group starts at its own GPUs
    settings = worker_settings(monkeypatch, stack)
    assert [(s.engine.tp, s.engine.ep) for s in settings] == [(1, 2), (2, 1), (2, 1)]
    with pytest.raises(ValueError, match="each 1 or the group size"):
        StackSpec(model="m", parallel={"decode": (2, 4)})
