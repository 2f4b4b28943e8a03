// Host-side check of the paged kernels' stage layouts (PagedLayouts, csrc/fmha_sm90_paged.cuh),
// built against csrc/fmha_sm90.cu with -DATTN_PAGED=1 by tests/torch_ops/kernels/cuda/test_fmha_sm90.py: every
// element of every TMA box (encode_pages: dims (64, 8, D / 64, box_rows / 8), innermost first)
// lands where the K and V stage layouts that the products read expect its key and dim.
#include "fmha_sm90.cu"

#include <cstdio>

using namespace attn_fmha;

int main() {
  int bad = 0;
  auto layout_k = VarlenMainloop::SmemLayoutK{}.layout_b();  // unswizzled: the swizzle acts on these offsets alike
  auto layout_v = VarlenMainloop::SmemLayoutV{}.layout_b();
  constexpr int kBlockN = get<1>(TileShape{}), kStage = kBlockN * kHeadDim;
  for (int box_rows = 8; box_rows <= kBlockN; box_rows *= 2)
    for (int stage = 0; stage < 2; stage++)
      for (int key = 0; key < kBlockN; key++)
        for (int d = 0; d < kHeadDim; d++) {
          int j = key % box_rows;  // the token's row in its box, whose first key is key - j
          int in_box = d % 64 + 64 * (j % 8) + 512 * (d / 64) + 8 * kHeadDim * (j / 8);
          int expect = stage * kStage + (key - j) * kHeadDim + in_box;
          if (layout_k(key, d, stage) != expect || layout_v(d, key, stage) != expect) {
            if (bad++ < 5) printf("box_rows %d key %d dim %d: K at %d, V at %d, box at %d\n", box_rows, key, d,
                                  int(layout_k(key, d, stage)), int(layout_v(d, key, stage)), expect);
          }
        }
  printf("%s: %d mismatches\n", bad ? "FAIL" : "OK", bad);
  return bad != 0;
}
