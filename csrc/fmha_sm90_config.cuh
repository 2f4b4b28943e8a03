// The FMHA kernels of fmha_sm90.cu: the configuration a translation unit is built for (element,
// head dim, grid, paged family, cluster size, from the -DATTN_* macros), the tile shape, the masks
// (VarlenMask) and the example's mainloop it builds on (Base).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdio>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/numeric_conversion.h"
#include "kernel/fmha_kernel_builder.hpp"  // examples/88_hopper_fmha (include path set by the build)

#include "fmha_sm90.h"

// Anonymous: every type of fmha_sm90.cu and its parts (and so the kernel instantiated from them) has
// internal linkage, so the per-configuration objects, which reuse these names, link into one
// library without clashing.
namespace attn_fmha {
namespace {

using namespace cute;

#if defined(ATTN_ELEMENT_E4M3)
using Element = cutlass::float_e4m3_t;
#define ATTN_ELEMENT_NAME e4m3
#elif defined(ATTN_ELEMENT_BF16)
using Element = cutlass::bfloat16_t;
#define ATTN_ELEMENT_NAME bf16
#elif defined(ATTN_ELEMENT_FP16)
using Element = cutlass::half_t;
#define ATTN_ELEMENT_NAME fp16
#else
#error "define one of ATTN_ELEMENT_E4M3, ATTN_ELEMENT_BF16, ATTN_ELEMENT_FP16"
#endif

#ifndef ATTN_PERSISTENT
#define ATTN_PERSISTENT 0
#endif
#ifndef ATTN_PAGED
#define ATTN_PAGED 0
#endif
#ifndef ATTN_CLUSTER
#define ATTN_CLUSTER 1
#endif

constexpr int kHeadDim = ATTN_HEAD_DIM;
constexpr bool kFp8 = sizeof(Element) == 1;
constexpr bool kPersistent = ATTN_PERSISTENT;
constexpr bool kPaged = ATTN_PAGED != 0;
constexpr bool kBlockBoxes = ATTN_PAGED == 2;  // see BlockBoxes
// CTAs per cluster: with 2, the two CTAs of a cluster run two query heads of one KV head on the same
// rows, and each issues half of a K/V tile's boxes, multicast to both (load_paged_tile)
constexpr int kCluster = ATTN_CLUSTER;
static_assert(kHeadDim == 128 || kHeadDim == 256 || (kHeadDim == 64 && !kFp8),
              "head dims 128 and 256 are instantiated, and 64 for bf16/fp16");
static_assert(!kPaged || (!kFp8 && kHeadDim <= 128), "paged kernels: bf16/fp16, head dims 64 and 128");
static_assert(!kBlockBoxes || kHeadDim == 128, "BlockBoxes: D = 128");
static_assert(kCluster == 1 || (kPaged && kCluster == 2), "clusters: paged kernels, of 2 CTAs");

// (query rows per CTA, keys per tile, head dim): the example's best-measured shapes, except FP8
// D = 128 at 192 keys (the largest tile whose scores fit the registers beside the next tile's
// operand, see kOverlapSoftmax) in the plain grid, and at 128 keys in the persistent grid, which
// runs short sequences (torch_ops.kernels.cuda.fmha_sm90_build.PERSISTENT_SHORT; H200: 1.01-1.08x the 192-key
// tiles up to 2k keys, 0.99x at 4k), unless -DATTN_BLOCK_N overrides the key tile (for tuning
// runs; run the GPU tests on any other tile: bf16 160-key tiles in the overlapped loop give wrong
// outputs, for a reason not known).
#ifdef ATTN_BLOCK_N
using TileShape = Shape<_128, Int<ATTN_BLOCK_N>, Int<kHeadDim>>;
#else
using TileShape = std::conditional_t<kHeadDim == 64, Shape<_128, _128, _64>,
    std::conditional_t<kHeadDim == 128,
        std::conditional_t<kFp8 && !kPersistent, Shape<_128, _192, _128>, Shape<_128, _128, _128>>,
        std::conditional_t<kFp8, Shape<_128, _128, _256>, Shape<_128, _64, _256>>>>;
#endif

// Strides of (tokens, head dim, (batch, head)); FP8 V is transposed (tokens contiguous).
using StrideQK = cute::tuple<int, _1, cute::tuple<int, int>>;
using StrideV = std::conditional_t<kFp8, cute::tuple<_1, int, cute::tuple<int, int>>, StrideQK>;

// Softmax overlapped with the products (VarlenMainloop::compute_overlapped): FP8 at D = 128, and
// the paged kernels (whose last V tile needs zeroing that the example's loop has no place for).
// Contiguous bf16/fp16 measured 0-5% slower with it (H200, docs/cutlass.md); at D = 256 the
// output accumulator alone takes 128 of a consumer's 240 registers and the overlapped loop spills.
// FP8 there reads V with the tokens of every 16 interleaved (see probabilities_operand).
constexpr bool kInterleavedV = kFp8 && kHeadDim == 128;
// The persistent FP8 D = 128 kernels read V token-major, as K, and two warps of the producer
// warpgroup transpose each tile in shared memory into the interleaved layout the PV product reads
// (transpose_tiles): a tile passes through three pipeline stages, K, raw V and transposed V. H200,
// S = 512: 1.07x / 1.12x (non-causal / causal).
// The plain kernels read V transposed and interleaved by torch_ops/kernels/triton/transpose.py: with their
// 192-key tiles in 6 stages (against 5 stages of K and V) transposing here runs 0.96x at S = 4k-8k.
constexpr bool kTransposeV = kInterleavedV && kPersistent;
#ifdef ATTN_OVERLAP_SOFTMAX  // tuning runs only: the paged kernels then skip the V tail zeroing
constexpr bool kOverlapSoftmax = ATTN_OVERLAP_SOFTMAX || kInterleavedV;
#else
constexpr bool kOverlapSoftmax = kInterleavedV || kPaged;
#endif

// Four fp32 values -> one register of e4m3 bytes (b0 in the low byte); saturating, as FA3 does.
CUTLASS_DEVICE uint32_t e4m3x4(float b0, float b1, float b2, float b3) {
  uint32_t out;
  asm("{\n .reg .b16 lo, hi;\n cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      " mov.b32 %0, {lo, hi};\n}"
      : "=r"(out)
      : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
  return out;
}

// Keys of a sequence are read from its first key rounded down to this many (see fmha_sm90.cu).
constexpr int kKeyAlign = kFp8 ? 16 : 1;

// Problem shape of one sequence as the mainloop sees it: (1, Hq, Lq, Lk, D, causal, key offset);
// key tile positions count from the sequence's first key minus the key offset.
using SeqShape = cute::tuple<int, int, int, int, int, int, int>;

// Which key tiles a CTA visits and which logits are masked: the key offset's leading keys, keys
// past the sequence's Lk, and (causal) keys after the query's position Lk - Lq + i. Trip counts
// are per CTA (both consumer warpgroups consume the same K/V tiles). The mainloop always masks
// its first tile and then runs the unmasked tiles before the masked ones, so the key offset
// (< 16 keys, inside tile 0) never needs a masked tile of its own. At least one tile is visited
// so that a row with nothing to attend to ends with sum 0 (out 0, lse -inf).
struct VarlenMask {
  template <class BlkCoord, class Tile>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, Tile const& tile, SeqShape const& s) {
    int lq = get<2>(s), lk = get<3>(s), off = get<6>(s), n = get<1>(tile);
    int tiles = ceil_div(lk + off, n);
    if (get<5>(s)) {
      int keys = (int(get<0>(blk)) + 1) * int(get<0>(tile)) + lk - lq + off;  // past the CTA's last row's last key
      tiles = min(tiles, ceil_div(max(keys, 0), n));
    }
    return max(tiles, 1);
  }

  template <class BlkCoord, class Tile>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk, Tile const& tile, SeqShape const& s) {
    int lq = get<2>(s), lk = get<3>(s), off = get<6>(s), n = get<1>(tile);
    int full = (lk + off) / n;
    if (get<5>(s)) {  // tiles whose every key is visible to the CTA's first row
      full = min(full, max(int(get<0>(blk)) * int(get<0>(tile)) + lk - lq + off + 1, 0) / n);
    }
    return min(full, get_trip_count(blk, tile, s));
  }

  template <class BlkCoord, class Tile>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk, Tile const& tile, SeqShape const& s) {
    return get_trip_count(blk, tile, s) - get_unmasked_trip_count(blk, tile, s);
  }

  // Masks a tile's logits. A thread whose elements are all visible returns at once (the
  // mainloop calls this on its first tile whether or not that tile needs a mask). Otherwise one
  // unsigned compare per element against the row's visible key range [0, hi): key k (counted
  // from the sequence's first key) is visible iff 0 <= k < hi, hi = Lk or (causal) the row's
  // diagonal + 1, clamped at 0.
  template <class AccQK, class IndexQK>
  CUTLASS_DEVICE void before_softmax(AccQK& acc, IndexQK const& index, SeqShape const& s) {
    int lk = get<3>(s), diagonal = get<3>(s) - get<2>(s), off = get<6>(s);
    bool causal = get<5>(s);
    // the thread's first and last elements hold its smallest and largest (row, key)
    int k_first = int(get<1>(index(0))) - off, k_last = int(get<1>(index(size(acc) - 1))) - off;
    int q_first = int(get<0>(index(0)));
    if (k_first >= 0 && k_last < lk && (!causal || k_last <= q_first + diagonal)) return;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i++) {
      auto pos = index(i);
      int hi = causal ? min(lk, int(get<0>(pos)) + diagonal + 1) : lk;
      if (unsigned(int(get<1>(pos)) - off) >= unsigned(max(hi, 0))) acc(i) = -INFINITY;
    }
  }
};

using cutlass::fmha::kernel::Option;
using cutlass::fmha::kernel::Tag;

// Persistent: the mainloop releases each tile's Q buffer and last V buffer, so that the pipelines
// carry on into the CTA's next tile.
template <class... Options>
using MainloopWith = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
    Element, float, float, TileShape, StrideQK, StrideQK, StrideV, VarlenMask, Options...>;
// K/V pipeline stages (each one K, raw V or V tile): three per key tile when V is transposed here,
// where two warps take turns (transpose_tiles) and each waits only on its own stages: with a
// multiple of 6 stages, each stage always holds the same kind of tile for the same warp, so a warp
// never waits on a barrier that is two phases behind (where the phase parity would already match).
#ifdef ATTN_STAGES_KV  // tuning runs
constexpr int kStagesKV = ATTN_STAGES_KV;
#else
constexpr int kStagesKV = kTransposeV ? 6 : 5;
#endif
static_assert(!kTransposeV || kStagesKV % 6 == 0, "see kStagesKV");
using StagesKV = Option<Tag::kStagesKV, Int<kStagesKV>>;
using Base = std::conditional_t<kPersistent, MainloopWith<Option<Tag::kIsPersistent, true_type>, StagesKV>,
                                MainloopWith<StagesKV>>;

}  // namespace
}  // namespace attn_fmha
