"""Parallelism inside one worker: a worker group of R ranks (processes), tensor- and expert-parallel.

`layout.py`: the degrees and who owns what (query heads, KV heads, experts); `group.py`: the ranks' process
group and the collectives the model uses; `launch.py`: starting the other ranks of a group
(and `run_on_ranks`, one function on every rank); the worker-group runtime: `group_engine.py` (start a
group: the leader's engine, the followers), `ops.py` (the op stream followers mirror), `agents.py` (named
handlers on every rank), `channel.py`, `watch.py`; expert placement: `placement.py`, `dispatch.py`.
"""
