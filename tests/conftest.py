"""Without CUDA the Triton kernels run under Triton's interpreter, which must be chosen before triton is
imported; nothing else in the suite imports triton, so nothing else sees the setting."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
