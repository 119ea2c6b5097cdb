"""A service process's observability at its start and its end: logging with trace ids and tracing as OTEL_* /
--trace-file ask (`observe`), and the exit of a process that has stopped in order (`exit_now`). Every service
entry point (the gateway's, the workers' in the CLI) calls both."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from shared.telemetry import tracing


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
