"""Fast kernels for the model (Triton), one module per kernel, each held by tests to a plain-torch reference."""
