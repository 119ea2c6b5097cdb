"""Deployment planning: how many prefill, decode (or mixed) workers of which configuration a workload needs under
TTFT/TPOT SLOs (docs/planning.md).

- profile_file.py  the profile's schema: worker configurations and what was measured for each (no torch)
- profile.py       `pdserve profile`: measures a profile on this host (torch, the engine)
- costs.py         a configuration's step costs from its measurements (no torch)
- workload.py      the requests a plan is for: lengths and arrivals, from flags or a recorded run (no torch)
- simulate.py      the discrete-event simulation of a deployment serving those requests (no torch)
- model.py         the performance model's API: predict one deployment, plan (rank) many (no torch)
- cli.py           `pdserve profile` and `pdserve plan`
"""
