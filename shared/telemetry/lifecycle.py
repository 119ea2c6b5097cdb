"""A service process's observability at its start and its end: logging with trace ids and tracing as OTEL_* /
--trace-file ask (`observe`), and the exit of a process that has stopped in order (`exit_now`). Every service
entry point (the gateway's, the workers' in the CLI) calls both."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

from shared.telemetry import tracing

# Past a service's drain time: its last flush, the close of its connections and its exit. The supervisor
# SIGKILLs a service still running this long after its drain time (services/local/supervisor.py); a service
# also ends itself then (`exit_by`), for when no supervisor is left to do it.
EXIT_GRACE_S = 5.0

# The exit status of a service that refuses its configuration (a flag or PDSERVE_* value that does not parse, a
# checkpoint missing or unreadable, a port it cannot bind): starting it again would fail the same way, so a
# supervisor does not restart it (services/local/supervisor.py) and says why instead. argparse exits with it too.
# Any other failure exits 1 (or dies by a signal): a crash, which a supervisor restarts.
EXIT_REFUSED = 2

_exit_deadline: threading.Timer | None = None


def observe(service: str, instance: str, level: str, trace_file: str | None) -> None:
    """Logging with trace ids, and tracing (nothing exported unless asked)."""
    tracing.install_log_trace_ids()
    logging.basicConfig(level=level, format=f"%(asctime)s {service} %(levelname)s %(name)s%(trace)s: %(message)s")
    tracing.setup_tracing(f"pdserve-{service}", instance, trace_file)


def exit_now(code: int) -> NoReturn:
    """A service process that has stopped in order (drained, its connections closed) ends here, without the
    interpreter's teardown: unloading torch and the model is 1.4 s of an idle 2-core host and 4 s of a loaded
    one (measured: the worker's log says "stopped" 0.01 s after SIGTERM, the process exits seconds later), time
    in which a supervisor waits and a port stays held. What that teardown would still do is done first: the
    buffered spans are exported and the logs flushed."""
    tracing.shutdown_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_by(seconds: float) -> None:
    """A service that has begun to stop ends itself if it is still running `seconds` from now (exit code 1;
    armed once, later calls keep the first deadline). The supervisor gives the same bound with SIGKILL; this one
    holds where it cannot: an orphan whose launcher was killed gets SIGTERM from the kernel (parent-death
    signal, services/local/children.py), and with its NATS and Redis gone too, closing them or a slow exit on a
    loaded host must not keep it, and the ports it holds, alive for long."""
    global _exit_deadline
    if _exit_deadline is not None:
        return

    def overdue() -> None:
        print(f"still running {seconds:g} s after the stop began: exiting now", file=sys.stderr, flush=True)
        os._exit(1)

    _exit_deadline = threading.Timer(seconds, overdue)
    _exit_deadline.daemon = True
    _exit_deadline.start()
