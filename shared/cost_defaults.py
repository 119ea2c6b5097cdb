"""The documented defaults of the workers' cost coefficients (`Heartbeat.path_calibration`,
shared/worker/calibration.py): what the gateway's prefill path (services/gateway/path_signals.py) and the SLO
planner (services/planner/capacity.py) assume until a worker has measured its own.

Measured on the project's 2-core AMD EPYC host with the `small` demo model (Qwen3-MoE, 106M parameters, float32,
8 KiB of KV per token); docs/benchmarks.md and its journal:

    prefill 1236 tokens/s     engine_bench, 512-token prompts, batch 1, 2 threads (journal, "Result: packed and
                              plain side by side", 2026-12-01)
    prefill step 8 ms         a step's cost before its prompt tokens: taken as a one-sequence decode step (below)
    decode step 8 ms          engine_bench, decode at 1 sequence: 7.6-9.1 ms ("Issue 36 architecture pass")
    decode +6.5% a sequence   step_profile, 12.1 ms at 1 sequence, 36.5 ms at 32 (Intel Xeon, issue 41): what each
                              sequence more in a batch adds to its step, as a share of the one-sequence step
    pull 2 ms + 0.6 ms/MB     "the fixed cost of a pull is 1-4 ms on every transport"; 4096 tokens (33.55 MB) over
                              the same-host segment in 22.0 ms ("Break-even: KV transfer against prefill")
    8192 KV bytes per token   the small model's; every worker reports its own (a fact of its model, not a measure)
"""

DEFAULT_PREFILL_TOKENS_PER_S = 1236.0
DEFAULT_PREFILL_STEP_MS = 8.0
DEFAULT_DECODE_STEP_MS = 8.0
DEFAULT_DECODE_STEP_GROWTH = 0.065
DEFAULT_KV_TRANSFER_MS_PER_MB = 0.6
DEFAULT_KV_PULL_OVERHEAD_MS = 2.0
DEFAULT_KV_BYTES_PER_TOKEN = 8192
