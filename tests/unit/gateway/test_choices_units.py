"""n > 1 below the engine: the HTTP shapes of n choices over a fake backend (indexed choices and chunks, a role
per choice, usage as OpenAI counts it, one job per choice with seed + i), the group job's wire form, how a
worker splits it into one job per choice, and what a worker refuses in its siblings."""

from __future__ import annotations

import msgspec
import pytest
from litestar.testing import TestClient

from services.gateway import create_app
from services.gateway.backend import GenerationJob, Update
from shared.job_checks import MAX_CHOICES, job_refusal
from shared.messages import DecodeJob, PrefillJob, Sampling, Sibling, decode, encode, token_subject
from shared.worker.choices import choice_jobs
from tests.openai_schema import validate, validate_stream_chunk
from tests.unit.gateway.harness import (
    CHAT,
    COMPLETIONS,
    FakeBackend,
    settings_for,
    stream_chunks,
)

REPLIES = ["one", "two two", "three three three"]
SEED = 40


class SeededBackend(FakeBackend):
    """Answers each choice with the reply of its seed, so the choices differ and each is recognisable."""

    def _script(self, job: GenerationJob):
        ids = self.tokenizer.encode(REPLIES[(job.sampling.seed or SEED) - SEED])
        yield from (Update([t]) for t in ids)
        yield Update([self.tokenizer.eos_token_ids[0]], "stop")


@pytest.fixture
def fake(tokenizer):
    return SeededBackend(tokenizer)


def test_completion_choices_are_indexed_and_usage_counts_the_prompt_once(client, fake, tokenizer):
    body = {"prompt": "hi", "n": 3, "seed": SEED, "max_tokens": 50}
    resp = client.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    validate(out, "CreateCompletionResponse")  # n choices in OpenAI's published shape
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
        (i, r, "stop") for i, r in enumerate(REPLIES)
    ]
    prompt_tokens = len(fake.jobs[0].prompt_token_ids)
    completion = sum(len(tokenizer.encode(r)) + 1 for r in REPLIES)  # + the EOS each
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    rid = fake.jobs[0].request_id
    assert [(j.request_id, j.sampling.seed) for j in fake.jobs] == [
        (rid, SEED),
        (f"{rid}_c1", SEED + 1),
        (f"{rid}_c2", SEED + 2),
    ]


def test_chat_chunks_name_their_choice_and_each_choice_gets_the_role(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": SEED, "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp = client.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    chunks = stream_chunks(resp.text)
    for chunk in chunks:
        validate_stream_chunk(chunk, chat=True)
    texts: dict[int, str] = {}
    roles: dict[int, str | None] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (c,) = chunk["choices"]
        roles.setdefault(c["index"], c["delta"].get("role"))
        texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
        if c["finish_reason"]:
            reasons[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in range(3)] == REPLIES
    assert roles == dict.fromkeys(range(3), "assistant") and reasons == dict.fromkeys(range(3), "stop")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 3


def test_n_above_max_n_and_best_of_other_than_n_are_refused(checkpoint, fake):
    with TestClient(create_app(settings_for(checkpoint, max_n=2), fake)) as c:
        resp = c.post(COMPLETIONS, json={"prompt": "hi", "n": 3})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
        assert "max_n" in resp.json()["error"]["message"]
        resp = c.post(COMPLETIONS, json={"prompt": "hi", "n": 2, "best_of": 3})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of"
        assert c.post(COMPLETIONS, json={"prompt": "hi", "n": 2, "best_of": 2, "seed": SEED}).status_code == 200


def _group(siblings: list[Sibling]) -> PrefillJob:
    return PrefillJob(
        "r", "demo", [1, 2, 3], Sampling(max_tokens=4, seed=SEED), token_subject("gw", "r"), siblings=siblings
    )


def test_a_group_job_splits_into_one_job_per_choice_and_survives_the_wire():
    siblings = [Sibling(f"r_c{i}", token_subject("gw", f"r_c{i}"), SEED + i) for i in (1, 2)]
    job = decode(encode(_group(siblings)), PrefillJob)
    assert job.siblings == siblings
    jobs = choice_jobs(job)
    assert [(j.request_id, j.reply_subject, j.sampling.seed, j.siblings) for j in jobs] == [
        ("r", token_subject("gw", "r"), SEED, []),
        ("r_c1", token_subject("gw", "r_c1"), SEED + 1, []),
        ("r_c2", token_subject("gw", "r_c2"), SEED + 2, []),
    ]
    assert all(j.prompt_token_ids == [1, 2, 3] and j.sampling.max_tokens == 4 for j in jobs)
    sibling = Sibling("r_c2", token_subject("gw", "r_c2"), SEED + 2, [9])
    sampling = Sampling(max_tokens=4, seed=SEED + 1)
    moved = DecodeJob(
        "r_c1", "demo", [1, 2, 3], [7], sampling, token_subject("gw", "r_c1"), siblings=[sibling], kv_key="r"
    )
    moved = decode(encode(moved), DecodeJob)
    assert [(j.request_id, j.output_token_ids) for j in choice_jobs(moved)] == [("r_c1", [7]), ("r_c2", [9])]
    assert moved.kv_key == "r"


@pytest.mark.parametrize(
    ("siblings", "reply", "wording"),
    [
        ([Sibling("r_c1", "pd.jobs.prefill.demo")], False, "token subject"),
        ([Sibling("r", token_subject("gw", "r"))], False, "distinct"),
        ([Sibling(f"r_c{i}", token_subject("gw", f"r_c{i}")) for i in range(1, MAX_CHOICES + 1)], False, "at most"),
        ([Sibling("r_c1", token_subject("gw", "r_c1"), output_token_ids=[10**6])], True, "vocabulary"),
    ],
)
def test_a_worker_refuses_unsound_siblings(siblings, reply, wording):
    refusal = job_refusal(_group(siblings), vocab_size=1000, max_model_len=64)
    assert refusal is not None and refusal.reply is reply and wording in refusal.reason
    assert job_refusal(_group(siblings[:0]), vocab_size=1000, max_model_len=64) is None
    assert msgspec.structs.asdict(_group([]))["siblings"] == []


def test_the_decode_job_names_the_group_kv_when_the_first_choice_ended():
    """Choice 0 ended at its first token, choices 1 and 2 go on: one decode job for them, pulling the KV held
    under choice 0's key; when choice 0 goes on, the job's own key is the KV's."""
    from services.prefill.worker import _decode_job

    siblings = [Sibling(f"r_c{i}", token_subject("gw", f"r_c{i}"), SEED + i) for i in (1, 2)]
    jobs = choice_jobs(_group(siblings))
    job = _decode_job([(jobs[1], 11), (jobs[2], 12)], "prefill-0", kv_key=jobs[0].key)
    assert (job.request_id, job.output_token_ids, job.kv_key, job.prefill_worker) == ("r_c1", [11], "r", "prefill-0")
    assert job.sampling.seed == SEED + 1
    assert [(s.request_id, s.seed, s.output_token_ids) for s in job.siblings] == [("r_c2", SEED + 2, [12])]
    whole = _decode_job([(j, 10 + i) for i, j in enumerate(jobs)], "prefill-0", kv_key=jobs[0].key)
    assert whole.request_id == "r" and whole.kv_key is None and len(whole.siblings) == 2
