"""Triton kernels of the appliance, installed as the package `tokenspeed_kernels`.

Each module holds one kernel family, its launcher and a plain-torch reference (`*_reference`) that
the tests compare it with (tests/kernels, under TRITON_INTERPRET=1 on the CPU). Launchers take
tensors on any device Triton can run on; the worker calls them on CUDA only and keeps its torch code
as the CPU path.
"""
