"""pdserve on one machine: the infrastructure servers (infra), the whole stack as child processes (stack),
`pdserve up`'s supervision of it (supervisor: signals, restarts; restarts: the backoff policy; children: child
processes that die with their parent), and what a running deployment leaves behind (cluster_state). Tooling:
library code never imports it."""
