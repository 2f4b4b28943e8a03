// Varlen (packed, cu_seqlens) forward attention on Hopper, FP8 e4m3 or bf16/fp16 inputs.
//
// Built on the warp-specialized FMHA mainloop of CUTLASS's example 88 (included from the
// nvidia-cutlass wheel, not copied): one producer warpgroup loads Q/K/V tiles by TMA, two
// consumer warpgroups run QK^T -> online softmax -> PV with wgmma. What this file and its
// fmha_sm90_*.cuh parts add:
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
// -DATTN_PAGED=<0|1|2> and -DATTN_CLUSTER=<1|2>; torch_ops/kernels/cuda/fmha_sm90_build.py builds and links them.
#include "fmha_sm90_config.cuh"    // the configuration, tile shape, masks
#include "fmha_sm90_paged.cuh"     // stage layouts, the paged caches' TMA descriptors
#include "fmha_sm90_work.cuh"      // work tiles
#include "fmha_sm90_mainloop.cuh"  // the mainloop
#include "fmha_sm90_epilogue.cuh"  // the epilogue

namespace attn_fmha {
namespace {

#if !ATTN_PERSISTENT
// One CTA per work item (WorkOrder). The host picks one head per section (head by head: the
// running CTAs share a head's K/V in L2) or, for causal grids of few waves, as many heads as fit
// their K/V in L2, so that the heaviest tiles of all those heads start first
// (torch_ops/kernels/cuda/fmha_sm90.py `sectioned`). A CTA with a spare tile exits. In clusters of 2 (even
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
                                  {}, {}, nullptr, nullptr, 0, 0, 0, 0, 0, 0, {}, 0, 0, {}, nullptr, 0, 0};
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
    mainloop.err_flag = a.err_flag;
    mainloop.err_block_tables = a.err_block_tables;
    mainloop.err_seq_lens = a.err_seq_lens;
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
