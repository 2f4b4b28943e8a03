// The FMHA kernels of fmha_sm90.cu: the epilogue (VarlenEpilogue: out and lse rows).
#pragma once

#include "fmha_sm90_config.cuh"
#include "fmha_sm90_mainloop.cuh"

namespace attn_fmha {
namespace {

// Stores the output (times the v descale, over out_scale for FP8) and lse of one consumer
// warpgroup's 64 rows; rows past the sequence's end are not written. The one-CTA-per-tile kernels
// stage the rows in shared memory and write whole 16-byte chunks of a row per thread (coalesced):
// the kernel lays warpgroup i's TensorStorage over its Q block (a union with the mainloop's
// storage, whose Q blocks come first), free once its mainloop is done. Outputs wider than the
// inputs (FP8 in, bf16 out) take two rounds of 32 rows. The persistent kernels, whose Q warp
// reloads that block during the epilogue, stage in buffers of their own (the kernel keeps the
// epilogue's storage apart from the mainloop's when persistent) where those fit beside the
// mainloop's storage (every instantiation of PERSISTENT_SHORT), else store from registers (pairs
// of values per thread). H200, one process: without any output stores the persistent kernels run
// 1.16-1.23x faster at S = 512.
struct VarlenEpilogue {
  static constexpr int kRows = get<0>(TileShape{}) / VarlenMainloop::NumMmaWarpGroups;  // per consumer warpgroup
  static constexpr int kOwnBytes = kRows * kHeadDim * 2;  // a 16-bit output tile
  static constexpr int kSmemLimit = 227 * 1024;           // the most shared memory a CTA may have on sm_90
  static constexpr bool kStaged =                         // (1 KB left for the pipelines' barriers)
      !kPersistent ||
      int(sizeof(VarlenMainloop::SharedStorage)) + VarlenMainloop::NumMmaWarpGroups * kOwnBytes + 1024 <= kSmemLimit;
  static constexpr int kStagedBytes = !kPersistent ? kRows * kHeadDim * int(sizeof(Element)) : kStaged ? kOwnBytes : 16;
  struct TensorStorage {
    alignas(128) uint8_t bytes[kStagedBytes];
  };
  using LoadPipeline = cutlass::PipelineTransactionAsync<1>;  // unused; the kernel constructs one
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr int TmaTransactionBytes = 0;

  struct Params {
    void* out;
    float* lse;
    int64_t out_row_stride, out_head_stride, lse_row_stride;
    const int* cu_q;
    const float* v_scale;  // NULL: 1
    const float* out_scale;
    int v_scale_stride, group, out_dtype;
    int total_q;  // the rows of out and lse: a sequence's rows are clamped into [0, total_q]
  };

  // Calls write(row, column, two converted values) for each column pair this thread holds.
  template <class Out, class Acc, class Coord, class Write>
  CUTLASS_DEVICE static void convert_pairs(Acc const& acc_mn, Coord const& c_mn, float scale, Write const& write) {
    cutlass::NumericArrayConverter<Out, float, 2> convert;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(acc_mn); i++) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc_mn); j += 2) {  // the wgmma accumulator holds column pairs
        cutlass::Array<float, 2> v;
        v[0] = acc_mn(i, j) * scale;
        v[1] = acc_mn(i, j + 1) * scale;
        if constexpr (std::is_same_v<Out, cutlass::float_e4m3_t>) {
          v[0] = fminf(fmaxf(v[0], -448.f), 448.f);
          v[1] = fminf(fmaxf(v[1], -448.f), 448.f);
        }
        write(get<0>(c_mn(i, j)), get<1>(c_mn(i, j)), convert(v));
      }
    }
  }

  template <class Out, class Acc, class Coord>
  CUTLASS_DEVICE static void store_rows(Out* out, TensorStorage& staged, int wg, Acc const& acc_mn, Coord const& c_mn,
                                        int row0, int lq, float scale, int64_t row_stride) {
    using Pair = cutlass::Array<Out, 2>;
    if constexpr (!kStaged) {
      convert_pairs<Out>(acc_mn, c_mn, scale, [&](int r, int col, Pair const& v) {
        if (row0 + r < lq) *reinterpret_cast<Pair*>(out + (row0 + r) * row_stride + col) = v;
      });
    } else {
      constexpr int kRowBytes = kHeadDim * int(sizeof(Out));
      constexpr int kChunks = kRowBytes / 16;
      constexpr int kRounds = kRows * kRowBytes > kStagedBytes ? 2 : 1;
      constexpr int kRoundRows = kRows / kRounds;
      static_assert(kRoundRows * kRowBytes <= kStagedBytes && kChunks >= 4, "rows fit the staging buffer");
      // persistent: the previous tile's rows have been read out of the buffer by every thread
      if constexpr (kPersistent) cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, wg);
      // chunk c of row r sits at chunk c ^ (r % 4..8): a warp's pair writes (8 rows, one chunk)
      // and its 16-byte reads (whole rows) both spread over the banks
      auto chunk_at = [&](int r, int c) { return staged.bytes + r * kRowBytes + ((c ^ (r % min(kChunks, 8))) << 4); };
      int t = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
      CUTLASS_PRAGMA_UNROLL
      for (int round = 0; round < kRounds; round++) {
        if (round > 0) cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, wg);  // reads done
        convert_pairs<Out>(acc_mn, c_mn, scale, [&](int r, int col, Pair const& v) {
          int byte = col * int(sizeof(Out));
          if (r / kRoundRows == round) {
            *reinterpret_cast<Pair*>(chunk_at(r % kRoundRows, byte >> 4) + (byte & 15)) = v;
          }
        });
        cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, wg);
        CUTLASS_PRAGMA_UNROLL
        for (int k = t; k < kRoundRows * kChunks; k += cutlass::NumThreadsPerWarpGroup) {
          int r = k / kChunks, c = k % kChunks, row = row0 + round * kRoundRows + r;
          if (row < lq) {
            *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(out + row * row_stride) + (c << 4)) =
                *reinterpret_cast<uint4 const*>(chunk_at(r, c));
          }
        }
      }
    }
  }

  template <class Tile, class BlkCoord, class Result, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(Tile const&, BlkCoord const& wg, Result const& result, TiledMma const& mma,
                                 ProblemShape const&, Params const& p, LoadPipeline, TensorStorage& staged) {
    auto acc = get<0>(result);
    auto lse = get<1>(result);
    int b = get<2, 0>(wg), h = get<2, 1>(wg);
    int q0 = min(max(p.cu_q[b], 0), p.total_q), lq = min(max(p.cu_q[b + 1], q0), p.total_q) - q0;
    int row0 = int(get<0>(wg)) * int(get<0>(Tile{}));
    int wg_index = int(get<0>(wg)) % VarlenMainloop::NumMmaWarpGroups;

    auto thr = mma.get_thread_slice(threadIdx.x % cutlass::NumThreadsPerWarpGroup);
    Tensor cO = thr.partition_C(make_identity_tensor(take<0, 2>(Tile{})));
    Tensor c_mn = make_tensor(cO.data(), cutlass::fmha::collective::layout_acc_mn(mma, cO.layout()));
    Tensor acc_mn = make_tensor(acc.data(), cutlass::fmha::collective::layout_acc_mn(mma, acc.layout()));

    float scale = p.v_scale != nullptr ? p.v_scale[(h / p.group) * p.v_scale_stride] : 1.f;
    int64_t first = q0 * p.out_row_stride + h * p.out_head_stride;  // this head's row q0
    if (p.out_dtype == ATTN_OUT_E4M3) {
      scale /= *p.out_scale;
      store_rows(static_cast<cutlass::float_e4m3_t*>(p.out) + first, staged, wg_index, acc_mn, c_mn, row0, lq, scale,
                 p.out_row_stride);
    } else if (p.out_dtype == ATTN_OUT_FP16) {
      store_rows(static_cast<cutlass::half_t*>(p.out) + first, staged, wg_index, acc_mn, c_mn, row0, lq, scale,
                 p.out_row_stride);
    } else {
      store_rows(static_cast<cutlass::bfloat16_t*>(p.out) + first, staged, wg_index, acc_mn, c_mn, row0, lq, scale,
                 p.out_row_stride);
    }
    if (get<1>(c_mn(0, 0)) == 0) {  // one thread per row writes its lse
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(acc_mn); i++) {
        int r = row0 + get<0>(c_mn(i, 0));
        // the mainloop reports an empty softmax (sum 0) as +inf; the contract says -inf
        if (r < lq) p.lse[(q0 + r) * p.lse_row_stride + h] = lse(i) == INFINITY ? -INFINITY : lse(i);
      }
    }
  }
};

}  // namespace
}  // namespace attn_fmha
