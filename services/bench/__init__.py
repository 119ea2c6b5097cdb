"""`pdserve bench`: a load generator for any OpenAI-compatible endpoint (pdserve, vLLM, SGLang, ...).

- datasets: the workloads (random tokens, ShareGPT, the interference mix) as lists of BenchRequest
- arrivals: when requests are sent (gamma / Poisson process)
- client: one streamed request, timed, as a RequestRecord
- runner: a whole run (BenchConfig → BenchResult)
- metrics: records → the summary, with vLLM's definitions and key names
- report, cli: the printed table and the command line

Typical use from Python::

    requests = random_requests(Tokenizer(model_dir), num=100, input_len=256, output_len=64)
    result = run(BenchConfig(base_url="http://127.0.0.1:8000", model="demo", request_rate=4.0), requests)
    result.summary["p99_tpot_ms"]
"""

from services.bench.datasets import BenchRequest, interference_requests, random_requests, sharegpt_requests
from services.bench.metrics import RequestRecord, summarize
from services.bench.runner import BenchConfig, BenchResult, run, run_benchmark

__all__ = [
    "BenchConfig",
    "BenchRequest",
    "BenchResult",
    "RequestRecord",
    "interference_requests",
    "random_requests",
    "run",
    "run_benchmark",
    "sharegpt_requests",
    "summarize",
]
