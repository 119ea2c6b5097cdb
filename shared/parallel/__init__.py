"""Parallelism inside one worker: a worker group of R ranks (processes), tensor- and expert-parallel.

`layout.py`: the degrees and who owns what (query heads, KV heads, experts); `group.py`: the ranks' process
group and the collectives the model uses; `launch.py`: starting the other ranks of a group
(and `run_on_ranks`, one function on every rank); `agree.py`: numbers the ranks must agree on (`agree_min`).
"""
