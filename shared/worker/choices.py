"""A job of n choices (shared/choices.py) as the worker runs it: one single-choice job per choice, each with a
ledger entry of its own (keyed by its attempt key, as every request here), so that outputs, events, cancels
and failures find a choice exactly as they find a single request.

The group's message and spans belong to the entry of the job as it came (the first choice's): the other
choices' entries hold no message (`Worker.adopt`) and share its process span (ended once, by whoever ends it).
"""

from __future__ import annotations

import msgspec

from shared.engine.engine import Engine, RequestOutput
from shared.engine.fork import Choice
from shared.engine.kv_export import KVExport
from shared.engine.sampling import SamplingParams
from shared.messages import Job


def choice_jobs(job: Job) -> list[Job]:
    """The job's own choice (without its siblings), then one job per sibling: its id, token subject, seed and
    tokens so far, everything else the job's."""
    own = msgspec.structs.replace(job, siblings=[])
    return [own] + [
        msgspec.structs.replace(
            own,
            request_id=s.request_id,
            reply_subject=s.reply_subject,
            sampling=msgspec.structs.replace(job.sampling, seed=s.seed),
            output_token_ids=list(s.output_token_ids),
        )
        for s in job.siblings
    ]


def engine_choices(jobs: list[Job], params: list[SamplingParams]) -> list[Choice]:
    """The engine's view of single-choice jobs: each one's attempt key, parameters and tokens so far."""
    return [Choice(j.key, p, tuple(j.output_token_ids)) for j, p in zip(jobs, params, strict=True)]


def import_and_fork(
    engine: Engine,
    key: str,
    prompt: list[int],
    outputs: list[int],
    params: SamplingParams,
    kv: KVExport,
    choices: list[Choice],
) -> list[RequestOutput]:
    """On the engine thread, in one call: import the pulled prompt KV as the first choice (`key`), then fork
    the others (`choices[1:]`) from it. Raises NoFreeBlocksError (nothing taken) as import_kv does; returns
    the outputs of forked choices that had ended already."""
    engine.import_kv(key, prompt, outputs, params, kv)
    return engine.fork(key, choices[1:]) if len(choices) > 1 else []
