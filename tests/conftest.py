"""Test-process setup shared by every suite."""

import os

import torch

# Without a GPU, Triton runs only through its interpreter, and triton.language's own @jit helpers
# (tl.sum, ...) are fixed in that mode when triton is first imported: set it before any test module
# imports a kernel. (tests/kernels/conftest.py manages the variable per test after collection.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The appliances under test run beside this process on a 2-core machine: torch's OpenMP threads
# spin-wait for busy cores at every op (a 30x slowdown seen here), so in-process reference models
# use one thread unless OMP_NUM_THREADS says otherwise.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
