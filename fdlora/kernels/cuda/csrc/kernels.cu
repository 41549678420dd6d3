// fd-lora CUDA backend: hand-written kernels for what cuBLAS cannot do well or at all: the gathers of per-row and
// per-sample weights, the small-M (decode) delta, the masking of dead bank chunks, and the merge (its product on
// tensor cores for 16-bit weights) of many layers or blends in one launch with a device-side "nothing changed"
// check. Numerics as the Triton kernels: fp32 accumulation, scaled intermediates rounded to the operand dtype before
// their product, one rounding of the result.
#include "kernels.h"
#include "device.cuh"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace fdlora_cuda {
namespace {

template <typename T> struct Native { using type = T; };
template <> struct Native<at::Half> { using type = __half; };
template <> struct Native<at::BFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float weight_of(const Weights& w, int64_t m, int s) {
  if (w.ranks != nullptr && w.ranks[s] <= 0) return 0.f;
  if (w.row_slot != nullptr) return w.row_slot[m] == s ? w.scale[s * w.scale_stride] : 0.f;
  float g = w.gw == nullptr ? 1.f : w.gw[(m / w.rows_per_group) * w.gw_s0 + s * w.gw_s1];
  return w.scale[s * w.scale_stride] * g;
}

int grid_for(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return (int)std::max<int64_t>(1, std::min<int64_t>(blocks, (int64_t)sms * 16));
}

// ---- mask -------------------------------------------------------------------------------------------------------
template <typename T>
__global__ void mask_kernel(T* __restrict__ Ao, T* __restrict__ Bo, const T* __restrict__ A, const T* __restrict__ B,
                            int64_t S, int64_t R, int64_t K, int64_t N, int64_t ldb, const float* __restrict__ scale,
                            int64_t scale_stride, const int* __restrict__ ranks, const float* __restrict__ gw,
                            int64_t gw_s1) {
  const int64_t nA = S * R * K, nB = N * S * R, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nA + nB; i += step) {
    int64_t s, r;
    if (i < nA) {
      s = i / (R * K);
      r = (i / K) % R;
    } else {
      int64_t j = (i - nA) % (S * R);
      s = j / R;
      r = j % R;
    }
    bool live = scale[s * scale_stride] != 0.f && r < granule(ranks[s]);
    if (i < nA) {
      Ao[i] = live ? A[i] : from_f<T>(0.f);
    } else {
      int64_t j = i - nA, n = j / (S * R), c = j % (S * R);
      const T b = B[n * ldb + c];
      Bo[j] = !live ? from_f<T>(0.f) : gw == nullptr ? b : from_f<T>(to_f(b) * scale[s * scale_stride] * gw[s * gw_s1]);
    }
  }
}

// ---- weigh ------------------------------------------------------------------------------------------------------
template <typename T>
__global__ void weigh_kernel(T* __restrict__ hw, const float* __restrict__ h, int64_t M, int64_t S, int64_t R,
                             Weights w) {
  const int64_t SR = S * R, total = M * SR, step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t m = i / SR;
    const int s = (int)((i % SR) / R);
    const float wt = weight_of(w, m, s);
    hw[i] = from_f<T>(wt == 0.f ? 0.f : h[i] * wt);
  }
}

// ---- small-M delta ----------------------------------------------------------------------------------------------
constexpr int SMALL_THREADS = 256;
constexpr int SMALL_COLS = 4;  // columns per thread: a block covers 1024 columns of one row

template <typename T>
__global__ void __launch_bounds__(SMALL_THREADS) delta_small_kernel(
    T* __restrict__ y, int64_t ldy, const T* __restrict__ x, int64_t ldx, const T* __restrict__ A,
    const T* __restrict__ B, int64_t ldb, const int* __restrict__ ranks, Weights w, int64_t N, int64_t K, int S,
    int R) {
  extern __shared__ float smem[];
  float* hs = smem;  // [S*R] weighted h of this row, rounded to T
  float* ws = smem + S * R;  // [S] weights of this row
  __shared__ int any_live;
  const int64_t m = blockIdx.y;
  if (threadIdx.x == 0) any_live = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    float wt = ranks[s] > 0 ? weight_of(w, m, s) : 0.f;
    ws[s] = wt;
    if (wt != 0.f) any_live = 1;
  }
  __syncthreads();
  if (!any_live) return;  // nothing for this row: y stays bit-identical
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  const T* xr = x + m * ldx;
  for (int j = warp; j < S * R; j += nwarps) {
    const int s = j / R, r = j % R;
    float acc = 0.f;
    if (ws[s] != 0.f && r < granule(ranks[s])) {
      const T* ar = A + (int64_t)j * K;
      for (int64_t k = lane; k < K; k += 32) acc += to_f(xr[k]) * to_f(ar[k]);
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      acc = round_to<T>(acc * ws[s]);
    }
    if (lane == 0) hs[j] = acc;
  }
  __syncthreads();
  const int64_t n0 = (int64_t)blockIdx.x * blockDim.x * SMALL_COLS;
  for (int i = 0; i < SMALL_COLS; ++i) {
    const int64_t n = n0 + (int64_t)i * blockDim.x + threadIdx.x;
    if (n >= N) break;
    const T* br = B + n * ldb;
    float acc = 0.f;
    for (int s = 0; s < S; ++s) {
      if (ws[s] == 0.f) continue;
      const int live = min(R, granule(ranks[s]));
      for (int r = 0; r < live; ++r) acc += hs[s * R + r] * to_f(br[s * R + r]);
    }
    T* yp = y + m * ldy + n;
    *yp = from_f<T>(to_f(*yp) + acc);
  }
}

// ---- merge ------------------------------------------------------------------------------------------------------
constexpr int MERGE_THREADS = 256;

// Eight contiguous elements at a 16-byte aligned address, in one (16-bit types) or two (fp32) 16-byte accesses.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* v) {
  alignas(16) T t[8];
#pragma unroll
  for (int q = 0; q < (int)(8 * sizeof(T) / 16); ++q)
    reinterpret_cast<uint4*>(t)[q] = reinterpret_cast<const uint4*>(p)[q];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = to_f(t[j]);
}

template <typename T> __device__ __forceinline__ void store8(T* p, const float* v) {
  alignas(16) T t[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) t[j] = from_f<T>(v[j]);
#pragma unroll
  for (int q = 0; q < (int)(8 * sizeof(T) / 16); ++q)
    reinterpret_cast<uint4*>(p)[q] = reinterpret_cast<const uint4*>(t)[q];
}

constexpr int MERGE_RC = 16;  // rank chunk

struct MergeArgs {
  MergeEntry one;
  const MergeEntry* table;  // null: the one entry
  int64_t n_entries, S, R;
  const int* ranks;  // [S] or null (every chunk up to R)
  const float* gw;  // [S] multipliers (a [1, S] group weight) or null
  int64_t gw_s1;
  int* stamp;  // [S + 2] or null
  const int* version;
  int64_t gw_s0, blend_out;  // blend blockIdx.y: its multipliers' row in gw, its output's offset in elements
};

// The entry of merge tile t: the one entry, or the table row with table[lo].first <= t < table[lo + 1].first.
__device__ __forceinline__ MergeEntry entry_at(const MergeArgs& a, int64_t t) {
  if (a.table == nullptr) return a.one;
  int64_t lo = 0, hi = a.n_entries;
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) / 2;
    if (a.table[mid].first <= t) lo = mid; else hi = mid;
  }
  return a.table[lo];
}

// What block (blockIdx.x, blockIdx.y) of a merge works on: its entry, the blend's multipliers, the origin of its
// MERGE_BN x MERGE_BK tile of W, and the operands, out at the blend's [N, K] block.
template <typename T> struct MergeTile {
  MergeEntry e;
  const float* scale;
  const float* gw;  // the blend's multipliers (a [1, S] group weight) or null
  int64_t n0, k0;
  const T *W, *A, *B;
  T* out;

  __device__ __forceinline__ explicit MergeTile(const MergeArgs& a) : e(entry_at(a, blockIdx.x)) {
    scale = reinterpret_cast<const float*>(e.scale);
    gw = a.gw ? a.gw + blockIdx.y * a.gw_s0 : nullptr;
    const int64_t tiles_k = (e.K + MERGE_BK - 1) / MERGE_BK, local = blockIdx.x - e.first;
    n0 = (local / tiles_k) * MERGE_BN, k0 = (local % tiles_k) * MERGE_BK;
    W = reinterpret_cast<const T*>(e.W), A = reinterpret_cast<const T*>(e.A), B = reinterpret_cast<const T*>(e.B);
    out = reinterpret_cast<T*>(e.out) + blockIdx.y * a.blend_out;
  }
};

constexpr int MERGE_SLOTS = 128;  // slots whose multiplier and live rank a merge block keeps in shared memory

// Slot s's multiplier (scale x group weight) and live rank (rounded up to 16; 0 where the multiplier is 0).
__device__ __forceinline__ void slot_read(const MergeArgs& a, const float* scale, const float* gw, int64_t s,
                                          float& ws, int& live) {
  ws = scale[s] * (gw ? gw[s * a.gw_s1] : 1.f);
  live = ws == 0.f ? 0 : a.ranks ? min((int)a.R, granule(a.ranks[s])) : (int)a.R;
}

// Every slot's multiplier and live rank into shared memory, read by as many threads at once: the block's first
// global reads cost one memory latency, not one per slot. Slots past MERGE_SLOTS are read where used (slot()).
// Returns whether the block merges: always without a stamp; with one, when the version or a multiplier differs
// from it.
__device__ bool slots_of(const MergeArgs& a, const float* scale, const float* gw, float* ws, int* live) {
  int changed = 0;
  for (int64_t s = threadIdx.x; s < a.S; s += blockDim.x) {
    float v;
    int l;
    slot_read(a, scale, gw, s, v, l);
    if (s < MERGE_SLOTS) ws[s] = v, live[s] = l;
    if (a.stamp != nullptr) changed |= a.stamp[s] != __float_as_int(v);
  }
  if (a.stamp != nullptr && threadIdx.x == 0) changed |= a.stamp[a.S] != a.version[0];
  return __syncthreads_or(changed) || a.stamp == nullptr;
}

__device__ __forceinline__ void slot(const MergeArgs& a, const float* scale, const float* gw, const float* ws_s,
                                     const int* live_s, int s, float& ws, int& live) {
  if (s < MERGE_SLOTS) {
    ws = ws_s[s], live = live_s[s];
    return;
  }
  slot_read(a, scale, gw, s, ws, live);
}

// The last block done writes the stamp (every block has read it by then).
__device__ void stamp_merged(const MergeArgs& a, const float* scale, const float* gw, const float* ws_s,
                             const int* live_s) {
  if (a.stamp == nullptr) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t S = a.S;
    const int done = atomicAdd(&a.stamp[S + 1], 1);
    if (done == (int)gridDim.x - 1) {
      for (int s = 0; s < (int)S; ++s) {
        float v;
        int live;
        slot(a, scale, gw, ws_s, live_s, s, v, live);
        a.stamp[s] = __float_as_int(v);
      }
      a.stamp[S] = a.version[0];
      a.stamp[S + 1] = 0;
      __threadfence();
    }
  }
}

// fp32 weights: the product on CUDA cores.
template <typename T>
__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(MergeArgs a) {
  __shared__ float Bs[MERGE_BN][MERGE_RC + 1];
  __shared__ __align__(16) float As[MERGE_RC][MERGE_BK];
  __shared__ float slot_w[MERGE_SLOTS];
  __shared__ int slot_live[MERGE_SLOTS];
  const MergeTile<T> m(a);
  const MergeEntry& e = m.e;
  const float *scale = m.scale, *gw = m.gw;
  const int64_t n0 = m.n0, k0 = m.k0;
  const T *W = m.W, *A = m.A, *B = m.B;
  T* out = m.out;
  const int S = (int)a.S, R = (int)a.R;
  if (!slots_of(a, scale, gw, slot_w, slot_live)) return;
  // Thread (ty, tx): rows n0 + ty + 16i (i < 4), columns k0 + 8tx .. 8tx + 7, so a warp reads and writes two rows of
  // 256 contiguous bytes; 16-byte accesses where the rows are contiguous and aligned, one element at a time elsewhere.
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const int64_t kt = k0 + 8 * tx;
  const bool vec = e.swk == 1 && e.sok == 1 && e.K % 8 == 0 && e.swn % 8 == 0 && e.son % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(W) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  float acc[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t n = n0 + ty + 16 * i;
    if (vec && n < e.N && kt < e.K) {
      load8(W + n * e.swn + kt, acc[i]);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t k = kt + j;
      acc[i][j] = (n < e.N && k < e.K) ? to_f(W[n * e.swn + k * e.swk]) : 0.f;
    }
  }
  for (int s = 0; s < S; ++s) {
    float ws;
    int live;
    slot(a, scale, gw, slot_w, slot_live, s, ws, live);
    for (int r0 = 0; r0 < live; r0 += MERGE_RC) {
      __syncthreads();
      for (int i = threadIdx.x; i < MERGE_BN * MERGE_RC; i += MERGE_THREADS) {
        const int nn = i / MERGE_RC, rr = i % MERGE_RC;
        const int64_t n = n0 + nn;
        Bs[nn][rr] = n < e.N ? round_to<T>(to_f(B[n * e.ldb + (int64_t)s * R + r0 + rr]) * ws) : 0.f;
      }
      for (int i = threadIdx.x; i < MERGE_RC * MERGE_BK; i += MERGE_THREADS) {
        const int rr = i / MERGE_BK, kk = i % MERGE_BK;
        const int64_t k = k0 + kk;
        As[rr][kk] = k < e.K ? to_f(A[((int64_t)s * R + r0 + rr) * e.K + k]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int rr = 0; rr < MERGE_RC; ++rr) {
        float b[4], av[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = Bs[ty + 16 * i][rr];
        const float4 a0 = *reinterpret_cast<const float4*>(&As[rr][8 * tx]);
        const float4 a1 = *reinterpret_cast<const float4*>(&As[rr][8 * tx + 4]);
        av[0] = a0.x, av[1] = a0.y, av[2] = a0.z, av[3] = a0.w, av[4] = a1.x, av[5] = a1.y, av[6] = a1.z, av[7] = a1.w;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] += b[i] * av[j];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t n = n0 + ty + 16 * i;
    if (vec && n < e.N && kt < e.K) {
      store8(out + n * e.son + kt, acc[i]);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t k = kt + j;
      if (n < e.N && k < e.K) out[n * e.son + k * e.sok] = from_f<T>(acc[i][j]);
    }
  }
  stamp_merged(a, scale, gw, slot_w, slot_live);
}

// 16-bit weights: the product B' A on tensor cores (mma.sync m16n8k16, fp32 accumulators that start as W, so the sum
// and its one rounding are merge_kernel's), MERGE_MMA_THREADS threads a 64 x 128 tile. W's tile is copied into shared
// memory (cp.async, 16 bytes a copy, no register held) while the slots and the first rank chunk are read; the
// accumulators are read from it, and the merged tile is written back into it and stored in 16-byte rows, so every
// global access of W and W' moves whole rows of 256 bytes. Warp w owns rows 16 w .. + 16, all 128 columns: sixteen
// 16 x 8 accumulator tiles. Each 16-rank chunk of A goes through shared memory transposed, a column's ranks contiguous
// (row stride MERGE_AT: conflict-free fragment reads); B' = B * multiplier, rounded to T, is read straight into the
// A-operand fragment.
constexpr int MERGE_MMA_THREADS = 128;
constexpr int MERGE_AT = 24;
constexpr int MERGE_WT = MERGE_BK + 8;  // elements per shared row of W's tile: conflict-free fragment reads

// Two neighbouring elements (n, k), (n, k + 1) in one 4-byte access where `pair` (unit column stride, even sizes and
// strides, aligned), else one at a time; zero outside the [N, K] matrix.
template <typename T> __device__ __forceinline__ Two<T> load2(const T* p, int64_t N, int64_t K, int64_t sn,
                                                               int64_t sk, int64_t n, int64_t k, bool pair) {
  if (pair && n < N && k < K) return *reinterpret_cast<const Two<T>*>(p + n * sn + k);
  const T zero = from_f<T>(0.f);
  return Two<T>{n < N && k < K ? p[n * sn + k * sk] : zero, n < N && k + 1 < K ? p[n * sn + (k + 1) * sk] : zero};
}

template <typename T>
__global__ void __launch_bounds__(MERGE_MMA_THREADS) merge_mma_kernel(MergeArgs a) {
  constexpr int JT = MERGE_BK / 8;  // a warp's 16 x 8 accumulator tiles
  constexpr int AV = MERGE_RC * MERGE_BK / 8 / MERGE_MMA_THREADS;  // 8-element pieces of A's chunk a thread moves
  constexpr int WV = MERGE_BN * MERGE_BK / 8 / MERGE_MMA_THREADS;  // and of W's tile
  static_assert(MERGE_BN == 16 * (MERGE_MMA_THREADS / 32), "a warp owns 16 rows of the tile");
  __shared__ __align__(16) T Wt[MERGE_BN][MERGE_WT];
  __shared__ __align__(16) T At[MERGE_BK][MERGE_AT];
  __shared__ float slot_w[MERGE_SLOTS];
  __shared__ int slot_live[MERGE_SLOTS];
  const MergeTile<T> m(a);
  const MergeEntry& e = m.e;
  const float *scale = m.scale, *gw = m.gw;
  const int64_t n0 = m.n0, k0 = m.k0;
  const T *W = m.W, *A = m.A, *B = m.B;
  T* out = m.out;
  const int S = (int)a.S, R = (int)a.R;
  const T zero = from_f<T>(0.f);
  // Piece v of the tile: row v / 16, columns 8 (v % 16) .. + 7; whole rows of 16 bytes where W's (out's) rows are
  // contiguous and aligned, one element at a time elsewhere.
  const bool wvec = e.swk == 1 && e.swn % 8 == 0 && reinterpret_cast<uintptr_t>(W) % 16 == 0;
  const bool ovec = e.sok == 1 && e.son % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  auto load_w = [&] {
#pragma unroll
    for (int u = 0; u < WV; ++u) {
      const int v = threadIdx.x + u * MERGE_MMA_THREADS, row = v / (MERGE_BK / 8), col = v % (MERGE_BK / 8) * 8;
      const int64_t n = n0 + row, k = k0 + col;
      if (wvec && n < e.N && k + 8 <= e.K) {
        cp_async16(&Wt[row][col], W + n * e.swn + k);
        continue;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) Wt[row][col + j] = n < e.N && k + j < e.K ? W[n * e.swn + (k + j) * e.swk] : zero;
    }
  };
  if (a.stamp == nullptr) load_w();
  if (!slots_of(a, scale, gw, slot_w, slot_live)) return;
  if (a.stamp != nullptr) load_w();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int rl = 16 * warp + g;  // the thread's rows rl, rl + 8 of the tile; columns 8j + 2q, + 1
  float acc[JT][4];
  bool have = false;
  auto take_w = [&] {  // the accumulators from W's tile, once its copies have landed
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < JT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Two<T> w = *reinterpret_cast<const Two<T>*>(&Wt[rl + 8 * h][8 * j + 2 * q]);
        acc[j][2 * h] = to_f(w.lo), acc[j][2 * h + 1] = to_f(w.hi);
      }
    have = true;
  };
  const bool avec = e.K % 8 == 0 && reinterpret_cast<uintptr_t>(A) % 16 == 0;
  const bool bpair = e.ldb % 2 == 0 && R % 2 == 0 && reinterpret_cast<uintptr_t>(B) % (2 * sizeof(T)) == 0;
  for (int s = 0; s < S; ++s) {
    float ws;
    int live;
    slot(a, scale, gw, slot_w, slot_live, s, ws, live);
    for (int r0 = 0; r0 < live; r0 += MERGE_RC) {
      // A's chunk: piece v is rank v % 16's columns 8 (v / 16) .. + 7 (16 bytes where A's rows are aligned).
      alignas(16) T av[AV][8];
#pragma unroll
      for (int u = 0; u < AV; ++u) {
        const int v = threadIdx.x + u * MERGE_MMA_THREADS, fr = v % MERGE_RC;
        const int64_t k = k0 + v / MERGE_RC * 8;
        const T* src = A + ((int64_t)s * R + r0 + fr) * e.K + k;
        const bool ok = r0 + fr < live;
        if (ok && avec && k + 8 <= e.K) {
          *reinterpret_cast<uint4*>(av[u]) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) av[u][j] = ok && k + j < e.K ? src[j] : zero;
        }
      }
      Two<T> bv[4];  // B rows rl (f 0, 2) and rl + 8 (1, 3), ranks 2q, 2q + 1 (f 0, 1) and 2q + 8, 2q + 9 (2, 3)
#pragma unroll
      for (int f = 0; f < 4; ++f)
        bv[f] = load2(B, e.N, (int64_t)s * R + live, e.ldb, 1, n0 + rl + 8 * (f % 2),
                      (int64_t)s * R + r0 + 2 * q + 8 * (f / 2), bpair);
      if (!have) take_w();  // the first chunk's reads are in flight with W's
      __syncthreads();  // the previous chunk's reads of At are done
#pragma unroll
      for (int u = 0; u < AV; ++u) {
        const int v = threadIdx.x + u * MERGE_MMA_THREADS, fr = v % MERGE_RC, fk = v / MERGE_RC * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) At[fk + j][fr] = av[u][j];
      }
      uint32_t af[4];  // the A operand: B' = B * ws rounded to T
#pragma unroll
      for (int f = 0; f < 4; ++f) af[f] = pack2<T>(to_f(bv[f].lo) * ws, to_f(bv[f].hi) * ws);
      __syncthreads();
#pragma unroll
      for (int j = 0; j < JT; ++j) {
        const T* col = At[8 * j + g];  // column 8j + g's ranks: 2q, 2q + 1 and 2q + 8, 2q + 9
        mma16816<T>(acc[j], af, *reinterpret_cast<const uint32_t*>(col + 2 * q),
                    *reinterpret_cast<const uint32_t*>(col + 2 * q + 8));
      }
    }
  }
  if (!have) take_w();  // no live chunk: W' = W
  // Each thread rewrites the elements it read; the tile then leaves in 16-byte rows.
#pragma unroll
  for (int j = 0; j < JT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<Two<T>*>(&Wt[rl + 8 * h][8 * j + 2 * q]) =
          Two<T>{from_f<T>(acc[j][2 * h]), from_f<T>(acc[j][2 * h + 1])};
  __syncthreads();
#pragma unroll
  for (int u = 0; u < WV; ++u) {
    const int v = threadIdx.x + u * MERGE_MMA_THREADS, row = v / (MERGE_BK / 8), col = v % (MERGE_BK / 8) * 8;
    const int64_t n = n0 + row, k = k0 + col;
    if (n >= e.N) continue;
    if (ovec && k + 8 <= e.K) {
      *reinterpret_cast<uint4*>(out + n * e.son + k) = *reinterpret_cast<const uint4*>(&Wt[row][col]);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (k + j < e.K) out[n * e.son + (k + j) * e.sok] = Wt[row][col + j];
  }
  stamp_merged(a, scale, gw, slot_w, slot_live);
}
}  // namespace

#define FDLORA_DISPATCH(dtype, NAME, ...)                                              \
  switch (dtype) {                                                                   \
    case at::kFloat: { using NAME = float; __VA_ARGS__(); break; }                   \
    case at::kHalf: { using NAME = __half; __VA_ARGS__(); break; }                   \
    case at::kBFloat16: { using NAME = __nv_bfloat16; __VA_ARGS__(); break; }        \
    default: TORCH_CHECK(false, "fdlora_cuda: dtype ", dtype, " is not fp16, bf16 or fp32"); \
  }

Weights weights_of(const at::Tensor& scale, const c10::optional<at::Tensor>& group_weight,
                   const c10::optional<at::Tensor>& row_slot, int64_t M) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "fdlora_cuda: scale must be fp32");
  Weights w{scale.data_ptr<float>(), scale.stride(0), nullptr, 0, 0, 1, nullptr, nullptr};
  if (group_weight.has_value()) {
    const at::Tensor& gw = *group_weight;
    TORCH_CHECK(gw.scalar_type() == at::kFloat && gw.dim() == 2, "fdlora_cuda: group_weight must be fp32 [G, S]");
    const int64_t G = gw.size(0);
    TORCH_CHECK(G > 0 && M % G == 0, "fdlora_cuda: group_weight has ", G, " groups, which does not divide ", M,
                " rows; give one group per sample");
    w.gw = gw.data_ptr<float>();
    w.gw_s0 = gw.stride(0);
    w.gw_s1 = gw.stride(1);
    w.rows_per_group = std::max<int64_t>(1, M / G);
  }
  if (row_slot.has_value()) {
    TORCH_CHECK(row_slot->scalar_type() == at::kInt && row_slot->is_contiguous(),
                "fdlora_cuda: row_slot must be contiguous int32");
    w.row_slot = row_slot->data_ptr<int>();
  }
  return w;
}

void launch_mask(at::Tensor& A_out, at::Tensor& B_out, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& scale, const at::Tensor& ranks, const float* gw, int64_t gw_s1) {
  const int64_t S = A.size(0), R = A.size(1), K = A.size(2), N = B.size(0);
  const int64_t total = A.numel() + N * S * R;
  if (total == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FDLORA_DISPATCH(A.scalar_type(), T, [&] {
    mask_kernel<T><<<grid_for(total, 256), 256, 0, stream>>>(
        reinterpret_cast<T*>(A_out.data_ptr()), reinterpret_cast<T*>(B_out.data_ptr()),
        reinterpret_cast<const T*>(A.data_ptr()), reinterpret_cast<const T*>(B.data_ptr()), S, R, K, N, B.stride(0),
        scale.data_ptr<float>(), scale.stride(0), ranks.data_ptr<int>(), gw, gw_s1);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_weigh(at::Tensor& hw, const at::Tensor& h, const Weights& w, int64_t S, int64_t R) {
  const int64_t M = h.size(0);
  if (M * S * R == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  FDLORA_DISPATCH(hw.scalar_type(), T, [&] {
    weigh_kernel<T><<<grid_for(M * S * R, 256), 256, 0, stream>>>(reinterpret_cast<T*>(hw.data_ptr()),
                                                                   h.data_ptr<float>(), M, S, R, w);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool launch_delta_small(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& ranks, const Weights& w) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), S = A.size(0), R = A.size(1);
  const size_t smem = (size_t)(S * R + S) * sizeof(float);
  if (smem > 40 * 1024) return false;
  if (M == 0 || N == 0) return true;
  dim3 grid((unsigned)((N + SMALL_THREADS * SMALL_COLS - 1) / (SMALL_THREADS * SMALL_COLS)), (unsigned)M);
  auto stream = at::cuda::getCurrentCUDAStream();
  FDLORA_DISPATCH(y.scalar_type(), T, [&] {
    delta_small_kernel<T><<<grid, SMALL_THREADS, smem, stream>>>(
        reinterpret_cast<T*>(y.data_ptr()), y.stride(0), reinterpret_cast<const T*>(x.data_ptr()), x.stride(0),
        reinterpret_cast<const T*>(A.data_ptr()), reinterpret_cast<const T*>(B.data_ptr()), B.stride(0),
        ranks.data_ptr<int>(), w, N, K, (int)S, (int)R);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

void launch_merge(at::ScalarType dtype, const MergeEntry& one, const at::Tensor* table, int64_t n_entries,
                  int64_t total_tiles, int64_t S, int64_t R, const int* ranks, const float* gw, int64_t gw_s1,
                  int* stamp, const int* version, c10::Device device, int64_t blends, int64_t gw_s0,
                  int64_t blend_out) {
  if (total_tiles == 0 || blends == 0) return;
  TORCH_CHECK(blends == 1 || (stamp == nullptr && table == nullptr && gw != nullptr && blends < 65536),
              "fdlora_cuda: a merge of many blends takes one entry, their multipliers and no stamp");
  MergeArgs a{one, table ? reinterpret_cast<const MergeEntry*>(table->data_ptr()) : nullptr, n_entries, S, R, ranks,
              gw, gw_s1, stamp, version, gw_s0, blend_out};
  auto stream = at::cuda::getCurrentCUDAStream(device.index());
  const dim3 grid((unsigned)total_tiles, (unsigned)blends);
  if (dtype == at::kFloat) {
    merge_kernel<float><<<grid, MERGE_THREADS, 0, stream>>>(a);
  } else {
    FDLORA_DISPATCH(dtype, T, [&] {
      if constexpr (!std::is_same<T, float>::value)
        merge_mma_kernel<T><<<grid, MERGE_MMA_THREADS, 0, stream>>>(a);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fdlora_cuda
