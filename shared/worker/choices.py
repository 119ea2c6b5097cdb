"""A job of n choices (shared/choices.py) as the worker runs it: split once, as it is taken (Worker.take_choices),
into one single-choice job per choice, each with a ledger entry of its own (keyed by its attempt key, as every
request here), so that outputs, events, cancels and failures find a choice exactly as they find a single request.
The engine computes (or imports) the prompt's KV once and forks the choices from it.

The group's message and spans belong to the entry of the job as it came (the first choice's): the other
choices' entries hold no message (`Worker.adopt`) and share its process span (ended once, by whoever ends it).
"""

from __future__ import annotations

import msgspec

from shared.engine.fork import Choice
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
