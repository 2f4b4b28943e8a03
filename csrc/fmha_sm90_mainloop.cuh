// The FMHA kernels of fmha_sm90.cu: the mainloop (VarlenMainloop: loads, the paged loads, the
// products and the online softmax).
#pragma once

#include "fmha_sm90_config.cuh"
#include "fmha_sm90_paged.cuh"
#include "fmha_sm90_work.cuh"

namespace attn_fmha {
namespace {

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
    int* err_flag;    // paged: the device error flag (NULL: none) and the bits that bad metadata sets
    int err_block_tables, err_seq_lens;
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
    if constexpr (kPaged) {
      int raw = p.seq_lens[b], cap = p.max_blocks * p.block_size;
      if ((raw < 0 || raw > cap) && p.err_flag) atomicOr(p.err_flag, p.err_seq_lens);
      return {q0, 0, p.cu_q[b + 1] - q0, min(max(raw, 0), cap), 0};
    }
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
      if (block < 0 || block >= p.num_blocks) {
        if (p.err_flag) atomicOr(p.err_flag, p.err_block_tables);
        block = p.num_blocks;
      }
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
  // (torch_ops/kernels/triton/transpose.py), so each register packs a row's two column pairs of
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

}  // namespace
}  // namespace attn_fmha
