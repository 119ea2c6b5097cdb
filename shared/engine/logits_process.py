"""Batched logit processing before sampling, in vLLM's order: logit_bias, then the repetition, frequency and
presence penalties, then temperature (this module); then min_p, top_k, top_p (`filter_batch`).

Every function takes the step's (N, V) float32 logits on their device and one `RowParams` per row (a
sampling.SamplingParams: this module names only the fields it reads, so it does not import sampling), and works
as tensor ops over all rows at once (only the rows that use a feature are touched). Histories are the requests'
own token ids (prompt and output so far), so a request gives the same logits whichever engine runs its step
(one engine, a decode worker after a hand-off, or after a migration).

Definitions:
    logit_bias:          logit[t] += bias[t]
    repetition_penalty:  over prompt + output tokens: logit > 0 → logit / r, else logit * r (HF / vLLM)
    frequency/presence:  over output tokens: logit[t] -= frequency * count[t] + presence * (count[t] > 0) (OpenAI)
    temperature:         logit / t (a greedy temperature, below GREEDY_BELOW, leaves them)
    min_p:               drop t when p[t] < min_p * max(p)
    top_k / top_p:       keep the k most likely / the smallest nucleus whose probability reaches top_p
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

NEG_INF = float("-inf")


class RowParams(Protocol):
    """What processing and filtering read of one row's sampling parameters (read-only)."""

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def has_penalties(self) -> bool: ...
    @property
    def scale(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def top_p(self) -> float: ...


def process_batch(
    logits: torch.Tensor, params: Sequence[RowParams], histories: Sequence[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """Bias, penalties and temperature applied to a copy of `logits` (N, V); histories[i] = (prompt, output)."""
    out = logits.clone()
    _apply_bias(out, params)
    _apply_penalties(out, params, histories)
    temps = [p.scale for p in params]
    if any(t != 1.0 for t in temps):
        out /= torch.tensor(temps, dtype=out.dtype).to(out.device)[:, None]
    return out


def _apply_bias(logits: torch.Tensor, params: Sequence[RowParams]) -> None:
    rows, ids, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(i)
            ids.append(token)
            biases.append(bias)
    if rows:
        index = torch.tensor([rows, ids], dtype=torch.int64).to(logits.device)
        logits.index_put_((index[0], index[1]), torch.tensor(biases, dtype=logits.dtype).to(logits.device), True)


def _apply_penalties(
    logits: torch.Tensor, params: Sequence[RowParams], histories: Sequence[tuple[list[int], list[int]]]
) -> None:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    device, v = logits.device, logits.shape[1]
    sub = logits[rows]  # (R, V), a copy; written back below
    # output counts (R, V): one scatter of every output id of the penalised rows
    out_rows = [r for j, i in enumerate(rows) for r in [j] * len(histories[i][1])]
    out_ids = [t for i in rows for t in histories[i][1]]
    counts = torch.zeros((len(rows), v), dtype=logits.dtype, device=device)
    if out_ids:
        index = torch.tensor([out_rows, out_ids], dtype=torch.int64).to(device)
        counts.index_put_((index[0], index[1]), torch.ones(len(out_ids), dtype=logits.dtype, device=device), True)
    # tokens seen anywhere (prompt + output), for the repetition penalty
    seen = counts > 0
    prompt_rows = [r for j, i in enumerate(rows) for r in [j] * len(histories[i][0])]
    prompt_ids = [t for i in rows for t in histories[i][0]]
    if prompt_ids:
        index = torch.tensor([prompt_rows, prompt_ids], dtype=torch.int64).to(device)
        seen[index[0], index[1]] = True
    values = torch.tensor(
        [[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty] for i in rows],
        dtype=logits.dtype,
    ).to(device)
    rep, freq, pres = values[:, 0:1], values[:, 1:2], values[:, 2:3]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def filter_batch(logits: torch.Tensor, params: Sequence[RowParams]) -> torch.Tensor:
    """min_p, then top_k, then top_p, each row by its own values; dropped tokens become -inf. Keeps at least the
    most likely token of every row. logits: (N, V), already biased, penalised and divided by temperature."""
    n, v = logits.shape
    device = logits.device
    min_p = [p.min_p for p in params]
    top_k = [p.top_k if p.top_k is not None and p.top_k < v else v for p in params]
    top_p = [p.top_p for p in params]
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        floor = torch.tensor(min_p, dtype=logits.dtype).to(device)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, NEG_INF)
    if any(k < v for k in top_k):
        ks = torch.tensor(top_k, dtype=torch.int64).to(device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = probs.cumsum(dim=-1) - probs >= torch.tensor(top_p, dtype=logits.dtype).to(device)[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits
