"""Unit-tier set-up: Triton kernels run under the interpreter on CPU tensors where no GPU is present.

TRITON_INTERPRET is read when a function is decorated with @triton.jit, and triton.language's own helpers
(tl.cdiv, tl.sum, ...) are decorated when triton is first imported, so the variable is set here, before any
test module can import triton. On a CUDA machine it is left alone: the kernels compile and the same tests run
on the GPU (set TRITON_INTERPRET=1 by hand to interpret there too).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
