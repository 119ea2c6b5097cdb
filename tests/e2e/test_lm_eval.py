"""lm-eval's `local-completions` model against a live 1p1d stack, on a tiny task defined here (a task YAML and a
JSONL dataset in a temporary directory: nothing is downloaded): the log-likelihoods it computes from the gateway's
echoed prompt logprobs equal transformers' on the same checkpoint and the same token ids.

The same run by hand (docs/api.md): `lm_eval --model local-completions --model_args
model=demo,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=models/demo-tiny-qwen3_moe,tokenizer_backend=huggingface
--include_path <dir with the YAML> --tasks pdserve_tiny_loglik --log_samples --output_path out/`."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.local.infra import free_port
from services.local.stack import StackSpec
from tests.e2e_support import start_stack

DOCS = [
    {"context": "The quick brown fox", "continuation": " jumps over the lazy dog"},
    {"context": "Disaggregated serving splits", "continuation": " prefill from decode"},
    {"context": "héllo wörld,", "continuation": " 世界!"},
]
TASK = "pdserve_tiny_loglik"


def _task_dir(tmp_path) -> str:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
    )
    return str(tmp_path)


@pytest.mark.slow  # a stack, lm-eval's import and its evaluation loop: over a minute on two cores (make test-slow)
def test_lm_eval_loglikelihoods_equal_transformers(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    stack = start_stack(StackSpec(model=str(model_dir), port=free_port(), prefill=1, decode=1, threads_per_worker=1))
    try:
        args = (
            f"model=demo,base_url={stack.url}/v1/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1"
        )
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=_task_dir(tmp_path)),
            log_samples=True,
        )
    finally:
        stack.stop()
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for doc, sample in zip(DOCS, samples, strict=True):
        ours, _greedy = sample["resps"][0][0]
        context = tok(doc["context"]).input_ids
        whole = tok(doc["context"] + doc["continuation"]).input_ids
        assert whole[: len(context)] == context  # the continuation's tokens start where the context's end
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
        want = sum(logp[j - 1, whole[j]].item() for j in range(len(context), len(whole)))
        assert ours == pytest.approx(want, abs=1e-3)
