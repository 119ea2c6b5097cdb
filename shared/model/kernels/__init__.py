"""Fast kernels for the model (Triton), one module per kernel.

Every kernel module pairs its launcher with a plain-torch reference of the same signature; the unit tests
hold the kernel to that reference (on CPU under TRITON_INTERPRET=1, tiny shapes), and the reference to the
torch path. The engine's `kernels` setting (choice.py) selects them: by default on CUDA only.
"""
