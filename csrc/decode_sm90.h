// C ABI of the small-problem paged decode kernel in decode_sm90.cu: plain C, no torch headers.
// torch_ops/kernels/cuda/decode_sm90.py mirrors this struct field by field (ctypes.Structure `DecodeArgs`).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum AttnDecodeDtype { ATTN_DECODE_BF16 = 0, ATTN_DECODE_FP16 = 1 };
// the cache's storage: the query's dtype, FP8 (per-tensor or per-head fp32 scales), or group-wise
// symmetric INT8 / packed INT4 (offset-8 nibbles, element 2i low) with a scale cache
enum AttnDecodeKV {
  ATTN_DECODE_KV_PLAIN = 0,
  ATTN_DECODE_KV_E4M3 = 1,
  ATTN_DECODE_KV_E5M2 = 2,
  ATTN_DECODE_KV_INT8 = 3,
  ATTN_DECODE_KV_INT4 = 4,
};

typedef struct {
  // query [batch * q_per_seq, hq, head_dim] (token, head strides in elements; dim stride 1)
  const void* q;
  // caches [num_blocks, block_size, hkv, head_dim] (block, token, head strides; dim stride 1) in
  // the query's dtype, FP8, INT8, or [..., head_dim / 2] bytes of packed INT4 (kv_format)
  const void* k_cache;
  const void* v_cache;
  const int* block_tables;  // [batch, >= max_blocks] int32 (block_table_stride)
  const int* seq_lens;      // [batch] int32: keys of each sequence
  void* out;                // [batch * q_per_seq, hq, head_dim], the query's dtype
  float* lse;               // [batch * q_per_seq, hq] fp32, natural log
  int64_t q_token_stride, q_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t block_table_stride;
  int64_t out_token_stride, out_head_stride;
  int64_t lse_token_stride, lse_head_stride;
  int32_t batch, hq, hkv, head_dim, q_per_seq, block_size;
  int32_t dtype;            // AttnDecodeDtype
  int32_t cluster_size;     // CTAs (splits of the key range) per (sequence, KV head): 1, 2, 4, 8 or 16
  float softmax_scale;      // (scale or 1/sqrt(D)) / q_scaling
  int32_t kv_format;        // AttnDecodeKV
  // FP8: fp32 dequantization scales, one value or one per KV head (scale_per_head).
  // INT8/INT4: scale caches [num_blocks, block_size, hkv, groups] (strides in elements, last 1),
  // fp32 (scale_fp32) or fp16, groups = head_dim / quant_group in 1..4, 4 to 16 bytes per row.
  const void* k_scale;
  const void* v_scale;
  int64_t ks_block_stride, ks_token_stride, ks_head_stride;
  int64_t vs_block_stride, vs_token_stride, vs_head_stride;
  int32_t scale_per_head, scale_fp32, quant_group;
  // 1: launch with programmatic dependent launch, so that the grid is scheduled while the previous
  // kernel on the stream finishes (the kernel waits for that kernel before its first global access)
  int32_t pdl;
  // CTAs per SM of the kernel build: 1, or 2 for INT8/INT4 caches at head_dim 128 and at most 8 rows
  // (128 registers, 2-stage pipelines: faster on grids of more than one wave)
  int32_t ctas_per_sm;
  // memory safety on any metadata: the cache's num_blocks and the block table's columns
  // (max_blocks); seq_lens are clamped into [0, max_blocks * block_size] and a block id outside
  // [0, num_blocks) is an absent block (its keys masked), each ORing its bit into *err (the device
  // error flag of torch_ops/errors.py; null: none)
  int32_t num_blocks, max_blocks;
  int32_t err_block_tables, err_seq_lens;
  int* err;
} AttnDecodeArgs;

// int attn_decode_sm90(const AttnDecodeArgs*, void* stream, char* err, int err_len): 0 on success,
// else nonzero with a message in err. Rows (q_per_seq x hq / hkv) at most 16; head_dim 64 or 128.
// The query is bf16 or fp16; FP8/INT8/INT4 caches are dequantized to fp16 in registers (the
// products run in fp16, the query converted after the softmax scale).
int attn_decode_sm90(const AttnDecodeArgs* args, void* stream, char* err, int err_len);
// How many clusters of args->cluster_size CTAs (for args->dtype, kv_format and head_dim) fit on the current
// device at once, or -1 on error.
int attn_decode_sm90_max_clusters(const AttnDecodeArgs* args);

#ifdef __cplusplus
}
#endif
