"""The SLO planner (`pdserve planner`, `pdserve up --planner`): reads the live signals (workers' heartbeats, the
gateways' request statistics), forecasts the next interval's load and lengths, and at a bounded rate, with
hysteresis, switches roles among the running workers and publishes the worker counts per role it wants for an
autoscaler. docs/planning.md describes the model and the policy.

Modules: forecast.py (rate and lengths of the next interval), capacity.py (what a split of workers would serve, from
what the workers measured), policy.py (the decision, pure: the unit tests replay recorded signals through it),
service.py (the process: NATS in, role switches and the JSON/Prometheus endpoint out)."""
