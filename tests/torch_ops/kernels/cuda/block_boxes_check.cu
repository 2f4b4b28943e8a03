// Host-side check of the paged16 kernels' key orders (BlockBoxes, csrc/fmha_sm90_paged.cuh), built
// against csrc/fmha_sm90.cu with -DATTN_PAGED=2 by tests/torch_ops/kernels/cuda/test_fmha_sm90.py: the stage
// layouts put every logical key where its TMA box lands, the masks see each accumulator element's
// key, and step k of the PV product multiplies P and V at the same keys for every thread.
#include "fmha_sm90.cu"

#include <cstdio>

using namespace attn_fmha;

int main() {
  int bad = 0;
  auto report = [&](char const* what, int x, int y) {
    if (bad++ < 5) printf("%s: %d %d\n", what, x, y);
  };
  auto keys = BlockBoxes::SmemLayoutBoxes{}.layout_b();  // unswizzled: the swizzle acts on these offsets alike
  auto layout_k = BlockBoxes::SmemLayoutK{}.layout_b();
  auto layout_v = BlockBoxes::SmemLayoutV{}.layout_b();
  auto key_of_qk = [](int l) { return 16 * ((l / 8) % 8) + 8 * (l / 64) + l % 8; };
  auto key_of_v = [](int l) { int j = l % 16, t = l / 16; return 32 * (t / 2) + 16 * (j / 8) + 8 * (t % 2) + j % 8; };
  for (int b = 0; b < 8; b++)  // box b: keys 16 b + r, dims 64 h + e at 2048 b + 1024 h + 64 r + e
    for (int h = 0; h < 2; h++)
      for (int r = 0; r < 16; r++)
        for (int e = 0; e < 64; e++)
          if (keys(16 * b + r, 64 * h + e, 1) != 16384 + 2048 * b + 1024 * h + 64 * r + e) report("box", b, r);
  for (int l = 0; l < 128; l++)
    for (int d = 0; d < 128; d++) {
      if (layout_k(l, d, 0) != keys(key_of_qk(l), d, 0)) report("K", l, d);
      if (layout_v(d, l, 0) != keys(key_of_v(l), d, 0)) report("V", l, d);
    }
  VarlenMainloop::TiledMmaQK mma_qk;
  auto acc = partition_fragment_C(mma_qk, Shape<_64, _128>{});
  auto p_layout = cutlass::fmha::collective::convert_c_layout_to_a_layout(
      acc.layout(), shape<1>(typename Base::TiledMmaPV::LayoutA_TV{}));
  auto a_tv = typename Base::TiledMmaPV::LayoutA_TV{};  // (thread, value) -> row + 64 * k within a step
  for (int t = 0; t < 128; t++) {
    auto thr = mma_qk.get_thread_slice(t);
    auto logical = thr.partition_C(make_identity_tensor(Shape<_64, _128>{}));
    auto masked = thr.partition_C(make_coord_tensor(BlockBoxes::KeyCoordinates{}));
    for (int w = 0; w < size(logical); w++) {
      if (int(get<0>(logical(w))) != int(get<0>(masked(w))) || key_of_qk(int(get<1>(logical(w)))) != int(get<1>(masked(w))))
        report("mask", t, w);
    }
    for (int k = 0; k < size<2>(p_layout); k++)
      for (int v = 0; v < size<0>(p_layout); v++) {
        int w = 0;  // the accumulator element that P's (v, k) register holds
        while (acc.layout()(w) != p_layout(v, 0, k)) w++;
        int row_k = a_tv(t, v);
        if (row_k % 64 != int(get<0>(logical(w)))) report("P row", t, v);
        if (key_of_qk(int(get<1>(logical(w)))) != key_of_v(16 * k + row_k / 64)) report("P key", t, v);
      }
  }
  printf("%s: %d mismatches\n", bad ? "FAIL" : "OK", bad);
  return bad != 0;
}
