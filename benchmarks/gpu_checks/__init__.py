"""The checks of `make gpu-check` (benchmarks/gpu_check.py), one module per check.

Each check is `check(target: Target) -> CheckResult`, run by the CLI in a child process of its own under a
timeout (common.run_isolated): a hung GPU call or a crashed process fails that check, not the run.
"""
