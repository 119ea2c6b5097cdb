"""A JetStream job message for worker tests: the encoded job, and how the worker settled it."""

from __future__ import annotations

from types import SimpleNamespace

from shared.messages import DecodeJob, PrefillJob, encode


class FakeMsg:
    """A job message of model "demo" (an empty one without a job); `calls` records ack / term / in_progress."""

    def __init__(self, job: PrefillJob | DecodeJob | None = None, subject: str | None = None) -> None:
        role = "decode" if isinstance(job, DecodeJob) else "prefill"
        self.data = encode(job) if job is not None else b""
        self.subject = subject or f"pd.jobs.{role}.demo"
        self.headers = None
        self.metadata = SimpleNamespace(num_delivered=1)
        self.calls: list[str] = []

    async def ack(self) -> None:
        self.calls.append("ack")

    async def term(self) -> None:
        self.calls.append("term")

    async def in_progress(self) -> None:
        self.calls.append("in_progress")
