"""The link between the ranks of a worker group, below the KV plane and the group runtime that both use it:
`channel.py` (the leader↔follower local channels) and `agents.py` (named async handlers on every rank, called
by the leader; `StagedKv`, KV a rank staged for the leader's next op). Starting a group and its op stream are
shared/parallel/'s."""
