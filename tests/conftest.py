"""Test-process setup shared by every suite."""

import os

import torch

# The appliances under test run beside this process on a 2-core machine: torch's OpenMP threads
# spin-wait for busy cores at every op (a 30x slowdown seen here), so in-process reference models
# use one thread unless OMP_NUM_THREADS says otherwise.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
