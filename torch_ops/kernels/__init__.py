"""The backends' kernels, one package per kind: `triton/` (the `triton` backend: Triton kernels for
every op) and `cuda/` (the `cutlass`, `mixed` and `cuda` backends: wrappers of the CUDA C++
libraries built from csrc/, with `torch_ops.csrc_build`)."""
