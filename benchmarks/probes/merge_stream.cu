// Candidates for the extension's merge (W' = W + sum_s scale[s] B_s A_s, fp32 sum, one rounding), built and timed
// by probe_merge_kernel.py --stream; not part of the library. merge_tile_kernel is the form the library's
// merge_mma_kernel took, without its strides, pointer table and stamps (128 registers at 128 threads, where the
// library's needs 166). merge_stream_kernel keeps W's reads in flight while it merges: a persistent block owns one
// 128-column strip and walks its 64-row tiles, copying the next STAGES - 1 tiles of W into a shared-memory ring
// (cp.async, 16 bytes a copy) while the current tile is merged (mma.sync m16n8k16, fp32 accumulators that start as
// W) and stored. A's live rank chunks for the strip stay in shared memory, transposed.
// Limits of the candidates: one [N, K] weight with contiguous rows, K a multiple of 8, 16-bit types, at most 64
// slots. The device helpers are the extension's (fdlora/kernels/cuda/csrc/device.cuh).
#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>

#include "device.cuh"

namespace fdlora_cuda {  // beside the extension's helpers (device.cuh), as kernels.cu
namespace {

constexpr int BN = 64, BK = 128, THREADS = 256, RC = 16, MAX_SLOTS = 64;
constexpr int WS = BK + 8;  // elements per shared row of a W tile: fragment reads without bank conflicts
constexpr int AT = 24;  // elements per shared row of A^T (a column's 16 ranks + 8): likewise

// 16 bytes into shared memory by cp.async, or 16 zero bytes where !pred (src is then not read).
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool pred) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Writes the merged tile back into its shared stage, then stores it in 16-byte rows (COALESCED), or stores each
// fragment's pair of elements straight from the accumulators.
template <typename T, int STAGES, bool COALESCED>
__global__ void __launch_bounds__(THREADS, 2) merge_stream_kernel(T* __restrict__ out, const T* __restrict__ W,
                                                                  const T* __restrict__ A, const T* __restrict__ B,
                                                                  const float* __restrict__ scale,
                                                                  const int* __restrict__ ranks, int N, int K, int S,
                                                                  int R) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* Wt = reinterpret_cast<T*>(smem);  // [STAGES][BN][WS]
  T* At = Wt + STAGES * BN * WS;  // [chunks][BK][AT]
  __shared__ float slot_w[MAX_SLOTS];
  __shared__ int slot_live[MAX_SLOTS], slot_c0[MAX_SLOTS + 1];
  const int tiles_k = (K + BK - 1) / BK, tiles_n = (N + BN - 1) / BN;
  const int kt = blockIdx.x % tiles_k, n_first = blockIdx.x / tiles_k, n_step = gridDim.x / tiles_k;
  const int k0 = kt * BK;
  const int my_tiles = n_first < tiles_n ? (tiles_n - n_first + n_step - 1) / n_step : 0;
  const int ldb = S * R;

  // The ring's first tiles, before anything waits.
  auto issue = [&](int i) {
    if (i < my_tiles) {
      const int64_t n0 = (int64_t)(n_first + i * n_step) * BN;
      T* dst = Wt + (i % STAGES) * BN * WS;
#pragma unroll
      for (int u = 0; u < BN * BK / 8 / THREADS; ++u) {
        const int idx = threadIdx.x + u * THREADS, row = idx / (BK / 8), col = idx % (BK / 8) * 8;
        const bool in = n0 + row < N && k0 + col < K;
        cp_async16_or_zero(dst + row * WS + col, in ? W + (n0 + row) * K + k0 + col : W, in);
      }
    }
    cp_commit();
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);

  if (threadIdx.x < S) {
    const float v = scale[threadIdx.x];
    slot_w[threadIdx.x] = v;
    slot_live[threadIdx.x] = v == 0.f ? 0 : min(R, granule(ranks[threadIdx.x]));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int c = 0;
    for (int s = 0; s < S; ++s) {
      slot_c0[s] = c;
      c += (slot_live[s] + RC - 1) / RC;
    }
    slot_c0[S] = c;
  }
  __syncthreads();
  // A^T of every live chunk of this strip: thread (fr, fk) moves rank fr's columns fk .. fk + 7 of each chunk.
  const int fr = threadIdx.x % RC, fk = threadIdx.x / RC * 8;
  for (int s = 0; s < S; ++s) {
    for (int c = slot_c0[s]; c < slot_c0[s + 1]; ++c) {
      const int r = (c - slot_c0[s]) * RC + fr;
      const bool ok = r < slot_live[s] && k0 + fk < K;
      alignas(16) T v[8];
      if (ok) {
        *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(A + ((int64_t)s * R + r) * K + k0 + fk);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = from_f<T>(0.f);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) At[(c * BK + fk + j) * AT + fr] = v[j];
    }
  }

  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int rl = 16 * (warp / 2) + g, cw = 64 * (warp % 2);  // rows rl, rl + 8; columns cw + 8j + 2q, + 1
  for (int i = 0; i < my_tiles; ++i) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // tile i landed for every thread; the stage read in the previous iteration is free
    issue(i + STAGES - 1);
    const int64_t n0 = (int64_t)(n_first + i * n_step) * BN;
    const T* tile = Wt + (i % STAGES) * BN * WS;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Two<T> w = *reinterpret_cast<const Two<T>*>(tile + (rl + 8 * h) * WS + cw + 8 * j + 2 * q);
        acc[j][2 * h] = to_f(w.lo), acc[j][2 * h + 1] = to_f(w.hi);
      }
    }
    for (int s = 0; s < S; ++s) {
      const float ws = slot_w[s];
      const int live = slot_live[s];
      for (int c = slot_c0[s]; c < slot_c0[s + 1]; ++c) {
        const int r0 = (c - slot_c0[s]) * RC;
        uint32_t af[4];  // B' rows rl (af 0, 2), rl + 8 (1, 3); ranks 2q, 2q + 1 (0, 1), 2q + 8, 2q + 9 (2, 3)
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          const int64_t n = n0 + rl + 8 * (f % 2);
          const int r = r0 + 2 * q + 8 * (f / 2);
          float b0 = 0.f, b1 = 0.f;
          if (n < N && r < live) {
            const Two<T> b = *reinterpret_cast<const Two<T>*>(B + n * ldb + (int64_t)s * R + r);
            b0 = to_f(b.lo) * ws, b1 = r + 1 < live ? to_f(b.hi) * ws : 0.f;
          }
          af[f] = pack2<T>(b0, b1);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const T* col = At + (c * BK + cw + 8 * j + g) * AT;
          mma16816<T>(acc[j], af, *reinterpret_cast<const uint32_t*>(col + 2 * q),
                      *reinterpret_cast<const uint32_t*>(col + 2 * q + 8));
        }
      }
    }
    if constexpr (COALESCED) {
      T* st = const_cast<T*>(tile);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<Two<T>*>(st + (rl + 8 * h) * WS + cw + 8 * j + 2 * q) =
              Two<T>{from_f<T>(acc[j][2 * h]), from_f<T>(acc[j][2 * h + 1])};
      __syncthreads();
#pragma unroll
      for (int u = 0; u < BN * BK / 8 / THREADS; ++u) {
        const int idx = threadIdx.x + u * THREADS, row = idx / (BK / 8), col = idx % (BK / 8) * 8;
        if (n0 + row < N && k0 + col < K)
          *reinterpret_cast<uint4*>(out + (n0 + row) * K + k0 + col) =
              *reinterpret_cast<const uint4*>(st + row * WS + col);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t n = n0 + rl + 8 * h;
          const int k = k0 + cw + 8 * j + 2 * q;
          if (n < N && k < K)
            *reinterpret_cast<Two<T>*>(out + n * K + k) = Two<T>{from_f<T>(acc[j][2 * h]),
                                                                 from_f<T>(acc[j][2 * h + 1])};
        }
      }
    }
  }
  cp_wait<0>();
}

// One 64 x 128 tile a block, NT threads: W's tile copied into shared memory (cp.async, 16 bytes a copy) while the
// slots and the first rank chunk are read, the accumulators read from it, the product added on tensor cores, the
// result written back into it and stored in 16-byte rows.
template <typename T, int NT>
__global__ void __launch_bounds__(NT) merge_tile_kernel(T* __restrict__ out, const T* __restrict__ W,
                                                        const T* __restrict__ A, const T* __restrict__ B,
                                                        const float* __restrict__ scale,
                                                        const int* __restrict__ ranks, int N, int K, int S, int R) {
  constexpr int WARPS = NT / 32, JT = 64 / WARPS;  // 4 row groups of 16; WARPS / 4 column groups of 8 JT
  __shared__ __align__(16) T Wt[BN * WS];
  __shared__ __align__(16) T At[BK * AT];
  __shared__ float slot_w[MAX_SLOTS];
  __shared__ int slot_live[MAX_SLOTS];
  const int tiles_k = (K + BK - 1) / BK;
  const int64_t n0 = (int64_t)(blockIdx.x / tiles_k) * BN;
  const int k0 = blockIdx.x % tiles_k * BK;
  for (int idx = threadIdx.x; idx < BN * BK / 8; idx += NT) {
    const int row = idx / (BK / 8), col = idx % (BK / 8) * 8;
    const bool in = n0 + row < N && k0 + col < K;
    cp_async16_or_zero(Wt + row * WS + col, in ? W + (n0 + row) * K + k0 + col : W, in);
  }
  cp_commit();
  if (threadIdx.x < S) {
    const float v = scale[threadIdx.x];
    slot_w[threadIdx.x] = v;
    slot_live[threadIdx.x] = v == 0.f ? 0 : min(R, granule(ranks[threadIdx.x]));
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, q = threadIdx.x % 4;
  const int rl = 16 * (warp % 4) + g, cw = 8 * JT * (warp / 4);
  const int ldb = S * R;
  float acc[JT][4];
  bool have = false;
  auto take = [&] {
    cp_wait<0>();
    __syncthreads();
#pragma unroll
    for (int j = 0; j < JT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Two<T> w = *reinterpret_cast<const Two<T>*>(Wt + (rl + 8 * h) * WS + cw + 8 * j + 2 * q);
        acc[j][2 * h] = to_f(w.lo), acc[j][2 * h + 1] = to_f(w.hi);
      }
    have = true;
  };
  constexpr int AV = RC * BK / 8 / NT;  // 16-byte pieces of A's chunk a thread moves
  for (int s = 0; s < S; ++s) {
    const float ws = slot_w[s];
    const int live = slot_live[s];
    for (int r0 = 0; r0 < live; r0 += RC) {
      alignas(16) T av[AV][8];
#pragma unroll
      for (int u = 0; u < AV; ++u) {
        const int idx = threadIdx.x + u * NT, fr = idx % RC, fk = idx / RC * 8;
        if (r0 + fr < live && k0 + fk < K) {
          *reinterpret_cast<uint4*>(av[u]) =
              *reinterpret_cast<const uint4*>(A + ((int64_t)s * R + r0 + fr) * K + k0 + fk);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) av[u][j] = from_f<T>(0.f);
        }
      }
      float bv[4][2];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const int64_t n = n0 + rl + 8 * (f % 2);
        const int r = r0 + 2 * q + 8 * (f / 2);
        bv[f][0] = bv[f][1] = 0.f;
        if (n < N && r < live) {
          const Two<T> b = *reinterpret_cast<const Two<T>*>(B + n * ldb + (int64_t)s * R + r);
          bv[f][0] = to_f(b.lo), bv[f][1] = r + 1 < live ? to_f(b.hi) : 0.f;
        }
      }
      if (!have) take();
      __syncthreads();
#pragma unroll
      for (int u = 0; u < AV; ++u) {
        const int idx = threadIdx.x + u * NT, fr = idx % RC, fk = idx / RC * 8;
#pragma unroll
        for (int j = 0; j < 8; ++j) At[(fk + j) * AT + fr] = av[u][j];
      }
      uint32_t af[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) af[f] = pack2<T>(bv[f][0] * ws, bv[f][1] * ws);
      __syncthreads();
#pragma unroll
      for (int j = 0; j < JT; ++j) {
        const T* col = At + (cw + 8 * j + g) * AT;
        mma16816<T>(acc[j], af, *reinterpret_cast<const uint32_t*>(col + 2 * q),
                    *reinterpret_cast<const uint32_t*>(col + 2 * q + 8));
      }
    }
  }
  if (!have) take();
#pragma unroll
  for (int j = 0; j < JT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<Two<T>*>(Wt + (rl + 8 * h) * WS + cw + 8 * j + 2 * q) =
          Two<T>{from_f<T>(acc[j][2 * h]), from_f<T>(acc[j][2 * h + 1])};
  __syncthreads();
  for (int idx = threadIdx.x; idx < BN * BK / 8; idx += NT) {
    const int row = idx / (BK / 8), col = idx % (BK / 8) * 8;
    if (n0 + row < N && k0 + col < K)
      *reinterpret_cast<uint4*>(out + (n0 + row) * K + k0 + col) = *reinterpret_cast<const uint4*>(Wt + row * WS + col);
  }
}

template <typename T, int STAGES, bool COALESCED>
void launch(at::Tensor& out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale,
            const at::Tensor& ranks, int64_t blocks_per_sm) {
  const int N = (int)W.size(0), K = (int)W.size(1), S = (int)A.size(0), R = (int)A.size(1);
  const int tiles_k = (K + BK - 1) / BK, tiles_n = (N + BN - 1) / BN;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int per_strip = std::max(1, std::min(tiles_n, (int)(sms * blocks_per_sm) / tiles_k));
  const size_t smem = (size_t)STAGES * BN * WS * sizeof(T) + (size_t)S * ((R + RC - 1) / RC) * BK * AT * sizeof(T);
  auto kernel = merge_stream_kernel<T, STAGES, COALESCED>;
  static size_t allowed = 0;  // raised outside any graph capture: the first (warm) call of a shape comes first
  if (smem > allowed) {
    TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) == cudaSuccess,
                "merge_stream: ", smem, " bytes of shared memory refused");
    allowed = smem;
  }
  kernel<<<tiles_k * per_strip, THREADS, smem, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(W.data_ptr()),
      reinterpret_cast<const T*>(A.data_ptr()), reinterpret_cast<const T*>(B.data_ptr()), scale.data_ptr<float>(),
      ranks.data_ptr<int>(), N, K, S, R);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void merge_stream(at::Tensor out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                  const at::Tensor& scale, const at::Tensor& ranks, int64_t stages, int64_t blocks_per_sm) {
  TORCH_CHECK(W.is_cuda() && W.dim() == 2 && W.is_contiguous() && out.is_contiguous() && A.is_contiguous() &&
              B.is_contiguous() && W.size(1) % 8 == 0 && A.size(0) <= MAX_SLOTS && A.size(1) % 2 == 0 &&
              (W.scalar_type() == at::kHalf || W.scalar_type() == at::kBFloat16),
              "merge_stream: contiguous 16-bit W [N, K] (K a multiple of 8), A [S <= 64, R even, K], B [N, S, R]");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (stages == 2) launch<T, 2, false>(out, W, A, B, scale, ranks, blocks_per_sm);
    else if (stages == 3) launch<T, 3, false>(out, W, A, B, scale, ranks, blocks_per_sm);
    else if (stages == 4) launch<T, 4, false>(out, W, A, B, scale, ranks, blocks_per_sm);
    else if (stages == -2) launch<T, 2, true>(out, W, A, B, scale, ranks, blocks_per_sm);
    else if (stages == -3) launch<T, 3, true>(out, W, A, B, scale, ranks, blocks_per_sm);
    else if (stages == -4) launch<T, 4, true>(out, W, A, B, scale, ranks, blocks_per_sm);
    else TORCH_CHECK(false, "merge_stream: stages 2, 3 or 4 (negative: stores through shared memory)");
  };
  if (W.scalar_type() == at::kHalf) run(__half());
  else run(__nv_bfloat16());
}

void merge_tile(at::Tensor out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& scale, const at::Tensor& ranks, int64_t threads) {
  TORCH_CHECK(W.is_cuda() && W.dim() == 2 && W.is_contiguous() && out.is_contiguous() && A.is_contiguous() &&
              B.is_contiguous() && W.size(1) % 8 == 0 && A.size(0) <= MAX_SLOTS && A.size(1) % 2 == 0 &&
              (W.scalar_type() == at::kHalf || W.scalar_type() == at::kBFloat16) && (threads == 128 || threads == 256),
              "merge_tile: contiguous 16-bit W [N, K] (K a multiple of 8), A [S <= 64, R even, K], B [N, S, R]; "
              "128 or 256 threads");
  const int N = (int)W.size(0), K = (int)W.size(1), S = (int)A.size(0), R = (int)A.size(1);
  const unsigned blocks = (unsigned)(((N + BN - 1) / BN) * ((K + BK - 1) / BK));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto args = [&](auto kernel, int nt) {
      kernel<<<blocks, nt, 0, stream>>>(reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(W.data_ptr()),
                                        reinterpret_cast<const T*>(A.data_ptr()),
                                        reinterpret_cast<const T*>(B.data_ptr()), scale.data_ptr<float>(),
                                        ranks.data_ptr<int>(), N, K, S, R);
    };
    if (threads == 128) args(merge_tile_kernel<T, 128>, 128);
    else args(merge_tile_kernel<T, 256>, 256);
  };
  if (W.scalar_type() == at::kHalf) run(__half());
  else run(__nv_bfloat16());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fdlora_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("merge_stream", &fdlora_cuda::merge_stream);
  m.def("merge_tile", &fdlora_cuda::merge_tile);
}
