// Paged decode for small problems on Hopper (sm_90a), in one launch.
//
// Why CUDA C++ here: at small batch the Triton kernel's time is latency, not bytes (two launches,
// split-K partials through global memory, a long per-tile instruction chain). This kernel splits
// the keys of one (sequence, KV head) over the CTAs of a thread-block cluster and, inside a CTA,
// over its warps; the partial softmax states meet in shared memory, then across the cluster in
// distributed shared memory. No workspace, no second kernel, and the grid comes from shapes only
// (CUDA-graph safe).
//
// - A CTA: 8 warps, the 16 query rows of one KV head (row m = token m / G of the sequence, query
//   head m % G of the group; rows past q_per_seq x G are padding), each warp streaming its own
//   16-key tiles of K and V through a private 2-stage cp.async pipeline (no CTA barrier in the
//   loop). About 150 KB of shared memory at D = 128: one CTA per SM, two warps per scheduler.
// - Per tile and warp: S = Q K^T with mma.m16n8k16 (K by ldmatrix), online softmax in fp32 with
//   exp2, P kept in registers as the A operand of P V (V by ldmatrix.trans).
// - Shared-memory rows are padded by 16 bytes, so ldmatrix and the cp.async stores are free of
//   bank conflicts.
// - Merge: each warp's (m, l, O) to shared memory, combined per CTA; with a cluster, every CTA
//   combines a slice of the rows x dims from all CTAs' shared memory and writes out and lse.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdio.h>

#include "decode_sm90.h"

namespace cg = cooperative_groups;

namespace {

#ifndef ATTN_DECODE_WARPS
#define ATTN_DECODE_WARPS 8
#endif
#ifndef ATTN_DECODE_STAGES
#define ATTN_DECODE_STAGES 2
#endif
constexpr int kWarps = ATTN_DECODE_WARPS;   // per CTA; torch_ops/cuda_decode.py WARPS
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;       // query rows of a CTA: one m16 MMA tile
constexpr int kKeys = 16;       // keys per tile
constexpr int kMaxCluster = 16;

template <int D>
struct Layout {
  static constexpr int kRowBytes = D * 2 + 16;            // one padded key row in shared memory
  static constexpr int kTileBytes = kKeys * kRowBytes;    // a K or a V tile
  static constexpr int kStages = ATTN_DECODE_STAGES;      // K/V tile buffers per warp
  static constexpr int kWarpBytes = kStages * 2 * kTileBytes;
  static constexpr int kOStride = D + 8;                  // floats per row of an O buffer
  static constexpr int kCtaO = kWarps * kWarpBytes;       // byte offsets of the merge buffers
  static constexpr int kWarpM = kCtaO + kRows * kOStride * 4;
  static constexpr int kWarpL = kWarpM + kWarps * kRows * 4;
  static constexpr int kCtaM = kWarpL + kWarps * kRows * 4;
  static constexpr int kCtaL = kCtaM + kRows * 4;
  static constexpr int kFactor = kCtaL + kRows * 4;       // [kRows][kMaxCluster] cluster weights
  static constexpr int kRowL = kFactor + kRows * kMaxCluster * 4;
  static constexpr int kBytes = kRowL + kRows * 4;
  static_assert(kRows * kOStride * 4 <= kWarpBytes, "a warp's O must fit its pipeline buffers");
};

template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zeros when !valid (src is not read then)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// weight of a partial state with running max m against the combined max (0 for an empty state)
__device__ __forceinline__ float weight(float m, float m_all) {
  return m == -CUDART_INF_F ? 0.f : exp2_approx(m - m_all);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_kernel(const AttnDecodeArgs a) {
  using Lay = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int rank = blockIdx.x;  // grid.x is the cluster size: the CTA's rank in its cluster
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int group = a.hq / a.hkv;
  const int rows = group * a.q_per_seq;
  const int L = a.seq_lens[b];
  const int bs = a.block_size;
  const float scale_log2 = a.softmax_scale * 1.4426950408889634f;

  // this warp's keys [start, end), cut in 16-key tiles
  const int units = a.cluster_size * kWarps;
  const int per = ((L + units - 1) / units + kKeys - 1) / kKeys * kKeys;
  const int start = (rank * kWarps + warp) * per;
  const int end = min(start + per, L);
  const int n_tiles = end > start ? (end - start + kKeys - 1) / kKeys : 0;

  // Q fragments (A operand, rows g and g + 8), and each row's key limit (causal among new tokens)
  const T* q = static_cast<const T*>(a.q);
  uint32_t qf[D / 16][4];
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = g + 8 * h;
    const bool real = m < rows;
    const int mm = real ? m : 0;
    const int token = mm / group;
    limit[h] = min(end, L - a.q_per_seq + token + 1);
    const T* row = q + (int64_t)(b * a.q_per_seq + token) * a.q_token_stride +
                   (int64_t)(kvh * group + mm % group) * a.q_head_stride;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qf[kk][h] = real ? *reinterpret_cast<const uint32_t*>(row + kk * 16 + 2 * t4) : 0u;
      qf[kk][2 + h] = real ? *reinterpret_cast<const uint32_t*>(row + kk * 16 + 8 + 2 * t4) : 0u;
    }
  }

  // the K/V pipeline of this warp
  unsigned char* wbuf = smem + warp * Lay::kWarpBytes;
  const uint32_t wsmem = smem_addr(wbuf);
  const T* kbase = static_cast<const T*>(a.k_cache) + kvh * a.k_head_stride;
  const T* vbase = static_cast<const T*>(a.v_cache) + kvh * a.v_head_stride;
  const int* table = a.block_tables + b * a.block_table_stride;
  constexpr int kChunks = D / 8;                 // 16-byte chunks per row
  constexpr int kPerLane = kKeys * kChunks / 32;
  constexpr int kRowStep = 32 / kChunks;         // rows per pass of the warp
  static_assert(32 % kChunks == 0, "a row is 1, 2, 4, 8, 16 or 32 chunks");
  // tiles lie in one page (block_size % 16 == 0): lane j holds the page and offset of tile 32 i + j
  int lane_page = 0, lane_off = 0;
  auto fetch_pages = [&](int first) {
    const int tile = first + lane;
    if (tile < n_tiles) {
      const int tok = start + tile * kKeys;
      lane_page = table[tok / bs];
      lane_off = tok % bs;
    }
  };
  auto issue = [&](int tile) {
    if ((tile & 31) == 0) fetch_pages(tile);
    const int page = __shfl_sync(0xffffffffu, lane_page, tile & 31);
    const int off = __shfl_sync(0xffffffffu, lane_off, tile & 31);
    const int t0 = start + tile * kKeys;
    const uint32_t sk = wsmem + (tile % Lay::kStages) * 2 * Lay::kTileBytes;
    const uint32_t sv = sk + Lay::kTileBytes;
    const T* kp = kbase + (int64_t)page * a.k_block_stride + (int64_t)off * a.k_token_stride;
    const T* vp = vbase + (int64_t)page * a.v_block_stride + (int64_t)off * a.v_token_stride;
    // lane copies 16-byte chunk c of rows r0, r0 + kRowStep, ...
    const int r0 = lane / kChunks, c = lane % kChunks;
    kp += r0 * a.k_token_stride + c * 8;
    vp += r0 * a.v_token_stride + c * 8;
    const uint32_t so = r0 * Lay::kRowBytes + c * 16;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const bool ok = t0 + r0 + i * kRowStep < end;
      cp_async16(sk + so + i * kRowStep * Lay::kRowBytes, kp, ok);
      cp_async16(sv + so + i * kRowStep * Lay::kRowBytes, vp, ok);
      kp += kRowStep * a.k_token_stride;
      vp += kRowStep * a.v_token_stride;
    }
  };

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};

  // ldmatrix lane addresses: K (x4: keys 0-7 / 8-15 x the two 8-dim halves of a k-step),
  // V (x4.trans: keys 0-7 / 8-15 x two 8-dim blocks)
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_chunk = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_chunk = lane >> 4;

#pragma unroll
  for (int i = 0; i < Lay::kStages - 1; ++i) {
    if (i < n_tiles) issue(i);
    cp_async_commit();
  }
  for (int it = 0; it < n_tiles; ++it) {
    if (it + Lay::kStages - 1 < n_tiles) issue(it + Lay::kStages - 1);
    cp_async_commit();
    cp_async_wait<Lay::kStages - 1>();
    __syncwarp();
    const uint32_t sk = wsmem + (it % Lay::kStages) * 2 * Lay::kTileBytes;
    const uint32_t sv = sk + Lay::kTileBytes;

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const uint32_t ka = sk + k_row * Lay::kRowBytes + k_chunk * 16;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t kb[4];
      ldmatrix_x4(ka + kk * 32, kb);
      Elem<T>::mma(s[0], qf[kk], kb[0], kb[1]);
      Elem<T>::mma(s[1], qf[kk], kb[2], kb[3]);
    }

    // mask, scale, online softmax (row g: s[.][0..1], row g + 8: s[.][2..3])
    const int t0 = start + it * kKeys;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = t0 + 8 * j + 2 * t4 + e;
          float& x = s[j][2 * h + e];
          x = key < limit[h] ? x * scale_log2 : -CUDART_INF_F;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx);
      const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
      alpha[h] = exp2_approx(m_run[h] - m_use);
      m_run[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[j][2 * h + e];
          x = exp2_approx(x - m_use);
          sum += x;
        }
      l_run[h] = l_run[h] * alpha[h] + sum;
    }
    if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }

    // O += P V: P (16 rows x 16 keys) straight from the score registers
    const uint32_t pa[4] = {Elem<T>::pack(s[0][0], s[0][1]), Elem<T>::pack(s[0][2], s[0][3]),
                            Elem<T>::pack(s[1][0], s[1][1]), Elem<T>::pack(s[1][2], s[1][3])};
    const uint32_t va = sv + v_row * Lay::kRowBytes + v_chunk * 16;
#pragma unroll
    for (int jj = 0; jj < D / 16; ++jj) {
      uint32_t vb[4];
      ldmatrix_x4_trans(va + jj * 32, vb);
      Elem<T>::mma(o[2 * jj], pa, vb[0], vb[1]);
      Elem<T>::mma(o[2 * jj + 1], pa, vb[2], vb[3]);
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();

  // each warp's partial state to shared memory (O over its own pipeline buffers)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  float* wo = reinterpret_cast<float*>(wbuf);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<float2*>(wo + g * Lay::kOStride + 8 * j + 2 * t4) = make_float2(o[j][0], o[j][1]);
    *reinterpret_cast<float2*>(wo + (g + 8) * Lay::kOStride + 8 * j + 2 * t4) = make_float2(o[j][2], o[j][3]);
  }
  float* warp_m = reinterpret_cast<float*>(smem + Lay::kWarpM);
  float* warp_l = reinterpret_cast<float*>(smem + Lay::kWarpL);
  if (t4 == 0) {
    warp_m[warp * kRows + g] = m_run[0];
    warp_m[warp * kRows + g + 8] = m_run[1];
    warp_l[warp * kRows + g] = l_run[0];
    warp_l[warp * kRows + g + 8] = l_run[1];
  }
  __syncthreads();

  // combine the warps: the CTA's state (rows < rows only)
  float* cta_o = reinterpret_cast<float*>(smem + Lay::kCtaO);
  float* cta_m = reinterpret_cast<float*>(smem + Lay::kCtaM);
  float* cta_l = reinterpret_cast<float*>(smem + Lay::kCtaL);
  T* out = static_cast<T*>(a.out);
  auto out_index = [&](int m) {
    return (int64_t)(b * a.q_per_seq + m / group) * a.out_token_stride + (int64_t)(kvh * group + m % group) * a.out_head_stride;
  };
  auto lse_of = [&](int m, float m_all, float l_all) {
    float* p = a.lse + (int64_t)(b * a.q_per_seq + m / group) * a.lse_token_stride +
               (int64_t)(kvh * group + m % group) * a.lse_head_stride;
    *p = l_all > 0.f ? (m_all + __log2f(l_all)) * 0.6931471805599453f : -CUDART_INF_F;
  };
  const bool single = a.cluster_size == 1;
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int m = e / D, col = e % D;
    float m_all = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w * kRows + m]);
    float acc = 0.f, l_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = weight(warp_m[w * kRows + m], m_all);
      acc += f * reinterpret_cast<const float*>(smem + w * Lay::kWarpBytes)[m * Lay::kOStride + col];
      l_all += f * warp_l[w * kRows + m];
    }
    if (single) {
      out[out_index(m) + col] = Elem<T>::from(l_all > 0.f ? acc / l_all : 0.f);
      if (col == 0) lse_of(m, m_all, l_all);
    } else {
      cta_o[m * Lay::kOStride + col] = acc;
      if (col == 0) {
        cta_m[m] = m_all;
        cta_l[m] = l_all;
      }
    }
  }
  if (single) return;

  // combine the cluster's CTAs: every CTA finishes a slice of the rows x dims
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  float* factor = reinterpret_cast<float*>(smem + Lay::kFactor);
  float* row_l = reinterpret_cast<float*>(smem + Lay::kRowL);
  const int n = a.cluster_size;
  if (threadIdx.x < rows) {
    const int m = threadIdx.x;
    float m_all = -CUDART_INF_F;
    for (int r = 0; r < n; ++r) m_all = fmaxf(m_all, cluster.map_shared_rank(cta_m, r)[m]);
    float l_all = 0.f;
    for (int r = 0; r < n; ++r) {
      const float f = weight(cluster.map_shared_rank(cta_m, r)[m], m_all);
      factor[m * kMaxCluster + r] = f;
      l_all += f * cluster.map_shared_rank(cta_l, r)[m];
    }
    row_l[m] = l_all;
    if (rank == 0) lse_of(m, m_all, l_all);
  }
  __syncthreads();
  for (int e = rank * kThreads + threadIdx.x; e < rows * D; e += n * kThreads) {
    const int m = e / D, col = e % D;
    float acc = 0.f;
    for (int r = 0; r < n; ++r)
      acc += factor[m * kMaxCluster + r] * cluster.map_shared_rank(cta_o, r)[m * Lay::kOStride + col];
    const float l_all = row_l[m];
    out[out_index(m) + col] = Elem<T>::from(l_all > 0.f ? acc / l_all : 0.f);
  }
  cluster.sync();  // no CTA leaves while the others read its shared memory
}

template <typename T, int D>
cudaError_t configure() {
  static const cudaError_t configured = [] {
    auto kernel = decode_kernel<T, D>;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<D>::kBytes);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    return e;
  }();
  return configured;
}

// the launch configuration of a call: grid (cluster, hkv, batch), clusters along x
struct LaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  LaunchConfig(const AttnDecodeArgs& a, int smem_bytes, cudaStream_t stream) {
    cfg.gridDim = dim3(a.cluster_size, a.hkv, a.batch);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = a.cluster_size;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
};

template <typename T, int D>
int launch(const AttnDecodeArgs& a, cudaStream_t stream, char* err, int err_len) {
  cudaError_t e = configure<T, D>();
  if (e != cudaSuccess) {
    snprintf(err, err_len, "decode_sm90: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    return 1;
  }
  LaunchConfig lc(a, Layout<D>::kBytes, stream);
  e = cudaLaunchKernelEx(&lc.cfg, decode_kernel<T, D>, a);
  if (e != cudaSuccess) {
    snprintf(err, err_len, "decode_sm90: launch (cluster %d, grid %d x %d x %d): %s", a.cluster_size,
             a.cluster_size, a.hkv, a.batch, cudaGetErrorString(e));
    return 1;
  }
  return 0;
}

template <typename T, int D>
int max_clusters(const AttnDecodeArgs& a) {
  if (configure<T, D>() != cudaSuccess) return -1;
  AttnDecodeArgs one = a;
  one.hkv = one.batch = 1;
  LaunchConfig lc(one, Layout<D>::kBytes, nullptr);
  int n = 0;
  return cudaOccupancyMaxActiveClusters(&n, decode_kernel<T, D>, &lc.cfg) == cudaSuccess ? n : -1;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int attn_decode_sm90(const AttnDecodeArgs* args, void* stream,
                                                                     char* err, int err_len) {
  const AttnDecodeArgs& a = *args;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = a.hkv > 0 ? a.hq / a.hkv * a.q_per_seq : 0;
  if (rows < 1 || rows > kRows || a.cluster_size < 1 || a.cluster_size > kMaxCluster || a.block_size % kKeys) {
    snprintf(err, err_len, "decode_sm90: unsupported problem (rows %d, cluster %d, block_size %d)", rows,
             a.cluster_size, a.block_size);
    return 1;
  }
  if (a.batch == 0) return 0;
  const bool bf16 = a.dtype == ATTN_DECODE_BF16;
  switch (a.head_dim) {
    case 64: return bf16 ? launch<__nv_bfloat16, 64>(a, s, err, err_len) : launch<__half, 64>(a, s, err, err_len);
    case 128: return bf16 ? launch<__nv_bfloat16, 128>(a, s, err, err_len) : launch<__half, 128>(a, s, err, err_len);
    default: snprintf(err, err_len, "decode_sm90: head_dim %d is not built (64, 128)", a.head_dim); return 1;
  }
}

// how many clusters of args->cluster_size CTAs can be resident at once on the current device
// (for the grid heuristic), or -1
extern "C" __attribute__((visibility("default"))) int attn_decode_sm90_max_clusters(const AttnDecodeArgs* args) {
  const bool bf16 = args->dtype == ATTN_DECODE_BF16;
  switch (args->head_dim) {
    case 64: return bf16 ? max_clusters<__nv_bfloat16, 64>(*args) : max_clusters<__half, 64>(*args);
    case 128: return bf16 ? max_clusters<__nv_bfloat16, 128>(*args) : max_clusters<__half, 128>(*args);
    default: return -1;
  }
}
