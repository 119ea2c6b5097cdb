"""The KV hand-off into a data-parallel attention decode group (--dp-attention, EP = DP = 2) through the real
stack (gateway, NATS, Redis, a prefill worker of another layout, the decode group of two processes), over the tiny
DeepSeek-V3 checkpoint (MLA's latent cache, MoE after a dense first layer).

For a single-process prefill worker, a TP = 2 and an EP = 2 prefill group: every stream equals the single-process
engine's greedy output, the decode side never runs a prompt's forward pass (its prefill_tokens stays 0: each KV
was pulled and written into its request's rank's pool, never recomputed), its heartbeat says its layout and its
ranks' loads, and afterwards both sides have freed every block and no location is left in Redis.
"""

from __future__ import annotations

import pytest

from services.demo_model import write_demo_checkpoint
from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.chaos import Load, settled
from tests.e2e.test_group_handoff import HANDOFF_ENV, MAX_TOKENS, PROMPTS, _reference
from tests.e2e_support import heartbeats, start_stack

pytestmark = pytest.mark.slow  # worker groups: ranks spawned per scenario (make test-slow)


@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("latent") / "demo", arch="deepseek_v3", size="tiny")


@pytest.mark.parametrize("prefill", [(1, 1), (2, 1), (1, 2)], ids=["single-to-dp2", "tp2-to-dp2", "ep2-to-dp2"])
def test_kv_hands_off_into_a_dp_attention_decode_group(latent, prefill: tuple[int, int]) -> None:
    reference = _reference(latent)
    parallel = {"decode": (1, 2)} | ({"prefill": prefill} if max(prefill) > 1 else {})
    spec = StackSpec(model=str(latent), port=free_port(), prefill=1, decode=1, threads_per_worker=2,
                     parallel=parallel, role_args={"decode": ("--dp-attention",)}, env=HANDOFF_ENV)  # fmt: skip
    stack = start_stack(spec)
    try:
        outcomes = Load(stack.url, PROMPTS, MAX_TOKENS).results()
        for o in outcomes:
            assert o.verdict == "completed", (o.prompt[:30], o.status, o.error, o.exception)
            assert o.text == reference[o.prompt], f"{o.prompt[:30]!r}: {o.text!r} != {reference[o.prompt]!r}"
        settled(stack)
        assert stack.nats_url is not None
        by_role = {b.role.value: b for b in heartbeats(stack.nats_url).values()}
        decode = by_role["decode"]
        assert decode.prefill_tokens == 0, "the decode side ran a prompt's forward pass (recomputed)"
        assert decode.decode_tokens > 0
        assert decode.parallel == "tp=1 ep=2 dp=2", decode.parallel
        assert len(decode.dp_rank_free_blocks) == 2 and sum(decode.dp_rank_free_blocks) == decode.free_blocks
        assert decode.fit_blocks == max(decode.dp_rank_free_blocks) < decode.free_blocks
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
