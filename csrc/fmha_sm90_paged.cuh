// The FMHA kernels of fmha_sm90.cu: the K/V stage layouts of the paged kernels (PagedLayouts,
// BlockBoxes) or of the example (ExampleLayouts), and the TMA descriptor whose boxes land on them
// (encode_pages).
#pragma once

#include "fmha_sm90_config.cuh"

namespace attn_fmha {
namespace {

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

}  // namespace
}  // namespace attn_fmha
