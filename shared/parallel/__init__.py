"""The worker-group runtime: a worker of R ranks (processes), above the engine and the KV plane.

`group_engine.py` (start a group: the leader's engine, the followers), `launch.py` (starting the other ranks;
`run_on_ranks`, one function on every rank), `ops.py` (the op stream followers mirror), `watch.py`. The ranks'
link (channels, named handlers) is shared/ranklink/, below the KV plane; how the model is split over the ranks
(layout, collectives, expert placement) is the floor below the model, shared/sharding/.
"""
