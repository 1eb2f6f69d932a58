"""Test-process setup shared by every suite."""

import os
from pathlib import Path

import pytest
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

TESTS = Path(__file__).resolve().parent
# Markers by folder, so a new test there is marked too: tests/gpu needs CUDA, tests/integration starts
# whole appliances (seconds each). `make test-fast` runs -m "not slow and not gpu"; `make test` runs all.
FOLDER_MARKS = {"gpu": "gpu", "integration": "slow"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.resolve().relative_to(TESTS).parts
        if len(parts) > 1 and parts[0] in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[parts[0]])
