"""pdserve on one machine: the infrastructure servers (infra), the whole stack as child processes (stack),
and what a running deployment leaves behind (cluster_state). Tooling: library code never imports it."""
