// fd-lora CUTLASS backend: y = x W^T (+ bias) + LoRA delta in one Hopper (sm_90a) GEMM launch.
//
// A C ABI (loaded with ctypes from fdlora/kernels/cutlass/ops.py), so the library is plain CUDA C++ built
// by nvcc, independent of torch's C++ ABI. The kernels: CUTLASS 4.2's warp-specialized cooperative
// persistent GEMM (128 x 256 x 64 tiles, TMA epilogue with a per-column bias), with the main loop of
// lora_mainloop_sm90.hpp, one instantiation per dtype (bf16, fp16) and packed-rank tile (16, 32, 64);
// and the same kernel with CUTLASS's own main loop (no LoRA), which the benchmarks time against cuBLAS.
#include <cstdio>
#include <cstring>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "lora_mainloop_sm90.hpp"

namespace fdlora {

using TileShape = Shape<_128, _256, _64>;
constexpr int kSmemBytes = 232448;  // sm_90 dynamic shared memory per block

template <class Element, class Cluster = Shape<_1, _1, _1>>
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor, 8,     // no C
    Element, cutlass::layout::RowMajor, 8,  // D = y [M, N]
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinCombPerColBias<Element, float, Element>>::CollectiveOp;

template <class Element, int RCT, bool SHRINK = true>
struct LoraGemm {
  static constexpr int StageBytes = (128 + 256 + RCT) * 64 * int(sizeof(Element));
  static constexpr int Stages =
      cute::min(4, (kSmemBytes - int(sizeof(typename Epilogue<Element>::SharedStorage)) - 2048) / StageBytes);
  using Mainloop = LoraMainloopSm90<Stages, TileShape, Element, RCT, SHRINK>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue<Element>,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, class Cluster, class Scheduler = cutlass::gemm::PersistentScheduler>
struct PlainGemm {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue<Element, Cluster>::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue<Element, Cluster>,
                                                      Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

thread_local char g_error[512] = "";

int fail(char const* what, cutlass::Status status) {
  std::snprintf(g_error, sizeof(g_error), "%s: %s", what, cutlass::cutlassGetStatusString(status));
  return 1;
}

template <class Kernel>
typename Kernel::EpilogueArguments epilogue_args(void const* bias, void* y, int M, int N) {
  using Element = typename Kernel::ElementD;
  typename Kernel::EpilogueArguments epi{};
  epi.thread.alpha = 1.f;
  epi.thread.beta = 0.f;
  epi.thread.bias_ptr = static_cast<Element const*>(bias);  // nullptr: no bias
  epi.ptr_C = nullptr;
  epi.ptr_D = static_cast<Element*>(y);
  epi.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(M, N, 1));
  return epi;
}

template <class Gemm>
int launch(typename Gemm::Arguments const& args, cudaStream_t stream) {
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    return fail("can_implement", status);
  }
  // Only the stream-K baseline needs a workspace; it keeps one buffer per process (benchmarks only).
  static void* workspace = nullptr;
  static size_t workspace_bytes = 0;
  size_t need = Gemm::get_workspace_size(args);
  if (need > workspace_bytes) {
    if (workspace != nullptr) {
      cudaFree(workspace);
    }
    if (cudaMalloc(&workspace, need) != cudaSuccess) {
      std::snprintf(g_error, sizeof(g_error), "cudaMalloc of a %zu-byte workspace failed", need);
      return 1;
    }
    workspace_bytes = need;
  }
  status = gemm.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) {
    return fail("initialize", status);
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    return fail("run", status);
  }
  return 0;
}

template <class Element, int RCT, bool SHRINK = true>
int run_lora(void const* x, void const* w, void const* bias, void const* a, void const* b, float const* scale,
             float const* weight, int const* ranks, int R, int RC, void* y, int M, int N, int K, int sms,
             cudaStream_t stream) {
  using G = typename LoraGemm<Element, RCT, SHRINK>::Gemm;
  using Kernel = typename G::GemmKernel;
  constexpr int BK = 64;
  int Kpad = ((K + BK - 1) / BK + 1) * BK;  // one more k-tile: the expand stage
  typename Kernel::MainloopArguments mainloop{
      static_cast<Element const*>(x), {int64_t(K), cute::_1{}, int64_t(M) * K},
      static_cast<Element const*>(w), {int64_t(K), cute::_1{}, int64_t(N) * K},
      static_cast<Element const*>(a), static_cast<Element const*>(b), K, RC, R, scale, weight, ranks};
  cutlass::KernelHardwareInfo hw{0, sms};
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, Kpad, 1}, mainloop,
                             epilogue_args<Kernel>(bias, y, M, N), hw};
  return launch<G>(args, stream);
}

template <class Element, class Cluster, class Scheduler = cutlass::gemm::PersistentScheduler>
int run_plain(void const* x, void const* w, void const* bias, void* y, int M, int N, int K, int sms,
              cudaStream_t stream) {
  using G = typename PlainGemm<Element, Cluster, Scheduler>::Gemm;
  using Kernel = typename G::GemmKernel;
  typename Kernel::MainloopArguments mainloop{
      static_cast<Element const*>(x), cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(M, K, 1)),
      static_cast<Element const*>(w), cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(N, K, 1))};
  cutlass::KernelHardwareInfo hw{0, sms};
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1}, mainloop,
                             epilogue_args<Kernel>(bias, y, M, N), hw};
  return launch<G>(args, stream);
}

}  // namespace fdlora

extern "C" {

// dtype: 0 bf16, 1 fp16. RC = S * R packed rank columns (A [RC, K], B [N, RC] contiguous), RC <= 64.
int fdlora_lora_gemm_sm90(int dtype, void const* x, void const* w, void const* bias, void const* a, void const* b,
                          float const* scale, float const* weight, int const* ranks, int R, int RC, void* y,
                          int M, int N, int K, int sms, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  int rct = RC <= 16 ? 16 : RC <= 32 ? 32 : 64;
  if (RC > 64) {
    std::snprintf(fdlora::g_error, sizeof(fdlora::g_error), "RC=%d above the largest rank tile (64)", RC);
    return 1;
  }
#define FDLORA_RUN(E, T) fdlora::run_lora<E, T>(x, w, bias, a, b, scale, weight, ranks, R, RC, y, M, N, K, sms, s)
  if (dtype == 0) {
    return rct == 16 ? FDLORA_RUN(cutlass::bfloat16_t, 16) : rct == 32 ? FDLORA_RUN(cutlass::bfloat16_t, 32)
                                                                        : FDLORA_RUN(cutlass::bfloat16_t, 64);
  }
  return rct == 16 ? FDLORA_RUN(cutlass::half_t, 16) : rct == 32 ? FDLORA_RUN(cutlass::half_t, 32)
                                                                  : FDLORA_RUN(cutlass::half_t, 64);
#undef FDLORA_RUN
}

// Timing probe: the bf16 r16 kernel without its shrink wgmma (h = 0, so y = x W^T + bias): what the extra
// expand stage and the A loads cost by themselves.
int fdlora_lora_gemm_sm90_noshrink(void const* x, void const* w, void const* bias, void const* a, void const* b,
                                   float const* scale, float const* weight, int const* ranks, int R, int RC, void* y,
                                   int M, int N, int K, int sms, void* stream) {
  return fdlora::run_lora<cutlass::bfloat16_t, 16, false>(x, w, bias, a, b, scale, weight, ranks, R, RC, y, M, N, K,
                                                          sms, static_cast<cudaStream_t>(stream));
}

// The same GEMM without LoRA (CUTLASS's own main loop): variant 1 = cluster 1x1, 2 = cluster 2x1, 3 = stream-K
// (cluster 1x1), for bf16; fp16 has variants 1 and 2.
int fdlora_gemm_sm90(int dtype, int cluster, void const* x, void const* w, void const* bias, void* y, int M, int N,
                     int K, int sms, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  using C1 = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using C2 = cute::Shape<cute::_2, cute::_1, cute::_1>;
  if (dtype == 0 && cluster == 3) {
    return fdlora::run_plain<cutlass::bfloat16_t, C1, cutlass::gemm::StreamKScheduler>(x, w, bias, y, M, N, K, sms, s);
  }
  if (dtype == 0) {
    return cluster == 2 ? fdlora::run_plain<cutlass::bfloat16_t, C2>(x, w, bias, y, M, N, K, sms, s)
                        : fdlora::run_plain<cutlass::bfloat16_t, C1>(x, w, bias, y, M, N, K, sms, s);
  }
  return cluster == 2 ? fdlora::run_plain<cutlass::half_t, C2>(x, w, bias, y, M, N, K, sms, s)
                      : fdlora::run_plain<cutlass::half_t, C1>(x, w, bias, y, M, N, K, sms, s);
}

char const* fdlora_last_error() { return fdlora::g_error; }

}  // extern "C"
