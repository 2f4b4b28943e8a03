// C ABI of the Hopper (sm90a) varlen FMHA kernels in fmha_sm90.cu: plain C, no torch headers,
// so the heavy translation units build without PyTorch and Python calls them through ctypes.
// torch_ops/kernels/cuda/fmha_sm90.py mirrors this struct field by field (ctypes.Structure `FmhaArgs`).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum AttnOutDtype { ATTN_OUT_BF16 = 0, ATTN_OUT_FP16 = 1, ATTN_OUT_E4M3 = 2 };
// How a kernel reads V (AttnFmhaArgs.v_layout, checked): token-major [total_k, hkv, head_dim]
// (bf16/fp16, and FP8 at head dim 128 in the persistent grid, which transposes tiles in shared
// memory), or transposed, vt [hkv, head_dim, >= total_k] (FP8 otherwise: the FP8 wgmma wants the
// PV reduction dim contiguous), at head dim 128 with the tokens of every aligned 16 interleaved and
// ceil(total_k / 16) * 16 of them, the padding zero (torch_ops/kernels/triton/transpose.py).
enum AttnValueLayout { ATTN_V_TOKENS = 0, ATTN_V_TRANSPOSED = 1, ATTN_V_TRANSPOSED_INTERLEAVED = 2 };

typedef struct {
  // query [total_q, hq, head_dim], key [total_k, hkv, head_dim] (row/head strides in elements).
  const void* q;
  const void* k;
  // value as v_layout says: [total_k, hkv, head_dim] (v_row_stride, v_head_stride) or vt [hkv,
  // head_dim, >= total_k] (v_head_stride, v_dim_stride; tokens contiguous)
  const void* v;
  void* out;        // [total_q, hq, head_dim] in out_dtype (out_row_stride, out_head_stride)
  float* lse;       // [total_q, hq] fp32, natural log (lse_row_stride; heads contiguous)
  const int* cu_seqlens_q;  // [num_seqs + 1]
  const int* cu_seqlens_k;  // [num_seqs + 1]
  // fp32 descales (FP8 inputs; NULL for bf16/fp16), per tensor (stride 0) or per head (stride 1)
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  const float* out_scale;   // FP8 output: out = clamp(o / out_scale, +-448); else NULL
  int64_t q_row_stride, q_head_stride;
  int64_t k_row_stride, k_head_stride;
  int64_t v_row_stride, v_head_stride, v_dim_stride;
  int64_t out_row_stride, out_head_stride;
  int64_t lse_row_stride;
  int32_t total_q, total_k, num_seqs, hq, hkv, head_dim;
  int32_t causal;           // bottom-right aligned
  int32_t q_scale_stride, k_scale_stride, v_scale_stride;
  int32_t out_dtype;        // AttnOutDtype
  float softmax_scale;      // (scale or 1/sqrt(D)) / q_scaling, before the q/k descales
  // persistent kernels only: CTAs in the grid; all kernels: heads per section of the work order
  // (divides hq; the work runs section by section, each q tile over a section's heads together)
  int32_t num_ctas, section_heads;
  int32_t v_layout;         // AttnValueLayout
  // paged kernels only (bf16/fp16): k and v are caches [num_blocks, block_size, hkv, head_dim]
  // with the k_/v_ row (token), head and block strides; cu_seqlens_k is unused, seq_lens [num_seqs]
  // gives each sequence's keys, block_tables [num_seqs, max_blocks] int32 (block_table_stride)
  // its blocks. K/V are read in TMA boxes of box_rows tokens: a power of two in 8 .. the key tile
  // (128) that divides block_size, and 8 at head dims over 64 unless both caches' blocks start the
  // same multiple of 8 tokens apart (block stride = 8 n x row stride). Base and strides 16-byte aligned.
  const int* block_tables;
  const int* seq_lens;
  int64_t block_table_stride, k_block_stride, v_block_stride;
  int32_t max_blocks, block_size, num_blocks, box_rows;
  // sequences of at most skip_q_len queries are left to another launch (their rows untouched); 0: none
  int32_t skip_q_len;
  // paged kernels: the device error flag (NULL: none), into which a length outside [0, max_blocks x
  // block_size] ORs err_seq_lens and a block id outside [0, num_blocks) err_block_tables
  int* err_flag;
  int32_t err_block_tables, err_seq_lens;
} AttnFmhaArgs;

// Each instantiation (input dtype x head dim x grid) exports one entry point:
//   int attn_fmha_sm90_<e4m3|bf16|fp16>_d<D>[_persistent|_paged](const AttnFmhaArgs*, void* stream, char* err, int err_len)
// returning 0 on success, else nonzero with a message in err. The plain and _paged kernels launch
// one CTA per 128 query rows per head; the _persistent ones num_ctas CTAs that loop over those
// work tiles.

#ifdef __cplusplus
}
#endif
