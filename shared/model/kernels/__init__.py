"""Fast kernels for the model (Triton), one module per kernel.

Every kernel module pairs its launcher with a plain-torch reference of the same signature; the unit tests
hold the kernel to that reference (on CPU under TRITON_INTERPRET=1, tiny shapes), and the reference to the
path the model uses today. Nothing here is wired into the model yet: the model selects a kernel only on CUDA.
"""
