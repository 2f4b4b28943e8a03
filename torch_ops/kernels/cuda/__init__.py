"""The backends over the CUDA C++ libraries of csrc/, one module per library: `fmha_sm90` (the
`cutlass` and `mixed` backends: CUTLASS context attention and paged prefill, csrc/fmha_sm90.cu;
its build and C ABI in `fmha_sm90_build`) and `decode_sm90` (the `cuda` backend: small-batch paged
decode, csrc/decode_sm90.cu). Both build through `torch_ops.csrc_build.CsrcLibrary`."""
