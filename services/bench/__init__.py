"""`pdserve bench`: a load generator for any OpenAI-compatible endpoint (pdserve, vLLM, SGLang, ...).

- datasets: the workloads (random tokens, ShareGPT, the interference mix) as lists of BenchRequest
- prefix_workloads: prompts that share prefixes (shared-prefix groups; multi-turn Conversations)
- arrivals: when requests are sent (gamma / Poisson process)
- client: one streamed request, timed, as a RequestRecord
- runner: a whole run (BenchConfig → BenchResult), a conversation's turns one after another
- metrics: records → the summary, with vLLM's definitions and key names
- report, cli: the printed table and the command line

Typical use from Python::

    requests = random_requests(Tokenizer(model_dir), num=100, input_len=256, output_len=64)
    result = run(BenchConfig(base_url="http://127.0.0.1:8000", model="demo", request_rate=4.0), requests)
    result.summary["p99_tpot_ms"]
"""

from services.bench.datasets import BenchRequest, interference_requests, random_requests, sharegpt_requests
from services.bench.metrics import RequestRecord, summarize
from services.bench.prefix_workloads import Conversation, multi_turn_conversations, shared_prefix_requests
from services.bench.runner import BenchConfig, BenchResult, run, run_benchmark

__all__ = [
    "BenchConfig",
    "BenchRequest",
    "BenchResult",
    "Conversation",
    "RequestRecord",
    "interference_requests",
    "multi_turn_conversations",
    "random_requests",
    "run",
    "run_benchmark",
    "shared_prefix_requests",
    "sharegpt_requests",
    "summarize",
]
