"""How a model is split over the ranks of a worker group, below the model: `layout.py` (`ParallelLayout`: the
degrees and who owns what: query heads, KV heads, experts), `group.py` (`RankGroup`: the ranks' process group
and the collectives the model calls), `placement.py` (`ExpertPlacement`: the logical expert of each slot, and
the planner), `dispatch.py` (`EPDispatch`, torch-free). The worker-group runtime that starts and drives the
ranks sits above the engine, in shared/parallel/.
"""
