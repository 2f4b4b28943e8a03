// The FMHA kernels of fmha_sm90.cu: the work tiles of a launch (virtual q tiles found on
// cu_seqlens_q, WorkOrder) and a sequence's packed rows.
#pragma once

#include "fmha_sm90_config.cuh"

namespace attn_fmha {
namespace {

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

}  // namespace
}  // namespace attn_fmha
