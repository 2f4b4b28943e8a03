// Varlen (packed, cu_seqlens) forward attention on Hopper, FP8 e4m3 or bf16/fp16 inputs.
//
// Built on the warp-specialized FMHA mainloop of CUTLASS's example 88 (included from the
// nvidia-cutlass wheel, not copied): one producer warpgroup loads Q/K/V tiles by TMA, two
// consumer warpgroups run QK^T -> online softmax -> PV with wgmma. What this file adds:
//   * varlen: TMA coordinates offset by cu_seqlens (domain_offset), so one descriptor covers
//     the packed tensor; keys past a sequence's end are masked, query rows past it not stored;
//     FP8 V is read transposed (tokens innermost), where TMA traps on a box start that is not
//     16-byte aligned: a sequence's key tiles then start at its first key rounded down to 16
//     and the keys before it are masked (the "key offset");
//   * tile schedulers over "virtual" tiles (floor(cu_q[b] / M) + b), found by binary search
//     on cu_seqlens_q: no host sync, no pre-pass, CUDA-graph safe; either one CTA per work tile,
//     or (-DATTN_PERSISTENT=1) a persistent grid whose CTAs loop over the work tiles;
//   * bottom-right causal masking, GQA (KV head = h / group), runtime softmax scale with
//     per-head q/k descales, v descale (and 1/out_scale for FP8 output) in the epilogue;
//   * an epilogue that writes bf16/fp16/e4m3 rows through shared memory in 16-byte chunks
//     (predicated rows; the persistent kernels in buffers of their own where they fit);
//   * (-DATTN_PAGED=1, bf16/fp16) K/V read from a paged cache [num_blocks, block_size, Hkv, D]
//     in TMA boxes of `box_rows` tokens x the whole head dim, addressed by (block, row in block)
//     from the block table (see PagedLayouts, load_paged_tile and encode_pages); (-DATTN_PAGED=2,
//     D = 128) boxes of 16 tokens in another stage layout (see BlockBoxes); with -DATTN_CLUSTER=2
//     in clusters of two CTAs (two query heads of one KV head) that share each box by multicast;
//     the paged kernels in the persistent grid too (there the load warp looks ahead in the work
//     order, so that a CTA of a cluster stays until its peer is done with its stages).
//
// One translation unit per (element, head dim, persistent or not, paged or not, cluster size),
// chosen by -DATTN_ELEMENT_<E4M3|BF16|FP16>, -DATTN_HEAD_DIM=<64|128|256>, -DATTN_PERSISTENT=<0|1>,
// -DATTN_PAGED=<0|1|2> and -DATTN_CLUSTER=<1|2>; torch_ops/cutlass.py builds and links them.
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

// Anonymous: every type here (and so the kernel instantiated from it) has internal linkage, so the
// per-configuration objects, which reuse these names, link into one library without clashing.
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
// runs short sequences (torch_ops.cutlass.PERSISTENT_SHORT; H200: 1.01-1.08x the 192-key tiles up
// to 2k keys, 0.99x at 4k), unless -DATTN_BLOCK_N overrides the key tile (for tuning runs;
// run the GPU tests on any other tile: bf16 160-key tiles in the overlapped loop give wrong
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
// The plain kernels read V transposed and interleaved by torch_ops/kernels/transpose.py: with their
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

// Keys of a sequence are read from its first key rounded down to this many (see the header).
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

template <class Shape_, class Stride_>
using Swizzled = ComposedLayout<Swizzle<3, 4, 3>, smem_ptr_flag_bits<sizeof_bits_v<Element>>, Layout<Shape_, Stride_>>;

// -DATTN_PAGED=1: the K/V stages hold key a of the tile, dim d at element
//   8 D (a / 8) + 64 (a % 8) + 512 (d / 64) + d % 64      (128-byte swizzled rows),
// every 8 keys' whole head dim in D / 64 swizzle atoms of 8 rows, where the example's stages keep a
// 64-dim column block's keys together (the same at D = 64). A TMA box over (64 dims, 8 tokens,
// D / 64, tokens / 8) (encode_pages) lands box_rows tokens x the whole head dim on whole atoms, and
// the products still read 8-key groups at one stride, as wgmma's descriptors want: the example's
// products and masks run on them unchanged. Offsets in elements of 16 bits.
struct PagedLayouts {
  static constexpr int kBlockN = get<1>(TileShape{});
  using Keys = Shape<_8, Int<kBlockN / 8>>;
  using KeyStrides = Stride<_64, Int<8 * kHeadDim>>;
  using Dims = Shape<_64, Int<kHeadDim / 64>>;
  using DimStrides = Stride<_1, _512>;
  using Stages = Int<kStagesKV>;
  using StageStride = Int<kBlockN * kHeadDim>;
  using SmemLayoutK = Swizzled<Shape<Keys, Dims, Stages>, Stride<KeyStrides, DimStrides, StageStride>>;  // (key, dim, stage)
  using SmemLayoutV = Swizzled<Shape<Dims, Keys, Stages>, Stride<DimStrides, KeyStrides, StageStride>>;  // (dim, key, stage)
  using SmemLayoutBoxes = SmemLayoutK;  // (key, dim, stage): where the boxes land
  using TiledMmaQK = typename Base::TiledMmaQK;
};

// -DATTN_PAGED=2: boxes of 16 tokens over (64 dims, 16 tokens, 2 halves), 16 consecutive rows per
// half: for 16-token boxes 1.00-1.06x as fast as PagedLayouts' (64, 8, 2, 2) boxes (the same bytes,
// 8 boxes per tile; H200), and they take caches
// whose blocks TMA cannot see as one line of tokens. A stage then holds key a, dim d at element
//   2048 (a / 16) + 1024 (d / 64) + 64 (a % 16) + d % 64,
// and the products read it through "logical" key orders whose 8-key groups lie at one stride, as
// wgmma's descriptors want: QK^T as two N = 64 products over logical keys l = (i, g, n) (i, g < 8,
// n < 2: key 16 g + 8 n + i; groups 4 KB apart). The PV product takes P's 16-key steps in the order
// the accumulator gives them (step t = n + 2 c holds logical keys 64 n + 16 c + j, j < 16), so V's
// logical key 16 t + j is key 32 c + 16 (j / 8) + 8 n + j % 8. Masks see the keys themselves
// (KeyCoordinates).
struct BlockBoxes {
  using Stages = Int<kStagesKV>;
  using StageStride = Int<128 * 128>;
  using Dims = Shape<_64, _2>;
  using DimStrides = Stride<_1, _1024>;
  using SmemLayoutBoxes = Swizzled<Shape<Shape<_16, _8>, Dims, Stages>, Stride<Stride<_64, _2048>, DimStrides, StageStride>>;
  // (logical key l, dim, stage) and (dim, logical key of V, stage)
  using SmemLayoutK = Swizzled<Shape<Shape<_8, _8, _2>, Dims, Stages>, Stride<Stride<_64, _2048, _512>, DimStrides, StageStride>>;
  using SmemLayoutV = Swizzled<Shape<Dims, Shape<_8, _2, _2, _4>, Stages>, Stride<DimStrides, Stride<_64, _2048, _512, _4096>, StageStride>>;
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, _64, _128>>()));
  // (row, logical key) -> (row, key): the masks' coordinates
  using KeyCoordinates = Layout<Shape<_64, Shape<_8, _8, _2>>, Stride<E<0>, Stride<E<1>, ScaledBasis<_16, 1>, ScaledBasis<_8, 1>>>>;
};

// The stage layouts and QK^T product of the kernel: the example's, PagedLayouts' or BlockBoxes'.
struct ExampleLayouts {
  using SmemLayoutK = typename Base::SmemLayoutK;
  using SmemLayoutV = typename Base::SmemLayoutV;
  using SmemLayoutBoxes = SmemLayoutK;  // unused: these kernels load no paged boxes
  using TiledMmaQK = typename Base::TiledMmaQK;
};
using Layouts = std::conditional_t<kBlockBoxes, BlockBoxes, std::conditional_t<kPaged, PagedLayouts, ExampleLayouts>>;

// Work tiles: sequence b owns the "virtual" q tiles [first(b), first(b + 1)) of each head, with
// first(b) = floor(cu_q[b] / M) + min(b, floor(cu_q[b] / (skip + 1))): at least ceil(Lq / M) of
// them when Lq > skip (both terms grow, the second by at least one), at most one spare (found past
// Lq and skipped). Sequences of at most `skip` queries (left to another launch) may get tiles too,
// which find nothing to do. There are first(B) = floor(total_q / M) + min(B, floor(total_q /
// (skip + 1))) virtual tiles per head, known on the host without reading the lengths; a tile's
// sequence is found by a search on cu_seqlens_q (find_tile).
constexpr int kBlockM = get<0>(TileShape{});

struct VirtualTile {
  int m_block, b;
  bool valid;
};

CUTLASS_HOST_DEVICE int first_tile(int cu_q_b, int b, int skip) { return cu_q_b / kBlockM + min(b, cu_q_b / (skip + 1)); }

// The search is 32-ary, by a whole warp (every caller runs with all 32 lanes): each round, lane i
// tests the i-th of 32 evenly spaced candidates in [lo, hi], so that up to 1024 sequences take two
// dependent reads of cu_q instead of ten. A CTA whose tile holds nothing pays for this search and
// nothing else (mixed batches launch many: H100, 1.5-4k of them cost 20-80 us with a binary search).
CUTLASS_DEVICE VirtualTile find_tile(int t, const int* cu_q, int num_seqs, int skip) {
  int lo = 0, hi = num_seqs - 1;   // the answer: the last b in [lo, hi] with first_tile(b) <= t
  int lane = threadIdx.x % 32;
  while (lo < hi) {
    int step = (hi - lo) / 32 + 1;
    int b = lo + lane * step;
    bool le = b <= hi && first_tile(cu_q[b], b, skip) <= t;
    lo += (__popc(__ballot_sync(0xffffffffu, le)) - 1) * step;   // lanes 0 .. k pass: the answer is in their step
    hi = min(hi, lo + step - 1);
  }
  int m_block = t - first_tile(cu_q[lo], lo, skip);
  int lq = cu_q[lo + 1] - cu_q[lo];
  return {m_block, lo, lq > skip && m_block * kBlockM < lq};
}

// The work items of a launch: tiles x Hq, item i of (head section, virtual tile, head within the
// section) = (i / section_heads / num_tiles, i / section_heads % num_tiles, i % section_heads):
// the `section_heads` heads of a section run each q tile together, and causal tiles go from the
// highest (most keys) down. The plain grid runs item i in CTA i, the persistent one items c,
// c + num_ctas, ... in CTA c.
struct WorkOrder {
  const int* cu_q;
  int num_seqs, skip_q_len, num_tiles, num_items, section_heads, num_ctas;
  bool longest_first;

  CUTLASS_DEVICE VirtualTile at(int item, int& h) const {
    int rest = item / section_heads, x = rest % num_tiles;
    h = rest / num_tiles * section_heads + item % section_heads;
    return find_tile(longest_first ? num_tiles - 1 - x : x, cu_q, num_seqs, skip_q_len);
  }

  // From `item` on (in steps of the grid), the first item whose tile holds query rows: skips
  // spare tiles; num_items or more when none is left.
  CUTLASS_DEVICE int seek(int item, VirtualTile& tile, int& h) const {
    for (; item < num_items; item += int(gridDim.x)) {
      tile = at(item, h);
      if (tile.valid) break;
    }
    return item;
  }
};

// A sequence's packed rows: queries from q0, key tiles from k0 (its first key minus `off`).
struct Sequence {
  int q0, k0, lq, lk, off;
};

// The example's mainloop with varlen loads and a per-(sequence, head) softmax scale.
struct VarlenMainloop : Base {
  using ClusterShape = Shape<Int<kCluster>, _1, _1>;  // the kernel's K/V pipeline spans the cluster
  using SmemLayoutK = Layouts::SmemLayoutK;
  using SmemLayoutV = Layouts::SmemLayoutV;
  using TiledMmaQK = Layouts::TiledMmaQK;
  struct Params : Base::Params {
    const int* cu_q;
    const int* cu_k;
    const float* q_scale;  // NULL: 1
    const float* k_scale;
    int q_scale_stride, k_scale_stride;
    int group;  // Hq / Hkv
    int causal;
    float softmax_scale;
    // paged kernels: the caches as TMA tensors (encode_pages; line_stride > 0: seen as one line of
    // tokens, whose blocks start line_stride tokens apart);
    // block_tables [num_seqs, max_blocks] (row stride), seq_lens [num_seqs]
    cute::TmaDescriptor k_pages, v_pages;
    const int* block_tables;
    const int* seq_lens;
    int64_t block_table_stride;
    int max_blocks, block_size, num_blocks, box_rows_log2, line_stride;
    // kTransposeV: V token-major, read as K is (the example's tma_load_v is then unused);
    // persistent: the byte offsets of the K/V and Q pipelines' barriers from the mainloop's storage
    typename Base::TMA_K tma_load_v_tokens;
    int inner_pipeline_offset, outer_pipeline_offset;
    WorkOrder order;  // the scheduler's: the persistent cluster kernels' load warp looks ahead in it
  };

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if constexpr (kPaged) {
      cute::prefetch_tma_descriptor(&params.k_pages);
      cute::prefetch_tma_descriptor(&params.v_pages);
    }
  }

  template <class BlkCoord>
  CUTLASS_DEVICE static Sequence sequence(BlkCoord const& blk, Params const& p) {
    int b = get<2, 0>(blk);
    int q0 = p.cu_q[b];
    // a length past the block table is clamped into it (as the Triton kernels clamp it)
    if constexpr (kPaged) return {q0, 0, p.cu_q[b + 1] - q0, min(max(p.seq_lens[b], 0), p.max_blocks * p.block_size), 0};
    int k0 = p.cu_k[b], off = k0 % kKeyAlign;
    return {q0, k0 - off, p.cu_q[b + 1] - q0, p.cu_k[b + 1] - k0, off};
  }

  template <class ProblemShape>
  CUTLASS_DEVICE static SeqShape seq_shape(Sequence const& s, ProblemShape const& problem, Params const& p) {
    return SeqShape{1, get<1>(problem), s.lq, s.lk, get<4>(problem), p.causal, s.off};
  }

  // TMA (source, smem destination) partitions of this tile's Q rows (one block per consumer
  // warpgroup) and of its sequence's K and V tiles.
  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE static auto q_state(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                     SharedStorage& storage) {
    using X = Underscore;
    Sequence seq = sequence(blk, params);
    int h = get<2, 1>(blk);
    Tensor mQ = domain_offset(make_coord(seq.q0, _0{}, make_coord(_0{}, _0{})),
                              params.tma_load_q.get_tma_tensor(make_shape(get<2>(problem), get<4>(problem), heads(problem))));
    Tensor gQ_all = local_tile(mQ, TileShapeQK{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, _, _0{}, make_coord(_0{}, h));
    Tensor gQ = make_tensor(gQ_all.data() + NumMmaWarpGroups * int(get<0>(blk)) * stride<2>(gQ_all), gQ_all.layout());
    return tma_state(params.tma_load_q, make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{}), gQ);
  }

  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE static auto kv_state(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                      SharedStorage& storage, Sequence const& seq) {
    using X = Underscore;
    int hk = get<2, 1>(blk) / params.group, tk = get<3>(problem), d = get<4>(problem);
    Tensor mK = domain_offset(make_coord(seq.k0, _0{}, make_coord(_0{}, _0{})),
                              params.tma_load_k.get_tma_tensor(make_shape(tk, d, heads(problem))));
    Tensor gK = local_tile(mK, TileShapeQK{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, _, _0{}, make_coord(_0{}, hk));
    auto sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    if constexpr (kTransposeV) {  // raw V tiles land in stages laid out as K's
      Tensor mV = domain_offset(make_coord(seq.k0, _0{}, make_coord(_0{}, _0{})),
                                params.tma_load_v_tokens.get_tma_tensor(make_shape(tk, d, heads(problem))));
      Tensor gV = local_tile(mV, TileShapeQK{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, _, _0{}, make_coord(_0{}, hk));
      return make_tuple(tma_state(params.tma_load_k, sK, gK), tma_state(params.tma_load_v_tokens, sK, gV));
    } else {
      Tensor mV = domain_offset(make_coord(_0{}, seq.k0, make_coord(_0{}, _0{})),
                                params.tma_load_v.get_tma_tensor(make_shape(d, tk, heads(problem))));
      Tensor gV = local_tile(mV, TileShapePV{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, _0{}, _, make_coord(_0{}, hk));
      return make_tuple(tma_state(params.tma_load_k, sK, gK),
                        tma_state(params.tma_load_v, make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{}), gV));
    }
  }

  template <class ProblemShape>
  CUTLASS_DEVICE static auto heads(ProblemShape const& problem) { return make_shape(1, get<1>(problem)); }

  template <class Tma, class Smem, class Gmem>
  CUTLASS_DEVICE static auto tma_state(Tma const& tma, Smem smem, Gmem g) {
    auto slice = tma.get_slice(0);
    return make_tuple(slice.partition_S(g), slice.partition_D(smem));
  }

  // The tile's Q blocks, one per consumer warpgroup, issued by the elected lane: `next` issues one
  // (once a stage is free), `rest` the ones left.
  template <class StateQ>
  struct QBlocks {
    StateQ state;
    LoadQ load;
    decltype(make_coord_iterator(Int<NumMmaWarpGroups>{})) iter;
    int left;
    int lane_predicate;
    CUTLASS_DEVICE void next(PipelineStateQ& write) { load.step(iter, state, write, lane_predicate, left); }
    CUTLASS_DEVICE void rest(PipelineStateQ& write) {
      while (left > 0) next(write);
    }
  };

  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE static auto q_blocks(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                      MainloopPipelineQ& pipeline_q, SharedStorage& storage, int lane_predicate) {
    auto state = q_state(blk, params, problem, storage);
    return QBlocks<decltype(state)>{state, LoadQ{params.tma_load_q, pipeline_q, storage.smem_q},
                                    make_coord_iterator(Int<NumMmaWarpGroups>{}), NumMmaWarpGroups, lane_predicate};
  }

  // The K/V load warp. Non-persistent (kLoadQ): it loads Q too, the first K tile and the first Q
  // block before anything else so that the first QK^T starts as early as possible. Persistent:
  // the Q warp (load_maybe_q) loads Q, and on a CTA's first tile this warp waits until the first
  // Q block is issued before it issues V (the same order); later tiles' K/V loads run ahead into
  // the free pipeline stages while the consumers finish the previous tile.
  template <bool kLoadQ, class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_kv_maybe_q(int, BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                      MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                      MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_write_q,
                                      SharedStorage& storage, LoadWarpBarrier& q_issued, bool first_tile) {
    static_assert(kLoadQ != kPersistent, "the persistent kernel loads Q in its own warp");
    Sequence seq = sequence(blk, params);
    int trips = VarlenMask{}.get_trip_count(blk, TileShape{}, seq_shape(seq, problem, params));
    if constexpr (kPaged) {
      load_paged<kLoadQ>(blk, params, problem, pipeline, smem_pipe_write, pipeline_q, smem_pipe_write_q, storage,
                         q_issued, first_tile, seq, trips);
    } else if constexpr (kTransposeV) {
      load_transposing(blk, params, problem, pipeline, smem_pipe_write, storage, q_issued, first_tile, seq, trips);
    } else {
      auto state_kv = kv_state(blk, params, problem, storage, seq);
      LoadK load_k{params.tma_load_k, pipeline, storage.smem_k};
      LoadV load_v{params.tma_load_v, pipeline, storage.smem_v};
      int lane_predicate = cute::elect_one_sync();
      auto k_iter = make_coord_iterator(trips);
      int k_count = 2 * trips;  // K and V tiles share the pipeline

      if constexpr (kLoadQ) {
        auto q = q_blocks(blk, params, problem, pipeline_q, storage, lane_predicate);
        q.next(smem_pipe_write_q);
        load_k.template step<false>(k_iter, get<0>(state_kv), smem_pipe_write, lane_predicate, k_count);
        q.rest(smem_pipe_write_q);
      } else {
        load_k.template step<false>(k_iter, get<0>(state_kv), smem_pipe_write, lane_predicate, k_count);
        if (first_tile) {
          q_issued.arrive();
          q_issued.wait(0);
        }
      }
      load_v.template step<true>(k_iter, get<1>(state_kv), smem_pipe_write, lane_predicate, k_count);
      CUTLASS_PRAGMA_NO_UNROLL
      while (k_count > 0) {
        load_k.template step<false>(k_iter, get<0>(state_kv), smem_pipe_write, lane_predicate, k_count);
        load_v.template step<true>(k_iter, get<1>(state_kv), smem_pipe_write, lane_predicate, k_count);
      }
    }
  }

  // The K/V load warp of the kernels that transpose V (kTransposeV, persistent): K_j, raw V_j and
  // the transposed V_j take three consecutive pipeline stages; this warp loads the first two by TMA
  // and skips the third, which the transposing warps fill (transpose_tiles). Every lane tracks the
  // stages (the elected lane alone issues the copies).
  template <class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_transposing(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                       MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                       SharedStorage& storage, LoadWarpBarrier& q_issued, bool first_tile,
                                       Sequence const& seq, int trips) {
    auto state_kv = kv_state(blk, params, problem, storage, seq);
    int lane_predicate = cute::elect_one_sync();
    auto load = [&](auto const& tma, auto const& state, int tile) {
      if (lane_predicate) {
        pipeline.producer_acquire(smem_pipe_write);
        copy(tma.with(*pipeline.producer_get_barrier(smem_pipe_write)), get<0>(state)(_, _, _, tile),
             get<1>(state)(_, _, _, smem_pipe_write.index()));
      }
      ++smem_pipe_write;
    };
    load(params.tma_load_k, get<0>(state_kv), 0);
    if (first_tile) {  // as in load_kv_maybe_q
      q_issued.arrive();
      q_issued.wait(0);
    }
    load(params.tma_load_v_tokens, get<1>(state_kv), 0);
    ++smem_pipe_write;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int tile = 1; tile < trips; tile++) {
      load(params.tma_load_k, get<0>(state_kv), tile);
      load(params.tma_load_v_tokens, get<1>(state_kv), tile);
      ++smem_pipe_write;
    }
  }

  // kTransposeV: two warps of the producer warpgroup transpose the V tiles, in turns: the
  // otherwise idle "reducer" warp (the example's kernel calls reduce once per work tile) the even
  // ones and the Q warp the odd ones (one warp alone: FP8 S = 2k 699 -> 578 TF/s, H200).
  // value_tiles_ counts each warp's V tiles across the work tiles of a persistent CTA. The example's
  // kernel gives neither warp a handle on the K/V pipeline, whose barriers lie at a fixed offset
  // (inner_pipeline_offset) from the mainloop's shared storage.
  int value_tiles_ = 0;

  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer>
  CUTLASS_DEVICE void reduce(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                             PipelineReducer&, PipelineStateReducer&, SharedStorage& storage) {
    if constexpr (kTransposeV) transpose_tiles(blk, params, problem, storage, 0);
  }

  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE void transpose_tiles(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                      SharedStorage& storage, int parity) {
    auto& barriers = *reinterpret_cast<typename MainloopPipeline::SharedStorage*>(
        reinterpret_cast<char*>(&storage) + params.inner_pipeline_offset);
    typename MainloopPipeline::Params view;
    view.role = MainloopPipeline::ThreadCategory::ProducerConsumer;
    view.num_consumers = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
    MainloopPipeline pipeline(barriers, view, ClusterShape{}, cute::false_type{});  // initialized by the kernel
    int trips = VarlenMask{}.get_trip_count(blk, TileShape{}, seq_shape(sequence(blk, params), problem, params));
    CUTLASS_PRAGMA_NO_UNROLL
    for (int tile = 0; tile < trips; tile++, value_tiles_++) {
      if ((value_tiles_ & 1) != parity) continue;
      int raw = 3 * value_tiles_ + 1;  // K_j, raw V_j, V_j: stages 3j, 3j + 1, 3j + 2 (j counted per CTA)
      constexpr int S = MainloopPipeline::Stages;
      transpose_value(pipeline, PipelineState(raw % S, (raw / S) & 1, raw),
                      PipelineState((raw + 1) % S, ((raw + 1) / S & 1) ^ 1, raw + 1), storage);
    }
  }

  // One V tile from the raw stage (keys x D, laid out as K) into the transposed stage (SmemLayoutV:
  // D x keys, with the keys of every 16 interleaved as probabilities_operand wants: position 4c + i
  // holds key 2c + (i & 1) + 8 (i >> 1)), by the whole warp, 16 keys x 32 dims per step. The
  // transposing ldmatrix gives lane (r = lane / 4, c = lane % 4) the 16-bit dim pairs (2r, 2r + 1)
  // of keys 2c, 2c + 1 (one register) and 2c + 8, 2c + 9 (another) in each of two 16-dim chunks;
  // two byte permutes per chunk make the words of positions 4c .. 4c + 3 for dims 2r and 2r + 1,
  // as stmatrix wants them (the 4 lanes of a row hold its 16 positions). Lanes of rows r >= 4 swap
  // their two dims, so that each stored 8 x 16-byte matrix has 8 distinct dims mod 8: no bank
  // conflicts, as the ldmatrix rows (8 keys) have none (the addresses were checked against CuTe's
  // layouts on the host). The raw stage goes back to the load warp's
  // TMA (its empty barrier counts the consumers' 256 arrivals), the transposed one to the
  // consumers (its full barrier waits for one arrival, with no TMA bytes).
  template <class Pipeline>
  CUTLASS_DEVICE static void transpose_value(Pipeline& pipeline, PipelineState raw, PipelineState transposed,
                                             SharedStorage& storage) {
    constexpr int kBlockN = get<1>(TileShape{});
    static_assert(!kTransposeV || (kHeadDim == 128 && kBlockN == 128),
                  "transpose_value knows the stage layouts of FP8 D = 128 at 128 keys");
    constexpr int kStageBytes = kBlockN * kHeadDim;
    uint32_t src = cute::cast_smem_ptr_to_uint(storage.smem_k.data()) + raw.index() * kStageBytes;
    uint32_t dst = cute::cast_smem_ptr_to_uint(storage.smem_v.data()) + transposed.index() * kStageBytes;
    if ((src | dst) % 1024) __trap();  // the addresses below take the swizzle atoms from 0 mod 1024
    // lane i addresses row i % 8 of 8 x 16-byte matrix i / 8 for both ldmatrix and stmatrix
    int lane = cutlass::canonical_lane_idx(), m = lane >> 3, row = lane & 7;
    uint32_t even = lane < 16 ? 0x6420 : 0x7531, odd = lane < 16 ? 0x7531 : 0x6420;  // (lane / 4 < 4)
    pipeline.consumer_wait(raw);
    // the transposed stage's producer wait (producer_acquire would also expect TMA bytes)
    while (pipeline.producer_try_acquire(transposed).get() != cutlass::BarrierStatus::WaitDone) {
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (int q = 0; q < kHeadDim / 32; q++) {
      // ldmatrix: key 8 (m % 2) + row of block 0, 16-dim chunk 2q + m / 2 (raw rows: chunk ^= key % 8)
      uint32_t from = src + (8 * (m & 1) + row) * 128 + (((2 * q + (m >> 1)) ^ row) << 4);
      // stmatrix: dim 32q + 16 (m / 2) + 2 row, + 1 for odd m (rows >= 4: for even m)
      int dim = 32 * q + 16 * (m >> 1) + 2 * row + ((m & 1) ^ int(row >= 4));
      // block b's 16 positions of row `dim` (rows of 128 bytes, chunk ^= row % 8)
      auto to = [&](int b) { return dst + dim * 128 + ((b ^ (dim & 7)) << 4); };
      CUTLASS_PRAGMA_NO_UNROLL
      for (int b = 0; b < kBlockN / 16; b += 2) {  // two blocks per step, loads first
        uint32_t x[8];
        ldmatrix_trans(from + b * 2048, x);
        ldmatrix_trans(from + (b + 1) * 2048, x + 4);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 2; i++) {
          uint32_t* y = x + 4 * i;
          stmatrix(to(b + i), __byte_perm(y[0], y[1], even), __byte_perm(y[0], y[1], odd),
                   __byte_perm(y[2], y[3], even), __byte_perm(y[2], y[3], odd));
        }
      }
    }
    cutlass::arch::fence_view_async_shared();  // the stores, visible to the consumers' wgmma reads
    __syncwarp();
    if (lane == 0) cutlass::arch::ClusterBarrier::arrive(pipeline.producer_get_barrier(transposed));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; i++) pipeline.consumer_release(raw);  // 32 lanes x 8 = the 256 consumer arrivals
  }

  // x[0..3] = four 8 x 8 16-bit matrices at the rows the lanes address, transposed (ldmatrix)
  CUTLASS_DEVICE static void ldmatrix_trans(uint32_t address, uint32_t* x) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                 : "r"(address));
  }
  CUTLASS_DEVICE static void stmatrix(uint32_t address, uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(x0), "r"(x1),
                 "r"(x2), "r"(x3));
  }

  // The paged kernels' load warp: Q block 0, K0, Q block 1, V0, K1, V1, ... as above (persistent:
  // K0, V0, K1, ...), each K/V tile gathered from the cache by load_paged_tile.
  template <bool kLoadQ, class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_paged(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                 MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                 MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_write_q,
                                 SharedStorage& storage, LoadWarpBarrier& q_issued, bool first_tile,
                                 Sequence const& seq, int trips) {
    int lane_predicate = cute::elect_one_sync();
    auto q = q_blocks(blk, params, problem, pipeline_q, storage, lane_predicate);
    if constexpr (kLoadQ) q.next(smem_pipe_write_q);
    const int* table = params.block_tables + get<2, 0>(blk) * params.block_table_stride;
    int hk = get<2, 1>(blk) / params.group;
    Tensor stages = make_tensor(make_smem_ptr(storage.smem_k.data()), Layouts::SmemLayoutBoxes{});  // K or V
    CUTLASS_PRAGMA_NO_UNROLL
    for (int tile = 0; tile < trips; tile++) {
      // lane i looks up box i's cache block once for K and V, all lanes at once, so that the
      // table reads overlap each other and the wait for a free stage
      PagedBox box = paged_box(params, table, seq.lk, tile, hk);
      load_paged_tile(&params.k_pages, pipeline, smem_pipe_write, params, box, lane_predicate, stages);
      if constexpr (kLoadQ) {
        q.rest(smem_pipe_write_q);
      } else if (first_tile && tile == 0) {  // as in load_kv_maybe_q
        q_issued.arrive();
        q_issued.wait(0);
      }
      load_paged_tile(&params.v_pages, pipeline, smem_pipe_write, params, box, lane_predicate, stages);
    }
    // the peer CTA writes this CTA's stages and signals its barriers: stay until it has released
    // them all (persistent: after the CTA's last tile)
    if constexpr (kCluster > 1) {
      if (!kPersistent || !next_item(params.order)) pipeline.producer_tail(smem_pipe_write);
    }
  }

  // The load warp's walk over its CTA's items (persistent grid), one call per tile: whether a tile
  // follows the current one.
  int item_ = -1;
  CUTLASS_DEVICE bool next_item(WorkOrder const& order) {
    VirtualTile tile;
    int h;
    if (item_ < 0) item_ = order.seek(int(blockIdx.x), tile, h);  // the first tile
    item_ = order.seek(item_ + int(gridDim.x), tile, h);
    return item_ < order.num_items;
  }

  // Lane i's box of a key tile: its keys i * box_rows .. + box_rows - 1, consecutive tokens of one
  // cache block (box_rows divides block_size), as the coordinates of the cache's TMA tensor
  // (encode_pages) that are not dims: (row, head, block), or on a line (token, head) at D = 64 and
  // (token / 8, head) at D = 128. Boxes at or past the sequence's end, and block ids outside
  // [0, num_blocks), read block `num_blocks`, out of the tensor's bounds, which TMA fills with zeros;
  // the block table is read only below the end (and below max_blocks). Lanes past the tile's boxes
  // go unused.
  struct PagedBox {
    int c1, c2, c3;
  };

  CUTLASS_DEVICE static PagedBox paged_box(Params const& p, const int* table, int lk, int tile, int hk) {
    int key = tile * get<1>(TileShape{}) + (cutlass::canonical_lane_idx() << p.box_rows_log2);
    int block = p.num_blocks, row = 0;
    if (key < lk) {
      block = table[min(key / p.block_size, p.max_blocks - 1)];
      if (block < 0 || block >= p.num_blocks) block = p.num_blocks;
      row = key % p.block_size;
    }
    if (!p.line_stride) return {row, hk, block};
    int token = int(int64_t(block) * p.line_stride + row);
    return kHeadDim == 64 ? PagedBox{token, hk, 0} : PagedBox{token >> 3, hk, 0};
  }

  // One K or V tile into the next pipeline stage, lane i's box onto the stage's keys i * box_rows ..
  // (whole swizzle atoms): one TMA copy per lane (the elected lane alone issued
  // 16-token boxes 1.3x slower), completing on the stage's barrier once the elected lane has set the
  // expected bytes. In a cluster, CTA r issues the boxes i = r mod 2, multicast to the same stage of
  // both CTAs (whose consumers have both released it: the pipeline spans the cluster). All lanes
  // track the state.
  template <class Stages>
  CUTLASS_DEVICE static void load_paged_tile(cute::TmaDescriptor const* pages, MainloopPipeline& pipeline,
                                             PipelineState& state, Params const& p, PagedBox box,
                                             int lane_predicate, Stages& stages) {
    static_assert(!kPaged || get<1>(TileShape{}) / 8 <= 32, "one TMA box per lane");
    if (lane_predicate) pipeline.producer_acquire(state);
    __syncwarp();
    int lane = cutlass::canonical_lane_idx();
    bool mine = kCluster == 1 || lane % kCluster == int(cute::block_rank_in_cluster());
    if (lane < get<1>(TileShape{}) >> p.box_rows_log2 && mine) {
      auto* barrier = pipeline.producer_get_barrier(state);
      void* stage = &stages(lane << p.box_rows_log2, 0, state.index());
      if constexpr (kHeadDim == 64) {  // (64, tokens, Hkv) or (64, block_size, Hkv, blocks)
        if (p.line_stride) copy_box(pages, barrier, stage, 0, box.c1, box.c2);
        else copy_box(pages, barrier, stage, 0, box.c1, box.c2, box.c3);
      } else if (p.line_stride) {  // (64, 8, D / 64, tokens / 8, Hkv)
        copy_box(pages, barrier, stage, 0, 0, 0, box.c1, box.c2);
      } else {  // (64, block_size, D / 64, Hkv, blocks)
        copy_box(pages, barrier, stage, 0, box.c1, 0, box.c2, box.c3);
      }
    }
    ++state;
  }

  template <class... Coords>
  CUTLASS_DEVICE static void copy_box(cute::TmaDescriptor const* pages, uint64_t* barrier, void* stage, Coords... c) {
    auto hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    if constexpr (kCluster > 1) {
      SM90_TMA_LOAD_MULTICAST::copy(pages, barrier, uint16_t((1 << kCluster) - 1), hint, stage, c...);
    } else {
      SM90_TMA_LOAD::copy(pages, barrier, hint, stage, c...);
    }
  }

  // The Q warp of the persistent kernel: one Q block per consumer warpgroup, each as soon as that
  // warpgroup has released its previous tile's block (at the end of its mainloop, so the load
  // overlaps that tile's epilogue); then, with kTransposeV, the tile's odd V tiles.
  template <class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_maybe_q(BlkCoord const& blk, Params const& params, ProblemShape const& problem,
                                   MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_write_q,
                                   SharedStorage& storage, LoadWarpBarrier& q_issued, bool first_tile) {
    auto q = q_blocks(blk, params, problem, pipeline_q, storage, cute::elect_one_sync());
    q.next(smem_pipe_write_q);
    if (first_tile) {
      q_issued.arrive();
      q_issued.wait(0);
    }
    q.rest(smem_pipe_write_q);
    if constexpr (kTransposeV) transpose_tiles(blk, params, problem, storage, 1);
  }

  // One consumer warpgroup's rows (64 of the CTA's 128) against all of the CTA's key tiles, with
  // the softmax scale of this (sequence, head).
  template <class BlkCoord, class ProblemShape, class PipelineReducer, class PipelineStateReducer, class OrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk, BlkCoord const& wg, Params const& params, ProblemShape const& problem,
                              MainloopPipeline& pipeline, PipelineState& smem_pipe_read,
                              MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_read_q,
                              PipelineReducer& reducer, PipelineStateReducer& reducer_state, SharedStorage& storage,
                              OrderBarrier& order) {
    Sequence seq = sequence(blk, params);
    SeqShape seq_problem = seq_shape(seq, problem, params);
    int h = get<2, 1>(blk);
    float scale = params.softmax_scale;
    if (params.q_scale != nullptr) {
      scale *= params.q_scale[h * params.q_scale_stride] * params.k_scale[(h / params.group) * params.k_scale_stride];
    }
    typename Base::Params p = params;
    p.scale_softmax = scale;
    p.scale_softmax_log2 = scale * 1.4426950408889634f;
    if constexpr (kOverlapSoftmax) {
      // The example's kernel builds the Q pipeline for a cluster of one CTA: in a real cluster, its
      // consumer_release would signal the cluster's first CTA. The persistent kernels release each Q
      // stage on this CTA's own barrier instead (every thread of the warpgroup arrives, as in a
      // pipeline of one CTA).
      auto& q_barriers = *reinterpret_cast<typename MainloopPipelineQ::SharedStorage*>(
          reinterpret_cast<char*>(&storage) + params.outer_pipeline_offset);
      return compute_overlapped(blk, wg, p, seq_problem, 1 << params.box_rows_log2, pipeline, smem_pipe_read,
                                pipeline_q, smem_pipe_read_q, q_barriers.empty_barrier_, storage, order);
    } else {
      return Base::compute(blk, wg, p, seq_problem, pipeline, smem_pipe_read, pipeline_q, smem_pipe_read_q,
                           reducer, reducer_state, storage, order);
    }
  }

  // The probabilities (QK^T accumulator layout, fp32) as the e4m3 A operand of the PV product.
  // In the accumulator a thread holds, per row and per 16 keys, the columns 2c, 2c + 1, 2c + 8,
  // 2c + 9 (c = lane % 4); the A operand wants 4 consecutive k positions 4c .. 4c + 3 in one
  // register. V's tokens are interleaved so that k position 4c + i is exactly that column
  // (torch_ops/kernels/transpose.py), so each register packs a row's two column pairs of
  // adjacent 8-column blocks: 4 converts and no exchange between threads per 8 values (the
  // example's make_acc_into_op converts one value at a time and exchanges across the quad).
  // Storage: accumulator registers 8m .. 8m + 7 are blocks 2m, 2m + 1 as (row g, row g + 8) x
  // (2c, 2c + 1); operand registers 2m, 2m + 1 are rows g and g + 8 of those 16 k positions.
  template <class AccQK>
  CUTLASS_DEVICE static auto probabilities_operand(AccQK const& acc) {
    using namespace cutlass::fmha::collective;
    Tensor op = make_fragment_like<Element>(
        convert_c_layout_to_a_layout(acc.layout(), shape<1>(typename TiledMmaPV::LayoutA_TV{})));
    uint32_t* words = reinterpret_cast<uint32_t*>(raw_pointer_cast(op.data()));
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size(acc) / 8; m++) {
      words[2 * m] = e4m3x4(acc(8 * m), acc(8 * m + 1), acc(8 * m + 4), acc(8 * m + 5));
      words[2 * m + 1] = e4m3x4(acc(8 * m + 2), acc(8 * m + 3), acc(8 * m + 6), acc(8 * m + 7));
    }
    return op;
  }

  // Zeroes the V rows [valid, valid rounded up to box_rows) of stage `stage` (the paged kernels'
  // last tile): the box holding a sequence's last key also reads the block's slots after it,
  // which may hold anything (NaN in a fresh cache), and P = 0 does not cancel NaN in P V. Boxes
  // wholly past the end arrive zero-filled. Both warpgroups write the same zeros, each then
  // syncing its own 128 threads before its product reads the stage.
  CUTLASS_DEVICE static void zero_value_tail(SharedStorage& storage, int stage, int valid, int box_rows, int wg) {
    constexpr int kBlockN = get<1>(TileShape{});
    constexpr int kChunk = 16 / sizeof(Element);  // dims per 16-byte store
    constexpr int kChunks = kHeadDim / kChunk;    // per key
    int end = min(kBlockN, (valid + box_rows - 1) & -box_rows);
    if (valid >= end) return;  // the same for every thread
    Tensor stages = make_tensor(make_smem_ptr(storage.smem_v.data()), Layouts::SmemLayoutBoxes{});  // (key, dim, stage)
    for (int i = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup; i < (end - valid) * kChunks;
         i += cutlass::NumThreadsPerWarpGroup) {
      int key = valid + i / kChunks, dim = i % kChunks * kChunk;
      *reinterpret_cast<uint4*>(&stages(key, dim, stage)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();  // visible to the tensor cores' (async proxy) reads
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, wg);
  }

  // The QK^T of key tile j is issued before the PV product of tile j - 1, and the source runs tile
  // j's softmax before waiting for that product (FA3's intra-warpgroup overlap). ptxas moves the wait
  // above the softmax, though, to interleave the P conversion (which rewrites the product's operand
  // registers) with the exps: each warpgroup overlaps the other's products, not its own. Forcing the
  // source order (a block boundary before the wait) runs 0.87-1.00x, and a row max in four
  // chains 0.94-1.00x (H200). As in the example, only the first QK^T takes the warpgroup ordering
  // barrier (so that the two warpgroups start staggered); locking every tile's pair of issues
  // (ping-pong) gains nothing (within 1%), nor do 6-8 K/V stages. K and V tiles share the pipeline,
  // read in the order K0 V0 K1 V1 ... (with kTransposeV each V stage follows its raw V stage, which
  // the load warp consumes); tile j's K stage is released once its QK^T has completed, its V stage
  // once its PV product has.
  template <class BlkCoord, class OrderBarrier>
  CUTLASS_DEVICE auto compute_overlapped(BlkCoord const& blk, BlkCoord const& wg, typename Base::Params const& p,
                                         SeqShape const& seq_problem, int box_rows,
                                         MainloopPipeline& pipeline, PipelineState& smem_pipe_read,
                                         MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_read_q,
                                         cutlass::arch::ClusterBarrier* q_empty, SharedStorage& storage,
                                         OrderBarrier& order) {
    using namespace cutlass::fmha::collective;
    float const scale_log2 = p.scale_softmax_log2;
    int thread_idx = int(threadIdx.x);
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{})));
    Tensor tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{})));
    Tensor tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{})));
    auto q_stage = tSrQ(_, _, _, smem_pipe_read_q.index());

    // (row, key) of each accumulator element, for the masks
    Tensor tPcP = thr_qk.partition_C([] {
      if constexpr (kBlockBoxes) return make_coord_tensor(BlockBoxes::KeyCoordinates{});
      else return make_identity_tensor(take<0, 2>(TileShapeQK{}));
    }());
    tPcP.data() = tPcP.data() + E<0>{} * int(get<0>(wg)) * get<0>(TileShapeQK{});

    Tensor acc_pv = partition_fragment_C(mma_pv, take<0, 2>(TileShapePV{}));
    clear(acc_pv);  // rescaled before the first PV product too: it stays 0
    CollectiveSoftmax<float, VarlenMask, typename Base::Params> softmax{p};
    auto state = softmax.init(acc_pv, mma_pv);
    auto& row_max = get<0>(state);
    auto& row_sum = get<1>(state);  // per thread; reduced across the row's threads in softmax.tail
    Tensor correction = make_fragment_like(row_max);
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);

    auto acc_mn = [](auto& acc, auto const& mma) { return make_tensor(acc.data(), layout_acc_mn(mma, acc.layout())); };
    auto reduction = reduction_target_n(mma_qk);
    // scores -> exp2(scale * (s - max)) in place; `correction` = exp2(scale * (old max - new max))
    auto softmax_step = [&](auto& acc_s) {
      Tensor s = acc_mn(acc_s, mma_qk);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(s); i++) {
        float m = row_max(i);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); j++) m = fmaxf(m, s(i, j));
        for_each(make_seq<decltype(rank(reduction))::value>{}, [&](auto r) {
          CUTLASS_PRAGMA_UNROLL
          for (int k = 1; k < shape<r>(reduction); k *= 2) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, stride<r>(reduction) * k));
          }
        });
        float m_use = m == -INFINITY ? 0.f : m;
        correction(i) = exp2f((row_max(i) - m_use) * scale_log2);
        row_max(i) = m;
        float bias = m_use * scale_log2, sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(s); j++) {
          s(i, j) = exp2f(s(i, j) * scale_log2 - bias);
          sum += s(i, j);
        }
        row_sum(i) = row_sum(i) * correction(i) + sum;
      }
    };
    auto rescale_output = [&]() {
      Tensor o = acc_mn(acc_pv, mma_pv);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(o); i++) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(o); j++) o(i, j) *= correction(i);
      }
    };

    int trips = VarlenMask{}.get_trip_count(blk, TileShape{}, seq_problem);
    int unmasked = VarlenMask{}.get_unmasked_trip_count(blk, TileShape{}, seq_problem);

    pipeline_q.consumer_wait(smem_pipe_read_q);

    // tile 0: QK^T and softmax; its PV product is issued with tile 1's QK^T
    PipelineState k_read = smem_pipe_read;
    PipelineState v_read = k_read;
    ++v_read;
    if constexpr (kTransposeV) ++v_read;  // past the raw V stage
    Tensor acc_s = partition_fragment_C(mma_qk, take<0, 2>(TileShapeQK{}));
    auto issue_qk = [&]() {  // acc_s = Q K[k_read]^T
      pipeline.consumer_wait(k_read);
      warpgroup_fence_operand(acc_s);
      warpgroup_arrive();
      gemm_zero_acc(mma_qk, q_stage, tSrK(_, _, _, k_read.index()), acc_s);
      warpgroup_commit_batch();
    };
    order.wait();
    issue_qk();
    order.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    pipeline.consumer_release(k_read);
    VarlenMask{}.before_softmax(acc_s, tPcP, seq_problem);
    softmax_step(acc_s);
    auto to_operand = [](auto const& acc) {
      if constexpr (kFp8) {
        return probabilities_operand(acc);
      } else {  // 16-bit: the accumulator's layout is already the A operand's
        return make_acc_into_op<Element>(acc, typename TiledMmaPV::LayoutA_TV{});
      }
    };
    Tensor p_op = to_operand(acc_s);
    auto issue_pv = [&](bool last) {  // acc_pv = acc_pv * correction + P V[v_read]
      rescale_output();
      pipeline.consumer_wait(v_read);
      if constexpr (kPaged) {
        if (last) zero_value_tail(storage, v_read.index(), get<3>(seq_problem) - (trips - 1) * get<1>(TileShape{}),
                                  box_rows, int(get<0>(wg)) % NumMmaWarpGroups);
      }
      warpgroup_fence_operand(acc_pv);
      warpgroup_fence_operand(p_op);
      warpgroup_arrive();
      cute::gemm(mma_pv, p_op, tOrV(_, _, _, v_read.index()), acc_pv);
      warpgroup_commit_batch();
    };

    CUTLASS_PRAGMA_NO_UNROLL
    for (int j = 1; j < trips; j++) {
      k_read = v_read;
      ++k_read;
      tPcP.data() = tPcP.data() + E<1>{} * get<1>(TileShapeQK{});
      issue_qk();
      issue_pv(false);  // of tile j - 1
      warpgroup_wait<1>();  // this tile's QK^T is done, the PV product may still run
      warpgroup_fence_operand(acc_s);
      pipeline.consumer_release(k_read);
      if (j >= unmasked) VarlenMask{}.before_softmax(acc_s, tPcP, seq_problem);
      softmax_step(acc_s);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_pv);
      pipeline.consumer_release(v_read);
      v_read = k_read;
      ++v_read;
      if constexpr (kTransposeV) ++v_read;
      p_op = to_operand(acc_s);
    }
    if constexpr (kIsPersistent) q_empty[smem_pipe_read_q.index()].arrive();  // free for the next tile (see compute)

    issue_pv(true);  // of the last tile
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_pv);
    pipeline.consumer_release(v_read);
    ++v_read;
    smem_pipe_read = v_read;

    Tensor lse = softmax.tail(state, acc_pv, mma_pv);
    return make_tuple(acc_pv, lse);
  }
};

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

#if !ATTN_PERSISTENT
// One CTA per work item (WorkOrder). The host picks one head per section (head by head: the
// running CTAs share a head's K/V in L2) or, for causal grids of few waves, as many heads as fit
// their K/V in L2, so that the heaviest tiles of all those heads start first
// (torch_ops/cutlass.py `sectioned`). A CTA with a spare tile exits. In clusters of 2 (even
// sections), items 2i and 2i + 1 are heads h, h + 1 of one tile and KV head.
struct Scheduler {
  using Params = WorkOrder;

  VirtualTile tile;
  int h;

  CUTLASS_DEVICE Scheduler(Params const& p) {
    tile = p.at(int(blockIdx.x), h);
    if (!tile.valid) asm volatile("exit;");   // every thread of the CTA, before any barrier is set up
  }

  static dim3 get_grid_shape(Params const& p) { return dim3(p.num_items, 1, 1); }
  CUTLASS_DEVICE bool is_valid() const { return tile.valid; }
  CUTLASS_DEVICE auto get_block_coord() const { return make_coord(tile.m_block, _0{}, make_coord(tile.b, h)); }
  CUTLASS_DEVICE Scheduler& operator++() {
    tile.valid = false;
    return *this;
  }
};

using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<VarlenMainloop, VarlenEpilogue, Scheduler>;
#else
// Persistent: `num_ctas` CTAs (one per SM), CTA c runs work items c, c + num_ctas, c + 2 num_ctas, ...
// (WorkOrder), with heads of a section chosen on the host so that their K/V fit in L2; causal
// tiles, heaviest first, leave the shortest for the tail. Every warp of a CTA walks the same
// sequence of items, so the producer and consumer warps agree on each tile without talking to
// each other. In clusters of 2 (even num_ctas and sections) CTAs 2j and 2j + 1 run heads h, h + 1
// of the same tiles.
struct Scheduler {
  using Params = WorkOrder;

  Params const& p;
  VirtualTile tile;
  int h;
  int item;

  CUTLASS_DEVICE Scheduler(Params const& params) : p(params), item(p.seek(int(blockIdx.x), tile, h)) {}

  static dim3 get_grid_shape(Params const& p) { return dim3(p.num_ctas, 1, 1); }
  CUTLASS_DEVICE bool is_valid() const { return item < p.num_items; }
  CUTLASS_DEVICE auto get_block_coord() const { return make_coord(tile.m_block, _0{}, make_coord(tile.b, h)); }
  CUTLASS_DEVICE Scheduler& operator++() {
    item = p.seek(item + int(gridDim.x), tile, h);
    return *this;
  }
};

// A separate Q load warp, so that the K/V loads of a CTA's next tile need not wait for its Q.
using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<VarlenMainloop, VarlenEpilogue, Scheduler,
                                                                   Option<Tag::kLoadsQSeparately, true_type>>;
#endif

// The kernel's problem shape is (B, Hq, total_q, total_k, D); `causal` rides in the mainloop params.
static_assert(std::is_same_v<Kernel::ProblemShape, cute::tuple<int, int, int, int, int>>);
// The staged epilogue's storage of warpgroup i is its Q block (see VarlenEpilogue).
static_assert(kPersistent || (sizeof(VarlenEpilogue::TensorStorage) * VarlenMainloop::NumMmaWarpGroups ==
                                  sizeof(VarlenMainloop::SharedStorage::smem_q) &&
                              offsetof(VarlenMainloop::SharedStorage, smem_q) == 0 &&
                              offsetof(Kernel::SharedStorage, tensors) == 0),
              "epilogue storage i must lie over Q block i");

// kTransposeV kernels read V through tma_load_v_tokens; the example's (transposed) V descriptor
// then gets a stand-in layout over V's memory, never read: tokens contiguous, padded to 16.
auto value_stride(AttnFmhaArgs const& a) {
  if constexpr (kTransposeV) {
    int padded = (max(a.total_k, 1) + 15) / 16 * 16;
    return make_stride(_1{}, padded, make_stride(0, padded * kHeadDim));
  } else if constexpr (kFp8) {
    return make_stride(_1{}, int(a.v_dim_stride), make_stride(0, int(a.v_head_stride)));
  } else {
    return make_stride(int(a.v_row_stride), _1{}, make_stride(0, int(a.v_head_stride)));
  }
}

// A paged cache [num_blocks, block_size, Hkv, D] (strides in elements) as a TMA tensor whose boxes
// land whole swizzle atoms of the stages (Layouts::SmemLayoutBoxes, 128-byte swizzle); coordinates
// past it read zeros. With line_stride (blocks starting line_stride tokens apart: block_size for a
// cache of its own, 2 x block_size for the K and V halves of one [num_blocks, 2, block_size, Hkv, D]
// tensor; a multiple of 8 at D = 128) as one line of tokens: at D = 128 (64 dims, 8 tokens, D / 64,
// tokens / 8, Hkv) in boxes of (64, 8, D / 64, box_rows / 8, 1), at D = 64 (64, tokens, Hkv) in
// boxes of (64, box_rows, 1). Otherwise (line_stride 0) (64, block_size, D / 64, Hkv, num_blocks)
// in boxes of (64, box_rows, D / 64, 1, 1), without the D / 64 dim at D = 64: where the blocks lie
// otherwise (8-token boxes at D = 128); BlockBoxes (16-token boxes) always.
bool encode_pages(cute::TmaDescriptor* map, void const* cache, int64_t row_stride, int64_t head_stride,
                  int64_t block_stride, int64_t line_stride, AttnFmhaArgs const& a) {
  constexpr int64_t kBytes = sizeof(Element);
  constexpr cuuint32_t kBoxDims = 128 / kBytes, kHalves = kHeadDim / kBoxDims;
  cuuint64_t row = row_stride * kBytes, head = head_stride * kBytes, block = block_stride * kBytes;
  cuuint64_t heads = a.hkv, blocks = a.num_blocks, rows = a.block_size;
  cuuint32_t box_rows = a.box_rows;
  cuuint64_t tokens = (blocks - 1) * line_stride + rows;
  std::array<cuuint64_t, 5> dims;
  std::array<cuuint64_t, 4> strides;
  std::array<cuuint32_t, 5> box, unit = {1, 1, 1, 1, 1};
  int rank = 5;
  if (kHalves == 1) {  // ranks 3 and 4: 1.01-1.02x rank 5 (H200)
    rank = line_stride ? 3 : 4;
    dims = {kBoxDims, line_stride ? tokens : rows, heads, blocks};
    strides = {row, head, block};
    box = {kBoxDims, box_rows, 1, 1};
  } else if (line_stride) {
    dims = {kBoxDims, 8, kHalves, tokens / 8, heads};
    strides = {row, 128, 8 * row, head};
    box = {kBoxDims, 8, kHalves, box_rows / 8, 1};
  } else {
    dims = {kBoxDims, rows, kHalves, heads, blocks};
    strides = {row, 128, head, block};
    box = {kBoxDims, box_rows, kHalves, 1, 1};
  }
  auto type = std::is_same_v<Element, cutlass::half_t> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, type, rank, const_cast<void*>(cache), dims.data(), strides.data(), box.data(), unit.data(),
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int run(AttnFmhaArgs const& a, cudaStream_t stream, char* err, int err_len) {
  auto fail = [&](char const* what) {
    snprintf(err, err_len, "%s", what);
    return 1;
  };
  if (a.head_dim != kHeadDim) return fail("head_dim does not match this kernel");
  int out_bytes = a.out_dtype == ATTN_OUT_E4M3 ? 1 : 2;
  if (reinterpret_cast<uintptr_t>(a.out) % 16 || a.out_row_stride * out_bytes % 16 || a.out_head_stride * out_bytes % 16) {
    return fail("out needs a 16-byte aligned base and row/head strides");
  }
  if (a.num_seqs < 1 || a.hq % a.hkv != 0 || a.skip_q_len < 0) return fail("bad num_seqs, head counts or skip_q_len");
  int tq = a.total_q, tk = a.total_k, d = a.head_dim;
  auto heads = [](int64_t head_stride) { return make_stride(0, int(head_stride)); };
  StrideQK dQ{int(a.q_row_stride), _1{}, heads(a.q_head_stride)};
  StrideQK dK{int(a.k_row_stride), _1{}, heads(a.k_head_stride)};
  StrideV dV = value_stride(a);
  // One TMA descriptor per tensor over all packed tokens; the K/V descriptors span Hq "heads" of
  // which only the first Hkv are ever addressed (a CTA of query head h reads KV head h / group).
  // The paged kernels read K/V through their own descriptors (k_pages, v_pages); these two then
  // cover the caches' first block, valid and never used.
  auto packed = make_shape(1, a.hq, tq, kPaged ? a.block_size : max(tk, 1), d);
  Base::Arguments tensors{static_cast<Element const*>(a.q), dQ, static_cast<Element const*>(a.k), dK,
                          static_cast<Element const*>(a.v), dV};
  auto base = Base::to_underlying_arguments(packed, tensors, nullptr);
  constexpr int kValueLayout = !kFp8 || kTransposeV ? ATTN_V_TOKENS : kInterleavedV ? ATTN_V_TRANSPOSED_INTERLEAVED
                                                                                   : ATTN_V_TRANSPOSED;
  if (a.v_layout != kValueLayout) {
    static char const* const expected[] = {
        "this kernel reads V token-major (v_layout = 0)", "this kernel reads V transposed (v_layout = 1)",
        "this kernel reads V transposed with the tokens of every 16 interleaved (v_layout = 2)"};
    return fail(expected[kValueLayout]);
  }
  if constexpr (kInterleavedV && !kTransposeV) {  // V's TMA box spans the zero-padded last group of 16 tokens
    base.tma_load_v = Base::to_underlying_arguments(make_shape(1, a.hq, tq, (max(tk, 1) + 15) / 16 * 16, d),
                                                    tensors, nullptr).tma_load_v;
  }
  int group = a.hq / a.hkv;
  VarlenMainloop::Params mainloop{base, a.cu_seqlens_q, a.cu_seqlens_k, a.q_scale, a.k_scale,
                                  a.q_scale_stride, a.k_scale_stride, group, a.causal, a.softmax_scale,
                                  {}, {}, nullptr, nullptr, 0, 0, 0, 0, 0, 0, {}, 0, 0, {}};
  if constexpr (kPaged) {
    int box_rows_log2 = __builtin_ctz(unsigned(max(a.box_rows, 1)));
    if (a.box_rows < 8 || a.box_rows > get<1>(TileShape{}) || a.box_rows != 1 << box_rows_log2 ||
        a.block_size % a.box_rows != 0 || a.max_blocks < 1 || a.num_blocks < 1) {
      return fail("paged: need box_rows a power of two in 8..key tile dividing block_size, and blocks");
    }
    int64_t line = a.k_row_stride > 0 && a.k_block_stride % a.k_row_stride == 0 ? a.k_block_stride / a.k_row_stride : 0;
    if (kBlockBoxes || (kHeadDim > 64 && line % 8) || line < a.block_size || a.v_block_stride != line * a.v_row_stride ||
        (int64_t(a.num_blocks) * line) >> 31) {
      line = 0;
    }
    if (kBlockBoxes && a.box_rows != 16) return fail("paged16: this kernel reads boxes of 16 tokens (box_rows = 16)");
    if (!kBlockBoxes && !line && kHeadDim > 64 && a.box_rows != 8) {
      return fail("paged: caches whose blocks do not start a multiple of 8 tokens apart (the same for K and V) take boxes of 8 tokens (box_rows = 8) at D = 128");
    }
    if (!encode_pages(&mainloop.k_pages, a.k, a.k_row_stride, a.k_head_stride, a.k_block_stride, line, a) ||
        !encode_pages(&mainloop.v_pages, a.v, a.v_row_stride, a.v_head_stride, a.v_block_stride, line, a)) {
      return fail("paged: cuTensorMapEncodeTiled rejected the cache (16-byte aligned base and strides needed)");
    }
    mainloop.block_tables = a.block_tables;
    mainloop.seq_lens = a.seq_lens;
    mainloop.block_table_stride = a.block_table_stride;
    mainloop.max_blocks = a.max_blocks;
    mainloop.block_size = a.block_size;
    mainloop.num_blocks = a.num_blocks;
    mainloop.box_rows_log2 = box_rows_log2;
    mainloop.line_stride = int(line);
  }
  if constexpr (kTransposeV) {
    Base::Arguments v_as_k{static_cast<Element const*>(a.q), dQ, static_cast<Element const*>(a.v),
                           StrideQK{int(a.v_row_stride), _1{}, heads(a.v_head_stride)}, static_cast<Element const*>(a.v), dV};
    mainloop.tma_load_v_tokens = Base::to_underlying_arguments(packed, v_as_k, nullptr).tma_load_k;
  }
  if constexpr (kPersistent) {  // the pipelines' barriers, from the mainloop's storage
    static_assert(offsetof(Kernel::SharedStorage, tensors) == 0, "the mainloop's storage opens the kernel's");
    mainloop.inner_pipeline_offset = int(offsetof(Kernel::SharedStorage, pipeline_storage_inner));
    mainloop.outer_pipeline_offset = int(offsetof(Kernel::SharedStorage, pipeline_storage_outer));
  }
  VarlenEpilogue::Params epilogue{a.out, a.lse, a.out_row_stride, a.out_head_stride, a.lse_row_stride,
                                  a.cu_seqlens_q, a.v_scale, a.out_scale, a.v_scale_stride, group, a.out_dtype, tq};
  if (a.section_heads < 1 || a.hq % a.section_heads != 0) return fail("need section_heads dividing hq");
  if (kCluster > 1 && (group % kCluster || a.section_heads % kCluster)) {  // a cluster's CTAs: heads 2i, 2i + 1
    return fail("clusters of 2: need an even number of query heads per KV head and even section_heads");
  }
  if (kPersistent && a.num_ctas < kCluster) return fail("persistent grid: need num_ctas >= CTAs per cluster");

  static_assert(sizeof(Kernel::Params) < 4096, "kernel parameters must fit the launch limit");
  constexpr int smem = Kernel::SharedStorageSize;
  cudaLaunchConfig_t launch{dim3(kCluster, 1, 1), Kernel::get_block_shape(), smem, stream, nullptr, 0};
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {kCluster, 1, 1};
  if (kCluster > 1) {
    launch.attrs = &cluster;
    launch.numAttrs = 1;
  }
  // First call: the shared memory attribute, and how many clusters fit at once (the persistent
  // cluster kernels' grid: a cluster that did not fit would run its whole share after the others;
  // 1 elsewhere).
  static int max_clusters = 0;
  if (!max_clusters) {
    cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e == cudaSuccess && kPersistent && kCluster > 1) {
      e = cudaOccupancyMaxActiveClusters(&max_clusters, cutlass::device_kernel<Kernel>, &launch);
    }
    if (e != cudaSuccess) return fail(cudaGetErrorString(e));
    max_clusters = max(max_clusters, 1);
  }
  int tiles = first_tile(tq, a.num_seqs, a.skip_q_len);
  int num_ctas = kCluster > 1 ? min(a.num_ctas / kCluster, max_clusters) * kCluster : a.num_ctas;
  WorkOrder sched{a.cu_seqlens_q, a.num_seqs, a.skip_q_len, tiles, tiles * a.hq, a.section_heads, num_ctas, a.causal != 0};
  mainloop.order = sched;
  Kernel::Params params{Kernel::ProblemShape{a.num_seqs, a.hq, tq, tk, d}, mainloop, epilogue, sched};
  launch.gridDim = Kernel::get_grid_shape(params);
  cudaError_t e = cudaLaunchKernelEx(&launch, cutlass::device_kernel<Kernel>, params);
  return e == cudaSuccess ? 0 : fail(cudaGetErrorString(e));
}

}  // namespace
}  // namespace attn_fmha

// entry attn_fmha_sm90_<element>_d<D>[_paged|_paged16][x2][_persistent]
#if ATTN_PAGED == 2
#define ATTN_FAMILY _paged16
#elif ATTN_PAGED
#define ATTN_FAMILY _paged
#else
#define ATTN_FAMILY
#endif
#if ATTN_CLUSTER == 2
#define ATTN_CLUSTERED x2
#else
#define ATTN_CLUSTERED
#endif
#if ATTN_PERSISTENT
#define ATTN_GRID _persistent
#else
#define ATTN_GRID
#endif
#define ATTN_CAT2(a, b, c, d, e) attn_fmha_sm90_##a##_d##b##c##d##e
#define ATTN_CAT(a, b, c, d, e) ATTN_CAT2(a, b, c, d, e)
#define ATTN_ENTRY ATTN_CAT(ATTN_ELEMENT_NAME, ATTN_HEAD_DIM, ATTN_FAMILY, ATTN_CLUSTERED, ATTN_GRID)

// the library is built with -fvisibility=hidden: only the entry points are exported
extern "C" __attribute__((visibility("default"))) int ATTN_ENTRY(AttnFmhaArgs const* args, void* stream, char* err, int err_len) {
  return attn_fmha::run(*args, static_cast<cudaStream_t>(stream), err, err_len);
}
