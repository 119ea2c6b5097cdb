"""The library every pdserve service imports (model, engine, KV plane, bus, settings)."""

import os

# gRPC's fork support restarts its poller threads in a forked child. A child that closes its inherited descriptors
# before exec (subprocess with a preexec_fn, as services/local/children.py starts every service) can then abort on
# the poller's closed epoll fd before it execs (grpc/grpc#43055, grpcio 1.80 on: a stack's worker "exited with code
# -6", its log one line of "epoll_wait error: Bad file descriptor"). pdserve never uses gRPC in a forked child that
# does not exec (its multiprocessing is "spawn"), so the support is off unless the environment sets it. Read when
# gRPC initialises, which no pdserve module does before importing this package; children inherit it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
