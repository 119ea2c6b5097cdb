"""Structured output: what a request constrains its output to (spec.py) and the grammar engine that turns
that into per-token masks (grammar.py, over llguidance). Shared by the gateway (which validates and refuses
bad specs before dispatch) and the engine (which masks logits with them); imports neither."""
