"""Logprobs computed in the batch on the logits' device; only the k values and ids per row reach the host.

Sampled tokens: log-softmax of the processed logits (after logit_bias, penalties and temperature; before min_p /
top_k / top_p), i.e. the distribution the token was drawn from before truncation. For a greedy request without
bias or penalties that is the model's own log-softmax. Prompt tokens: log-softmax of the model's raw logits (what
a log-likelihood is, as transformers computes it), the logits at position j scoring prompt token j + 1.

-inf (a token a bias of -100 cannot make impossible, but a NaN-free guard all the same) is reported as -9999.0, as
OpenAI does: JSON has no infinity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the logprob of the token there, and the top alternatives (most likely first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def gather_logprobs(
    processed: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """tokens (N,) chosen ids on the device; wanted[i] = how many top alternatives row i wants (None = no
    logprobs). Returns the ids and each row's logprobs, read back in one device → host copy."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return tokens.cpu().tolist(), [None] * len(wanted)
    k = max(wanted[i] or 0 for i in rows)
    logp = torch.log_softmax(processed[rows], dim=-1).nan_to_num(neginf=FLOOR)  # (R, V)
    chosen = logp.gather(1, tokens[rows][:, None])  # (R, 1)
    top = logp.topk(k, dim=-1) if k else None
    parts = [tokens.double(), chosen.double().flatten()]
    if top is not None:
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    host = torch.cat(parts).cpu().tolist()  # ids are exact in float64
    n, r = len(wanted), len(rows)
    ids = [int(t) for t in host[:n]]
    out: list[TokenLogprobs | None] = [None] * n
    values, indices = host[n + r : n + r + r * k], host[n + r + r * k :]
    for j, i in enumerate(rows):
        ki = wanted[i] or 0
        out[i] = TokenLogprobs(
            host[n + j],
            tuple(int(t) for t in indices[j * k : j * k + ki]),
            tuple(values[j * k : j * k + ki]),
        )
    return ids, out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits (T, V) raw, at the positions before `targets` (T ids): each target's logprob and the top k."""
    logp = torch.log_softmax(logits.float(), dim=-1).nan_to_num(neginf=FLOOR)
    index = torch.tensor(targets, dtype=torch.int64).to(logits.device)
    chosen = logp.gather(1, index[:, None]).flatten()
    parts = [chosen.double()]
    if k:
        top = logp.topk(k, dim=-1)
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    host = torch.cat(parts).cpu().tolist()
    t = len(targets)
    values, indices = host[t : t + t * k], host[t + t * k :]
    return [
        TokenLogprobs(host[j], tuple(int(x) for x in indices[j * k : (j + 1) * k]), tuple(values[j * k : (j + 1) * k]))
        for j in range(t)
    ]
