"""Executes a schedule plan: builds the flat batch, runs the model over the paged cache, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.kv_pool import KVPool
from shared.engine.sampling import Sampler
from shared.engine.scheduler import SchedulePlan
from shared.model.paged_attention import AttentionMetadata
from shared.model.transformer import CausalLM


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id → next token, for every sequence that sampled
    logits: dict[str, torch.Tensor]  # request id → (V,) float32 logits the token was sampled from


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, sampler: Sampler) -> None:
        self.model = model
        self.pool = pool
        self.sampler = sampler
        self._caches = pool.layer_caches()
        self.device = pool.tensor.device

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> RunnerOutput:
        if not plan.seqs:
            return RunnerOutput({}, {})
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        for seq in plan.seqs:
            start = seq.request.num_computed_tokens
            input_ids += seq.request.token_slice(start, start + seq.num_tokens)
            positions.append(torch.arange(start, start + seq.num_tokens))
        meta = AttentionMetadata.build(
            block_tables=[s.request.block_table for s in plan.seqs],
            context_lens=[s.request.num_computed_tokens + s.num_tokens for s in plan.seqs],
            query_lens=[s.num_tokens for s in plan.seqs],
            block_size=self.pool.layout.block_size,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.cat(positions).to(self.device), self._caches, meta)

        # Only sequences that caught up sample; their last token's hidden state gives the logits.
        ends = torch.tensor([s.num_tokens for s in plan.seqs]).cumsum(0) - 1
        sampling = [i for i, s in enumerate(plan.seqs) if s.samples]
        if not sampling:
            return RunnerOutput({}, {})
        logits = self.model.logits(hidden[ends[sampling].to(self.device)])
        reqs = [plan.seqs[i].request for i in sampling]
        tokens = self.sampler.sample(logits.cpu(), [r.params for r in reqs], [len(r.output_token_ids) for r in reqs])
        ids_ = [r.request_id for r in reqs]
        return RunnerOutput(dict(zip(ids_, tokens, strict=True)), dict(zip(ids_, logits, strict=True)))
