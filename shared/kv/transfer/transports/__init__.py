"""The KV transports: each moves a pull's bytes one way, behind one interface (base.py).

registry.py lists them in order of preference; the server and the client consult that list (or one they are
handed), never a transport by name. docs/kv_transfer.md, "Transports", states the interface and how to add one.
"""
