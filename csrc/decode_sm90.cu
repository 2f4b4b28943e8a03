// Paged decode for small problems on Hopper (sm_90a), in one launch.
//
// Why CUDA C++ here: at small batch the Triton kernel's time is latency, not bytes (two launches,
// split-K partials through global memory, a long per-tile instruction chain). This kernel splits
// the keys of one (sequence, KV head) over the CTAs of a thread-block cluster and, inside a CTA,
// over its warps; the partial softmax states meet in shared memory, then across the cluster in
// distributed shared memory. No workspace, no second kernel, and the grid comes from shapes only
// (CUDA-graph safe).
//
// - A CTA: 8 warps, the query rows of one KV head (row m = token m / G of the sequence, query
//   head m % G of the group; up to 16, padded to 8 or 16), each warp streaming its own 16-key
//   tiles of K and V through a private cp.async pipeline (no CTA barrier in the loop). About
//   150 KB of shared memory at D = 128: one CTA per SM, two warps per scheduler (INT8/INT4 on
//   multi-wave grids: a build for two CTAs per SM, Layout's C).
// - Per tile and warp, the products run with the keys and head dims as the MMA's 16-row side and
//   the queries as its 8-column side (mma.m16n8k16; NQ = 1 or 2 column tiles), so that a GQA
//   group of up to 8 rows wastes no half tile: S^T = K Q^T (K by ldmatrix as the A operand, Q^T
//   in registers), online softmax in fp32 with exp2 (a query's keys lie across the 8 lane
//   groups: three shuffles per max), P^T turned into the B operand of O^T = V^T P^T by one
//   movmatrix per 8 x 8 block, V^T by ldmatrix.trans.
// - Shared-memory rows are padded by 16 bytes, so ldmatrix and the cp.async stores are free of
//   bank conflicts.
// - Merge: each warp's (m, l, O) to shared memory, combined per CTA; with a cluster, every CTA
//   combines a slice of the rows x dims from all CTAs' shared memory and writes out and lse.
// - FP8/INT8/INT4 caches (4-stage pipelines, group scales copied beside each tile): each thread
//   reads its own bytes of a key row with one or two 16-byte loads and turns them into fp16 MMA
//   operands in registers (FP8: cvt; INT8/INT4: the 0x6400 exponent trick, then the group scale).
//   The dot product does not care in which order the head dims are summed, so each thread's
//   bytes feed the k-slots of its K fragment in storage order and the query is loaded in the
//   same order; for P V each thread owns D/8 consecutive dims, two per 16-row tile of V^T, and
//   the output is written back by that map. The query is rounded to fp16 after an exact
//   power-of-two scaling that keeps each row's max |q| <= 2^15; the softmax scale (and FP8's
//   k_scale) stay on the logits in fp32, FP8's v_scale on the output.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdio.h>

#include <type_traits>

#include "decode_sm90.h"
#include "decode_sm90_layout.cuh"   // tuning knobs, cache formats, shared-memory layout
#include "decode_sm90_ptx.cuh"      // the MMA and PTX wrappers
#include "decode_sm90_dequant.cuh"  // FP8/INT8/INT4 bytes -> fp16 operands

namespace cg = cooperative_groups;

namespace {

// kScaleF32: INT8/INT4 with fp32 scale caches; NQ: 8-row tiles of query rows (rows <= 8 NQ); C: Layout
template <typename T, int D, int F, bool kScaleF32, int NQ, int C>
__global__ void __launch_bounds__(kThreads, C) decode_kernel(const AttnDecodeArgs a) {
  using Lay = Layout<D, F, C>;
  using KV = Storage<F>;
  using Map = QuantMap<D, F>;
  using M = std::conditional_t<KV::kPlain, T, __half>;  // the MMA operand type
  extern __shared__ __align__(128) unsigned char smem[];
  // Programmatic dependent launch (AttnDecodeArgs::pdl; both are no-ops without it): wait until the
  // previous kernel on the stream has completed and its writes are visible, before any global
  // access; then let the next such kernel be scheduled (it waits for this grid in turn).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int rank = blockIdx.x;  // grid.x is the cluster size: the CTA's rank in its cluster
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = a.hq / a.hkv;
  const int rows = group * a.q_per_seq;
  const int stored_len = a.seq_lens[b];
  const int L = min(max(stored_len, 0), a.max_blocks * a.block_size);
  if (L != stored_len && a.err != nullptr && threadIdx.x == 0 && blockIdx.x == 0 && kvh == 0)
    atomicOr(a.err, a.err_seq_lens);
  const int bs = a.block_size;
  const float scale_log2 = a.softmax_scale * 1.4426950408889634f;
  // logits s = q.k * smult[row]: plain caches multiply by the softmax scale; quantized ones by
  // k_scale (FP8) and by the power of two that brought the row's query into fp16 range
  float kv_mult = 1.f, out_mult = 1.f;
  if constexpr (KV::kFp8) {
    const int h = a.scale_per_head ? kvh : 0;
    kv_mult = static_cast<const float*>(a.k_scale)[h];
    out_mult = static_cast<const float*>(a.v_scale)[h];
  }

  // this warp's keys [start, end), cut in 16-key tiles
  const int units = a.cluster_size * kWarps;
  const int per = ((L + units - 1) / units + kKeys - 1) / kKeys * kKeys;
  const int start = (rank * kWarps + warp) * per;
  const int end = min(start + per, L);
  const int n_tiles = end > start ? (end - start + kKeys - 1) / kKeys : 0;

  // Q^T fragments (B operand of S^T = K Q^T): qb[n][kk] = query row g + 8 n, k-step kk
  const T* q = static_cast<const T*>(a.q);
  uint32_t qb[NQ][D / 16][2];
  float row_mult[NQ];   // the logit multiplier of row g + 8 n
#pragma unroll
  for (int n = 0; n < NQ; ++n) {
    const int m = g + 8 * n;
    const bool real = m < rows;
    const int mm = real ? m : 0;
    const T* row = q + (int64_t)(b * a.q_per_seq + mm / group) * a.q_token_stride +
                   (int64_t)(kvh * group + mm % group) * a.q_head_stride;
    if constexpr (KV::kPlain) {
      row_mult[n] = scale_log2;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          qb[n][kk][r] = real ? *reinterpret_cast<const uint32_t*>(row + kk * 16 + 8 * r + 2 * t4) : 0u;
    } else {
      // the thread's D/4 dims from t4 * D/4 in 16-byte loads, scaled by a power of two so that the
      // row's max |q| <= 2^15 (exact), then rounded to fp16 in the K slices' order (QuantMap)
      float x[D / 4];
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        const uint4 v = real ? reinterpret_cast<const uint4*>(row + t4 * (D / 4))[i] : make_uint4(0, 0, 0, 0);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = Elem<T>::unpack(w[j]);
          x[8 * i + 2 * j] = f.x, x[8 * i + 2 * j + 1] = f.y;
        }
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < D / 4; ++i) amax = fmaxf(amax, fabsf(x[i]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      int e;
      frexpf(amax, &e);
      const int shift = max(0, e - 15);
      const float down = ldexpf(1.f, -shift);
      row_mult[n] = scale_log2 * kv_mult * ldexpf(1.f, shift);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          qb[n][kk][r] = Elem<__half>::pack(x[Map::k_dim(0, kk, r, 0)] * down, x[Map::k_dim(0, kk, r, 1)] * down);
    }
  }
  // The softmax of this thread's columns: query rows 2 t4 + e + 8 n. Their multipliers (from the
  // lanes that loaded them) and key limits (causal among the new tokens).
  float smult[NQ][2];
  int limit[NQ][2];
#pragma unroll
  for (int n = 0; n < NQ; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 2 * t4 + e + 8 * n;
      smult[n][e] = __shfl_sync(0xffffffffu, row_mult[n], 4 * (2 * t4 + e));
      limit[n][e] = min(end, L - a.q_per_seq + (m < rows ? m : 0) / group + 1);
    }

  // the K/V pipeline of this warp
  unsigned char* wbuf = smem + warp * Lay::kWarpBytes;
  const uint32_t wsmem = smem_addr(wbuf);
  constexpr int kElemBytes = KV::kPlain ? 2 : 1;  // of the cache tensors' elements (INT4: a byte of two)
  constexpr int kChunks = (Lay::kRowBytes - 16) / 16;   // 16-byte chunks per row
  constexpr int kPerLane = kKeys * kChunks / 32;
  constexpr int kRowStep = 32 / kChunks;         // rows per pass of the warp
  static_assert(32 % kChunks == 0 && kPerLane >= 1, "a row is 1, 2, 4, 8, 16 or 32 chunks");
  // the lane copies 16-byte chunk c of rows r0, r0 + kRowStep, ... of each K and V tile: the
  // tile-independent part of its addresses
  const int r0 = lane / kChunks, c = lane % kChunks;
  const unsigned char* kbase = opaque(static_cast<const unsigned char*>(a.k_cache) +
                                      (kvh * a.k_head_stride + r0 * a.k_token_stride) * kElemBytes + c * 16);
  const unsigned char* vbase = opaque(static_cast<const unsigned char*>(a.v_cache) +
                                      (kvh * a.v_head_stride + r0 * a.v_token_stride) * kElemBytes + c * 16);
  const int64_t k_step = opaque(kRowStep * a.k_token_stride * kElemBytes);
  const int64_t v_step = opaque(kRowStep * a.v_token_stride * kElemBytes);
  const uint32_t so = r0 * Lay::kRowBytes + c * 16;
  const int* table = a.block_tables + b * a.block_table_stride;
  // group scales: lane l < 16 copies the K scales of key l, lane 16 + l the V scales
  const int scale_bytes = KV::kGrouped ? (a.head_dim / a.quant_group) * (kScaleF32 ? 4 : 2) : 0;
  constexpr int scale_elem = kScaleF32 ? 4 : 2;
  const unsigned char* sbase = nullptr;   // this lane's key row of the tile's first key
  if constexpr (KV::kGrouped) {
    const bool v = lane >= 16;
    sbase = opaque(static_cast<const unsigned char*>(v ? a.v_scale : a.k_scale) +
                   (kvh * (v ? a.vs_head_stride : a.ks_head_stride) +
                    (lane & 15) * (v ? a.vs_token_stride : a.ks_token_stride)) * scale_elem);
  }
  // Tiles lie in one page (block_size % 16 == 0). Lane j holds, for tile 32 i + j, the byte offsets
  // of its first key in K and V (and in the K and V scale caches), computed once per 32 tiles:
  // a tile's copies then take a few shuffles and no address arithmetic.
  // Tiles whose page is outside the cache (bit j: tile 32 i + j), for the groups of 32 tiles of
  // even and odd i: their keys are not read and are masked.
  int64_t lane_k = 0, lane_v = 0, lane_ks = 0, lane_vs = 0;
  unsigned absent_even = 0u, absent_odd = 0u;
  auto fetch_pages = [&](int first) {
    const int tile = first + lane;
    bool absent = false;
    if (tile < n_tiles) {
      const int tok = start + tile * kKeys;
      const int stored = table[tok / bs], off = tok % bs;
      absent = stored < 0 || stored >= a.num_blocks;
      const int page = absent ? 0 : stored;
      lane_k = (page * a.k_block_stride + off * a.k_token_stride) * kElemBytes;
      lane_v = (page * a.v_block_stride + off * a.v_token_stride) * kElemBytes;
      if constexpr (KV::kGrouped) {
        lane_ks = (page * a.ks_block_stride + off * a.ks_token_stride) * scale_elem;
        lane_vs = (page * a.vs_block_stride + off * a.vs_token_stride) * scale_elem;
      }
    }
    const unsigned absent_tiles = __ballot_sync(0xffffffffu, absent);
    ((first >> 5) & 1 ? absent_odd : absent_even) = absent_tiles;
    if (absent_tiles && lane == 0 && a.err != nullptr) atomicOr(a.err, a.err_block_tables);
  };
  auto present = [&](int tile) {
    return !((((tile >> 5) & 1 ? absent_odd : absent_even) >> (tile & 31)) & 1u);
  };
  auto issue = [&](int tile) {
    if ((tile & 31) == 0) fetch_pages(tile);
    const int src = tile & 31;
    const unsigned char* kp = kbase + __shfl_sync(0xffffffffu, lane_k, src);
    const unsigned char* vp = vbase + __shfl_sync(0xffffffffu, lane_v, src);
    const int t0 = start + tile * kKeys;
    const int t_end = present(tile) ? end : t0;   // an absent tile: nothing copied
    const uint32_t sk = wsmem + (tile % Lay::kStages) * Lay::kStageBytes + so;
    const uint32_t sv = sk + Lay::kTileBytes;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const bool ok = t0 + r0 + i * kRowStep < t_end;
      cp_async16(sk + i * kRowStep * Lay::kRowBytes, kp + i * k_step, ok);
      cp_async16(sv + i * kRowStep * Lay::kRowBytes, vp + i * v_step, ok);
    }
    if constexpr (KV::kGrouped) {
      const int64_t ks = __shfl_sync(0xffffffffu, lane_ks, src), vs = __shfl_sync(0xffffffffu, lane_vs, src);
      const int key = lane & 15;
      const uint32_t dst = wsmem + (tile % Lay::kStages) * Lay::kStageBytes + 2 * Lay::kTileBytes +
                           (lane >> 4) * Lay::kScaleBytes + key * Lay::kScaleRow;
      cp_async_small(dst, sbase + (lane < 16 ? ks : vs), scale_bytes, t0 + key < t_end);
    }
  };

  // O^T accumulators: o[n][mt] = dims (rows) g, g + 8 of m-tile mt x query columns 2 t4, 2 t4 + 1
  // of n-tile n (plain caches: dims 16 mt + g (+ 8); quantized: QuantMap::v_dim)
  float o[NQ][D / 16][4];
#pragma unroll
  for (int n = 0; n < NQ; ++n)
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) o[n][mt][0] = o[n][mt][1] = o[n][mt][2] = o[n][mt][3] = 0.f;
  float m_run[NQ][2], l_run[NQ][2];  // l_run: this thread's keys only, summed over the lanes at the end
#pragma unroll
  for (int n = 0; n < NQ; ++n) m_run[n][0] = m_run[n][1] = -CUDART_INF_F, l_run[n][0] = l_run[n][1] = 0.f;

  // ldmatrix lane addresses (plain caches): K (x4: keys 0-7 / 8-15 x the two 8-dim halves of a
  // k-step, the A operand), V (x4.trans: the two 8-dim blocks x keys 0-7 / 8-15, the A operand of V^T)
  const int k_row = (lane & 7) + (((lane >> 3) & 1) << 3), k_chunk = lane >> 4;
  const int v_row = (lane & 7) + ((lane >> 4) << 3), v_chunk = (lane >> 3) & 1;
  // the group of the thread's K and V slices (one each: quant_group >= D / 4)
  const int k_group = KV::kGrouped ? t4 * (D / 4) / a.quant_group : 0;
  const int v_group = KV::kGrouped ? g * (D / 8) / a.quant_group : 0;

  // kSteps tiles per softmax step (Layout::kTilesPerStep): their dequantization and MMAs are
  // independent work for the warp, and they share one max / rescale. A last odd tile takes a
  // step of its own.
  constexpr int kSteps = Lay::kTilesPerStep;
  static_assert(Lay::kStages >= 2 * kSteps, "the tiles of a step and of the next one in flight");
#pragma unroll
  for (int i = 0; i < Lay::kStages - kSteps; ++i) {
    if (i < n_tiles) issue(i);
    cp_async_commit();
  }
  auto step = [&](int it, auto tiles) {
    constexpr int kN = decltype(tiles)::value;
    // S^T of each tile: s[tt][n] = keys g (0, 1), g + 8 (2, 3) x query columns 2 t4, 2 t4 + 1 of n-tile n
    float s[kN][NQ][4];
#pragma unroll
    for (int tt = 0; tt < kN; ++tt) {
      const int stage = (it + tt) % Lay::kStages;
      float odd[NQ][4];  // two accumulator chains (even and odd k-steps): half the MMA latency
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[tt][n][i] = odd[n][i] = 0.f;
      auto product = [&](int kk, const uint32_t (&kf)[4]) {
#pragma unroll
        for (int n = 0; n < NQ; ++n) Elem<M>::mma(kk % 2 ? odd[n] : s[tt][n], kf, qb[n][kk][0], qb[n][kk][1]);
      };
      if constexpr (KV::kPlain) {
        const uint32_t ka = wsmem + stage * Lay::kStageBytes + k_row * Lay::kRowBytes + k_chunk * 16;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t kf[4];
          ldmatrix_x4(ka + kk * 32, kf);
          product(kk, kf);
        }
      } else {
        const unsigned char* tile_k = wbuf + stage * Lay::kStageBytes;
        [[maybe_unused]] const unsigned char* scales_k = tile_k + 2 * Lay::kTileBytes;
        uint32_t kb[2][D / 16][2];   // key rows g and g + 8
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = g + 8 * j;
          PairScale<kScaleF32> sc{1.f, 1.f};
          if constexpr (KV::kGrouped) sc.lo = sc.hi = load_scale(scales_k + key * Lay::kScaleRow, k_group, kScaleF32);
          quant_k_operands<D, F, kScaleF32>(tile_k + key * Lay::kRowBytes, t4, sc, kb[j]);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t kf[4] = {kb[0][kk][0], kb[1][kk][0], kb[0][kk][1], kb[1][kk][1]};
          product(kk, kf);
        }
      }
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[tt][n][i] += odd[n][i];
    }

    // mask, scale, online softmax of each query column (its keys lie across the lane groups g)
    float alpha[NQ][2];
#pragma unroll
    for (int n = 0; n < NQ; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = -CUDART_INF_F;
#pragma unroll
        for (int tt = 0; tt < kN; ++tt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int key = start + (it + tt) * kKeys + g + 8 * j;
            float& x = s[tt][n][2 * j + e];
            x = key < limit[n][e] && present(it + tt) ? x * smult[n][e] : -CUDART_INF_F;
            mx = fmaxf(mx, x);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[n][e], mx);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
        alpha[n][e] = exp2_approx(m_run[n][e] - m_use);
        m_run[n][e] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int tt = 0; tt < kN; ++tt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& x = s[tt][n][2 * j + e];
            x = exp2_approx(x - m_use);
            sum += x;
          }
        l_run[n][e] = l_run[n][e] * alpha[n][e] + sum;
      }
    bool rescale = false;
#pragma unroll
    for (int n = 0; n < NQ; ++n) rescale |= alpha[n][0] != 1.f || alpha[n][1] != 1.f;
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
          o[n][mt][0] *= alpha[n][0];
          o[n][mt][1] *= alpha[n][1];
          o[n][mt][2] *= alpha[n][0];
          o[n][mt][3] *= alpha[n][1];
        }
    }

    // O^T += V^T P^T: P^T (16 keys x the query columns) is the B operand, each 8 x 8 block of the
    // score registers transposed by movmatrix
#pragma unroll
    for (int tt = 0; tt < kN; ++tt) {
      const int stage = (it + tt) % Lay::kStages;
      uint32_t pb[NQ][2];
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        pb[n][0] = transpose8x8(Elem<M>::pack(s[tt][n][0], s[tt][n][1]));   // keys 0-7
        pb[n][1] = transpose8x8(Elem<M>::pack(s[tt][n][2], s[tt][n][3]));   // keys 8-15
      }
      auto product = [&](int mt, const uint32_t (&vf)[4]) {
#pragma unroll
        for (int n = 0; n < NQ; ++n) Elem<M>::mma(o[n][mt], vf, pb[n][0], pb[n][1]);
      };
      if constexpr (KV::kPlain) {
        const uint32_t va = wsmem + stage * Lay::kStageBytes + Lay::kTileBytes + v_row * Lay::kRowBytes + v_chunk * 16;
#pragma unroll
        for (int mt = 0; mt < D / 16; ++mt) {
          uint32_t vf[4];
          ldmatrix_x4_trans(va + mt * 32, vf);
          product(mt, vf);
        }
      } else {
        const unsigned char* tile_v = wbuf + stage * Lay::kStageBytes + Lay::kTileBytes;
        [[maybe_unused]] const unsigned char* scales_v = tile_v + Lay::kTileBytes + Lay::kScaleBytes;
        // keys 2 t4, 2 t4 + 1 (A registers 0, 1) and 2 t4 + 8, 2 t4 + 9 (registers 2, 3)
        uint32_t w[4][Map::kVWords];
        PairScale<kScaleF32> sc[2] = {{1.f, 1.f}, {1.f, 1.f}};
#pragma unroll
        for (int i = 0; i < 4; ++i)
          load_words(tile_v + (2 * t4 + (i & 1) + 8 * (i >> 1)) * Lay::kRowBytes + g * Map::kVWords * 4, w[i]);
        if constexpr (KV::kGrouped) {
#pragma unroll
          for (int r = 0; r < 2; ++r)
            sc[r] = {load_scale(scales_v + (2 * t4 + 8 * r) * Lay::kScaleRow, v_group, kScaleF32),
                     load_scale(scales_v + (2 * t4 + 8 * r + 1) * Lay::kScaleRow, v_group, kScaleF32)};
        }
        constexpr int kPer = Map::kInt4 ? 8 : 4;  // dims per word
#pragma unroll
        for (int u = 0; u < Map::kVWords; ++u) {
          uint32_t b0[kPer], b1[kPer];
          quant_v_operands<F, kScaleF32>(w[0][u], w[1][u], sc[0], b0);
          quant_v_operands<F, kScaleF32>(w[2][u], w[3][u], sc[1], b1);
#pragma unroll
          for (int i = 0; i < kPer / 2; ++i) {
            const uint32_t vf[4] = {b0[2 * i], b0[2 * i + 1], b1[2 * i], b1[2 * i + 1]};
            product(u * kPer / 2 + i, vf);
          }
        }
      }
    }
  };
  for (int it = 0; it < n_tiles; it += kSteps) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      if (it + Lay::kStages - kSteps + i < n_tiles) issue(it + Lay::kStages - kSteps + i);
      cp_async_commit();
    }
    cp_async_wait<Lay::kStages - kSteps>();
    __syncwarp();
    if (kSteps == 1 || it + kSteps <= n_tiles) {
      step(it, std::integral_constant<int, kSteps>());
    } else {
      step(it, std::integral_constant<int, 1>());
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();

  // each warp's partial state to shared memory (O over its own pipeline buffers)
#pragma unroll
  for (int n = 0; n < NQ; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int x = 4; x < 32; x *= 2) l_run[n][e] += __shfl_xor_sync(0xffffffffu, l_run[n][e], x);
  float* wo = reinterpret_cast<float*>(wbuf);
#pragma unroll
  for (int n = 0; n < NQ; ++n)
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // dim rows g, g + 8
        const int col = KV::kPlain ? 16 * mt + g + 8 * h : Map::v_dim(g + 8 * h, mt);
#pragma unroll
        for (int e = 0; e < 2; ++e) wo[(2 * t4 + e + 8 * n) * Lay::kOStride + col] = o[n][mt][2 * h + e];
      }
  float* warp_m = reinterpret_cast<float*>(smem + Lay::kWarpM);
  float* warp_l = reinterpret_cast<float*>(smem + Lay::kWarpL);
  if (g == 0) {
#pragma unroll
    for (int n = 0; n < NQ; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        warp_m[warp * kRows + 2 * t4 + e + 8 * n] = m_run[n][e];
        warp_l[warp * kRows + 2 * t4 + e + 8 * n] = l_run[n][e];
      }
  }
  __syncthreads();

  // combine the warps: the CTA's state (rows < rows only)
  float* cta_o = reinterpret_cast<float*>(smem + Lay::kCtaO);
  float* cta_m = reinterpret_cast<float*>(smem + Lay::kCtaM);
  float* cta_l = reinterpret_cast<float*>(smem + Lay::kCtaL);
  T* out = static_cast<T*>(a.out);
  auto out_index = [&](int m) {
    return (int64_t)(b * a.q_per_seq + m / group) * a.out_token_stride + (int64_t)(kvh * group + m % group) * a.out_head_stride;
  };
  auto lse_of = [&](int m, float m_all, float l_all) {
    float* p = a.lse + (int64_t)(b * a.q_per_seq + m / group) * a.lse_token_stride +
               (int64_t)(kvh * group + m % group) * a.lse_head_stride;
    *p = l_all > 0.f ? (m_all + __log2f(l_all)) * 0.6931471805599453f : -CUDART_INF_F;
  };
  const bool single = a.cluster_size == 1;
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int m = e / D, col = e % D;
    float m_all = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w * kRows + m]);
    float acc = 0.f, l_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = weight(warp_m[w * kRows + m], m_all);
      acc += f * reinterpret_cast<const float*>(smem + w * Lay::kWarpBytes)[m * Lay::kOStride + col];
      l_all += f * warp_l[w * kRows + m];
    }
    if (single) {
      out[out_index(m) + col] = Elem<T>::from(l_all > 0.f ? acc / l_all * out_mult : 0.f);
      if (col == 0) lse_of(m, m_all, l_all);
    } else {
      cta_o[m * Lay::kOStride + col] = acc;
      if (col == 0) {
        cta_m[m] = m_all;
        cta_l[m] = l_all;
      }
    }
  }
  if (single) return;

  // combine the cluster's CTAs: every CTA finishes a slice of the rows x dims. The loops over the
  // ranks are unrolled to the largest cluster so that a thread's remote loads are all in flight
  // at once (one distributed-shared-memory latency, not one per rank).
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  float* factor = reinterpret_cast<float*>(smem + Lay::kFactor);
  float* row_l = reinterpret_cast<float*>(smem + Lay::kRowL);
  const int n = a.cluster_size;
  if (threadIdx.x < rows) {
    const int m = threadIdx.x;
    float rank_m[kMaxCluster], rank_l[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) {
      rank_m[r] = r < n ? cluster.map_shared_rank(cta_m, r)[m] : -CUDART_INF_F;
      rank_l[r] = r < n ? cluster.map_shared_rank(cta_l, r)[m] : 0.f;
    }
    float m_all = -CUDART_INF_F;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) m_all = fmaxf(m_all, rank_m[r]);
    float l_all = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) {
      const float f = weight(rank_m[r], m_all);
      factor[m * kMaxCluster + r] = f;
      l_all += f * rank_l[r];
    }
    row_l[m] = l_all;
    if (rank == 0) lse_of(m, m_all, l_all);
  }
  __syncthreads();
  for (int e = rank * kThreads + threadIdx.x; e < rows * D; e += n * kThreads) {
    const int m = e / D, col = e % D;
    float part[kMaxCluster];
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) part[r] = r < n ? cluster.map_shared_rank(cta_o, r)[m * Lay::kOStride + col] : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxCluster; ++r) acc += factor[m * kMaxCluster + r] * part[r];
    const float l_all = row_l[m];
    out[out_index(m) + col] = Elem<T>::from(l_all > 0.f ? acc / l_all * out_mult : 0.f);
  }
  cluster.sync();  // no CTA leaves while the others read its shared memory
}

template <typename T, int D, int F, bool S, int NQ, int C>
cudaError_t configure() {
  static const cudaError_t configured = [] {
    auto kernel = decode_kernel<T, D, F, S, NQ, C>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<D, F, C>::kBytes);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    return e;
  }();
  return configured;
}

// the launch configuration of a call: grid (cluster, hkv, batch), clusters along x
struct LaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  LaunchConfig(const AttnDecodeArgs& a, int smem_bytes, cudaStream_t stream) {
    cfg.gridDim = dim3(a.cluster_size, a.hkv, a.batch);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = a.cluster_size;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = a.pdl ? 2 : 1;
  }
};

template <typename T, int D, int F, bool S, int NQ, int C>
int launch(const AttnDecodeArgs& a, cudaStream_t stream, char* err, int err_len) {
  cudaError_t e = configure<T, D, F, S, NQ, C>();
  if (e != cudaSuccess) {
    snprintf(err, err_len, "decode_sm90: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    return 1;
  }
  LaunchConfig lc(a, Layout<D, F, C>::kBytes, stream);
  e = cudaLaunchKernelEx(&lc.cfg, decode_kernel<T, D, F, S, NQ, C>, a);
  if (e != cudaSuccess) {
    snprintf(err, err_len, "decode_sm90: launch (cluster %d, grid %d x %d x %d): %s", a.cluster_size,
             a.cluster_size, a.hkv, a.batch, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

template <typename T, int D, int F, bool S, int NQ, int C>
int max_clusters(const AttnDecodeArgs& a) {
  if (configure<T, D, F, S, NQ, C>() != cudaSuccess) return -1;
  AttnDecodeArgs one = a;
  one.hkv = one.batch = 1;
  LaunchConfig lc(one, Layout<D, F, C>::kBytes, nullptr);
  int n = 0;
  return cudaOccupancyMaxActiveClusters(&n, decode_kernel<T, D, F, S, NQ, C>, &lc.cfg) == cudaSuccess ? n : -1;
}

struct Launcher {
  const AttnDecodeArgs& a;
  cudaStream_t stream;
  char* err;
  int err_len;
  template <typename T, int D, int F, bool S, int NQ, int C>
  int operator()() const { return launch<T, D, F, S, NQ, C>(a, stream, err, err_len); }
};
struct ClusterCounter {
  const AttnDecodeArgs& a;
  template <typename T, int D, int F, bool S, int NQ, int C>
  int operator()() const { return max_clusters<T, D, F, S, NQ, C>(a); }
};

// run `f.template operator()<T, D, F, S, NQ, C>()` for the call's query dtype, head dim, cache
// format, (INT8/INT4) scale dtype, number of 8-row query tiles and CTAs per SM
template <typename Fn>
int dispatch(const AttnDecodeArgs& a, const Fn& f) {
  auto by_format = [&](auto t, auto d, auto nq) -> int {
    using T = decltype(t);
    constexpr int D = decltype(d)::value, NQ = decltype(nq)::value;
    // quantized caches; the two-CTA build for INT8/INT4 at D = 128 and <= 8 rows, where it pays
    // (not for FP8, H200: 1.00-1.05x the one-CTA build, 0.91-1.03x the Triton kernel on
    // multi-wave grids)
    auto quant = [&](auto format, auto scale_fp32) -> int {
      constexpr int F = decltype(format)::value;
      constexpr bool S = decltype(scale_fp32)::value;
      if constexpr (D == 128 && NQ == 1 && Storage<F>::kGrouped) {
        if (a.ctas_per_sm == 2) return f.template operator()<T, D, F, S, NQ, 2>();
      }
      return a.ctas_per_sm == 1 ? f.template operator()<T, D, F, S, NQ, 1>() : -4;
    };
    switch (a.kv_format) {
      case ATTN_DECODE_KV_PLAIN:
        return a.ctas_per_sm == 1 ? f.template operator()<T, D, ATTN_DECODE_KV_PLAIN, false, NQ, 1>() : -4;
      case ATTN_DECODE_KV_E4M3: return quant(std::integral_constant<int, ATTN_DECODE_KV_E4M3>(), std::false_type());
      case ATTN_DECODE_KV_E5M2: return quant(std::integral_constant<int, ATTN_DECODE_KV_E5M2>(), std::false_type());
      case ATTN_DECODE_KV_INT8:
        return a.scale_fp32 ? quant(std::integral_constant<int, ATTN_DECODE_KV_INT8>(), std::true_type())
                            : quant(std::integral_constant<int, ATTN_DECODE_KV_INT8>(), std::false_type());
      case ATTN_DECODE_KV_INT4:
        return a.scale_fp32 ? quant(std::integral_constant<int, ATTN_DECODE_KV_INT4>(), std::true_type())
                            : quant(std::integral_constant<int, ATTN_DECODE_KV_INT4>(), std::false_type());
      default: return -2;
    }
  };
  auto by_rows = [&](auto t, auto d) -> int {
    const int rows = a.hkv > 0 ? a.hq / a.hkv * a.q_per_seq : 0;
    return rows <= 8 ? by_format(t, d, std::integral_constant<int, 1>()) : by_format(t, d, std::integral_constant<int, 2>());
  };
  auto by_dim = [&](auto t) -> int {
    switch (a.head_dim) {
      case 64: return by_rows(t, std::integral_constant<int, 64>());
      case 128: return by_rows(t, std::integral_constant<int, 128>());
      default: return -3;
    }
  };
  return a.dtype == ATTN_DECODE_BF16 ? by_dim(__nv_bfloat16()) : by_dim(__half());
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int attn_decode_sm90(const AttnDecodeArgs* args, void* stream,
                                                                     char* err, int err_len) {
  const AttnDecodeArgs& a = *args;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = a.hkv > 0 ? a.hq / a.hkv * a.q_per_seq : 0;
  if (rows < 1 || rows > kRows || a.cluster_size < 1 || a.cluster_size > kMaxCluster || a.block_size % kKeys ||
      (a.ctas_per_sm != 1 && a.ctas_per_sm != 2)) {
    snprintf(err, err_len, "decode_sm90: unsupported problem (rows %d, cluster %d, block_size %d, ctas_per_sm %d)", rows,
             a.cluster_size, a.block_size, a.ctas_per_sm);
    return 1;
  }
  if (a.kv_format == ATTN_DECODE_KV_INT8 || a.kv_format == ATTN_DECODE_KV_INT4) {
    const int groups = a.quant_group > 0 ? a.head_dim / a.quant_group : 0;
    const int row = groups * (a.scale_fp32 ? 4 : 2);
    if (groups < 1 || groups > 4 || groups * a.quant_group != a.head_dim || (row != 4 && row != 8 && row != 16)) {
      snprintf(err, err_len, "decode_sm90: unsupported quant_group %d (head_dim %d, %s scales)", a.quant_group,
               a.head_dim, a.scale_fp32 ? "fp32" : "fp16");
      return 1;
    }
  }
  if (a.batch == 0) return 0;
  const int r = dispatch(a, Launcher{a, s, err, err_len});
  if (r < 0)
    snprintf(err, err_len, "decode_sm90: head_dim %d / kv_format %d / %d CTAs per SM (rows %d) is not built", a.head_dim,
             a.kv_format, a.ctas_per_sm, rows);
  return r == 0 ? 0 : 1;
}

// how many clusters of args->cluster_size CTAs can be resident at once on the current device
// (for the grid heuristic), or -1
extern "C" __attribute__((visibility("default"))) int attn_decode_sm90_max_clusters(const AttnDecodeArgs* args) {
  const int n = dispatch(*args, ClusterCounter{*args});
  return n < 0 ? -1 : n;
}
