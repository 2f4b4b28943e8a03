// The CUDA decode kernel (decode_sm90.cu): FP8/INT8/INT4 cache bytes -> fp16 MMA operands in
// registers, times their group scales, and which head dims each thread's operands hold (QuantMap).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "decode_sm90.h"
#include "decode_sm90_layout.cuh"

namespace {

// ---- FP8/INT8/INT4 -> fp16 pairs (a uint32_t holds two fp16 values, the first in the low half)

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}
// (a & mask) | bits
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}
__device__ __forceinline__ __half2 as_h2(uint32_t x) { return *reinterpret_cast<__half2*>(&x); }
__device__ __forceinline__ uint32_t as_u32(__half2 x) { return *reinterpret_cast<uint32_t*>(&x); }

// bytes (b0, b1, b2, b3) of w -> fp16 pairs (b0, b1) and (b2, b3)
template <int F>
__device__ __forceinline__ void bytes_to_half2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (F == ATTN_DECODE_KV_INT8) {
    // 0x64XX is the fp16 1024 + XX: bias the signed bytes to XX = x + 128, then subtract 1152
    const uint32_t x = w ^ 0x80808080u;
    const __half2 bias = __float2half2_rn(1152.f);
    lo = as_u32(__hsub2(as_h2(prmt(x, 0x64646464u, 0x4140u)), bias));
    hi = as_u32(__hsub2(as_h2(prmt(x, 0x64646464u, 0x4342u)), bias));
  } else {
    constexpr __nv_fp8_interpretation_t kind = F == ATTN_DECODE_KV_E4M3 ? __NV_E4M3 : __NV_E5M2;
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), kind);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), kind);
    lo = a.x | (uint32_t(a.y) << 16);
    hi = b.x | (uint32_t(b.y) << 16);
  }
}

// 8 offset-8 nibbles (e0 .. e7, e0 lowest) -> fp16 pairs (e0, e4), (e1, e5), (e2, e6), (e3, e7)
__device__ __forceinline__ void nibbles_to_half2(uint32_t w, uint32_t (&r)[4]) {
  const __half2 bias = __float2half2_rn(1032.f), sixteenth = __float2half2_rn(0.0625f), bias16 = __float2half2_rn(-72.f);
  const uint32_t w8 = w >> 8;
  r[0] = as_u32(__hsub2(as_h2(and_or(w, 0x000f000fu, 0x64006400u)), bias));          // 1024 + n
  r[1] = as_u32(__hfma2(as_h2(and_or(w, 0x00f000f0u, 0x64006400u)), sixteenth, bias16));  // 1024 + 16 n
  r[2] = as_u32(__hsub2(as_h2(and_or(w8, 0x000f000fu, 0x64006400u)), bias));
  r[3] = as_u32(__hfma2(as_h2(and_or(w8, 0x00f000f0u, 0x64006400u)), sixteenth, bias16));
}

// Group scales of the two values of a pair. The product is rounded to fp16 once, as the
// reference dequantizes: a packed fp16 multiply for fp16 scale caches, fp32 for fp32 ones.
template <bool kFp32>
struct PairScale {
  float lo, hi;
  __device__ __forceinline__ uint32_t apply(uint32_t x) const {
    if constexpr (kFp32) {
      const float2 v = __half22float2(as_h2(x));
      return as_u32(__floats2half2_rn(v.x * lo, v.y * hi));
    }
    return as_u32(__hmul2(as_h2(x), __floats2half2_rn(lo, hi)));
  }
};

// one group scale of a scale tile row
__device__ __forceinline__ float load_scale(const unsigned char* row, int group, bool fp32) {
  return fp32 ? reinterpret_cast<const float*>(row)[group] : __half2float(reinterpret_cast<const __half*>(row)[group]);
}

template <int N>
__device__ __forceinline__ void load_words(const unsigned char* p, uint32_t (&w)[N]) {
  static_assert(N == 1 || N == 2 || N % 4 == 0, "1, 2 or 4k words");
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// The quantized formats' operand maps. A thread (lane = 4 g + t4) owns, of each key row of a K
// tile, the D/4 elements from t4 * D/4; of each V row, the D/8 elements from g * D/8.
template <int D, int F>
struct QuantMap {
  static constexpr bool kInt4 = F == ATTN_DECODE_KV_INT4;
  static constexpr int kKWords = D * Storage<F>::kBits / 8 / 4 / 4;  // 32-bit words of a K row slice
  static constexpr int kVWords = kKWords / 2;                          // of a V row slice
  // head dim of k-slot (kk, r, e) of Q K^T (B operand register r, half e) for lane t4
  static __device__ __forceinline__ int k_dim(int t4, int kk, int r, int e) {
    return t4 * (D / 4) + (kInt4 ? 8 * (kk / 2) + 2 * (kk % 2) + r + 4 * e : 4 * kk + 2 * r + e);
  }
  // head dim of row r (0-15) of the O^T = V^T P^T m-tile mt: rows g and g + 8 are the dims 2 mt
  // and 2 mt + 1 of lane group g's slice
  static __device__ __forceinline__ int v_dim(int r, int mt) { return (r & 7) * (D / 8) + 2 * mt + (r >> 3); }
};

// K operands of key row `row` of a quantized K tile: kb[kk] = the row's two registers of k-step kk
template <int D, int F, bool S>
__device__ __forceinline__ void quant_k_operands(const unsigned char* row, int t4, const PairScale<S>& s, uint32_t (&kb)[D / 16][2]) {
  using Map = QuantMap<D, F>;
  uint32_t w[Map::kKWords];
  load_words(row + t4 * Map::kKWords * 4, w);
#pragma unroll
  for (int j = 0; j < Map::kKWords; ++j) {
    if constexpr (Map::kInt4) {
      uint32_t r[4];
      nibbles_to_half2(w[j], r);
      kb[2 * j][0] = r[0], kb[2 * j][1] = r[1], kb[2 * j + 1][0] = r[2], kb[2 * j + 1][1] = r[3];
    } else {
      bytes_to_half2<F>(w[j], kb[j][0], kb[j][1]);
    }
  }
  if constexpr (Storage<F>::kGrouped) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) kb[kk][0] = s.apply(kb[kk][0]), kb[kk][1] = s.apply(kb[kk][1]);
  }
}

// V^T operands of word u of the V row slices of keys (k0, k1): vb[i] = the pair (k0, k1) of dim
// u * (4 or 8) + i of the thread's slice
template <int F, bool S>
__device__ __forceinline__ void quant_v_operands(uint32_t w0, uint32_t w1, const PairScale<S>& s,
                                                 uint32_t (&vb)[F == ATTN_DECODE_KV_INT4 ? 8 : 4]) {
  if constexpr (F == ATTN_DECODE_KV_INT4) {
    uint32_t r[4];
    nibbles_to_half2(prmt(w0, w1, 0x5410u), r);   // bytes (k0.0, k0.1, k1.0, k1.1): nibbles 0-3 of both keys
    vb[0] = r[0], vb[1] = r[1], vb[2] = r[2], vb[3] = r[3];
    nibbles_to_half2(prmt(w0, w1, 0x7632u), r);   // nibbles 4-7
    vb[4] = r[0], vb[5] = r[1], vb[6] = r[2], vb[7] = r[3];
  } else {
    bytes_to_half2<F>(prmt(w0, w1, 0x5140u), vb[0], vb[1]);  // bytes (k0.0, k1.0, k0.1, k1.1)
    bytes_to_half2<F>(prmt(w0, w1, 0x7362u), vb[2], vb[3]);
  }
  if constexpr (Storage<F>::kGrouped) {
#pragma unroll
    for (int i = 0; i < (F == ATTN_DECODE_KV_INT4 ? 8 : 4); ++i) vb[i] = s.apply(vb[i]);
  }
}

}  // namespace
