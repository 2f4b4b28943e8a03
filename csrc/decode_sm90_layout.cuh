// The CUDA decode kernel (decode_sm90.cu): its tuning knobs, sizes, the cache formats' storage
// (Storage) and the shared-memory layout of a CTA (Layout).
#pragma once

#include "decode_sm90.h"

namespace {

// Tuning knobs for A/B builds (torch_ops.kernels.cuda.decode_sm90.build(defines=...)); the defaults are the
// choices measured fastest on an H200.
#ifndef ATTN_DECODE_WARPS
#define ATTN_DECODE_WARPS 8
#endif
#ifndef ATTN_DECODE_STAGES
#define ATTN_DECODE_STAGES 2
#endif
#ifndef ATTN_DECODE_QUANT_STAGES
#define ATTN_DECODE_QUANT_STAGES 4
#endif
#ifndef ATTN_DECODE_QUANT_TILES_PER_STEP
#define ATTN_DECODE_QUANT_TILES_PER_STEP 2   // FP8/INT8/INT4: 16-key tiles per softmax step (Storage)
#endif
constexpr int kWarps = ATTN_DECODE_WARPS;   // per CTA; torch_ops/kernels/cuda/decode_sm90.py WARPS
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;       // query rows of a CTA at most: two n8 MMA tiles
constexpr int kKeys = 16;       // keys per tile
constexpr int kMaxCluster = 16;

// how a cache format stores a key row
template <int F>
struct Storage {
  static constexpr bool kPlain = F == ATTN_DECODE_KV_PLAIN;
  static constexpr bool kFp8 = F == ATTN_DECODE_KV_E4M3 || F == ATTN_DECODE_KV_E5M2;
  static constexpr bool kGrouped = F == ATTN_DECODE_KV_INT8 || F == ATTN_DECODE_KV_INT4;
  static constexpr int kBits = kPlain ? 16 : F == ATTN_DECODE_KV_INT4 ? 4 : 8;
  // 16-key tiles per softmax step (H200: two gain 2-10% for FP8 and INT4, 0-3% for INT8)
  static constexpr int kTilesPerStep = kPlain ? 1 : ATTN_DECODE_QUANT_TILES_PER_STEP;
};

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// C: CTAs per SM the kernel is built for. C = 2 (INT8/INT4 at <= 8 rows, AttnDecodeArgs::ctas_per_sm)
// halves the registers (128) and the pipeline (2 stages of one tile per softmax step), so that
// four warps share each scheduler on grids of more than one wave. (INT4 with 3 or 4 stages, which
// fit, runs at 0.86-1.01x on an H200.)
template <int D, int F, int C = 1>
struct Layout {
  static constexpr int kRowBytes = D * Storage<F>::kBits / 8 + 16;  // one padded key row in shared memory
  static constexpr int kTileBytes = kKeys * kRowBytes;    // a K or a V tile
  static constexpr int kScaleRow = 16;                    // bytes per key of a group-scale tile
  static constexpr int kScaleBytes = Storage<F>::kGrouped ? kKeys * kScaleRow : 0;
  static constexpr int kStageBytes = 2 * kTileBytes + 2 * kScaleBytes;  // K, V, K scales, V scales
  static constexpr int kStages = Storage<F>::kPlain ? ATTN_DECODE_STAGES : C == 2 ? 2 : ATTN_DECODE_QUANT_STAGES;
  static constexpr int kTilesPerStep = C == 2 ? 1 : Storage<F>::kTilesPerStep;
  static constexpr int kOStride = D + 8;                  // floats per row of an O buffer
  // a warp's pipeline buffers, which hold its O (16 rows x kOStride floats) once the loop is done
  static constexpr int kWarpBytes = cmax(kStages * kStageBytes, kRows * kOStride * 4);
  static constexpr int kCtaO = kWarps * kWarpBytes;       // byte offsets of the merge buffers
  static constexpr int kWarpM = kCtaO + kRows * kOStride * 4;
  static constexpr int kWarpL = kWarpM + kWarps * kRows * 4;
  static constexpr int kCtaM = kWarpL + kWarps * kRows * 4;
  static constexpr int kCtaL = kCtaM + kRows * 4;
  static constexpr int kFactor = kCtaL + kRows * 4;       // [kRows][kMaxCluster] cluster weights
  static constexpr int kRowL = kFactor + kRows * kMaxCluster * 4;
  static constexpr int kBytes = kRowL + kRows * 4;
};

}  // namespace
