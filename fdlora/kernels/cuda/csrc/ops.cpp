// fd-lora CUDA backend: the ops (TORCH_LIBRARY namespace fdlora_cuda), same set and semantics as the Triton
// backend (fdlora/kernels/triton/ops.py) and the torch reference (fdlora/kernels/ops/lora.py).
//
// Bank layout: A [S, R, K] contiguous, B [N, S, R] (S*R contiguous, any row stride), scale [S] fp32,
// group_weight [G, S] fp32 (G divides M), row_slot [M] int32 (-1 = none), ranks [S] int32 (live rank; the kernels
// read no chunk past it rounded up to 16, nor any chunk of a slot whose scale is 0).
//
// Which path runs (all decided from shapes on the host, so a CUDA graph replays it):
// - few rows (M <= SMALL_M): one hand-written kernel per call (kernels.cu, delta_small);
// - more rows: the bank's live chunks masked into scratch, cuBLAS shrink with fp32 output, one weighting kernel,
//   cuBLAS expand-add onto y (beta = 1: the delta is added in fp32, rounded once);
// - lora_linear, blend (G = 1) where the merge costs less than the delta: merge W' = W + sum_s w_s B_s A_s into
//   scratch (one kernel) and one cuBLAS GEMM on it (BoundLinear: one planned cuBLASLt matmul);
// - per-sample blends bound by the eager layer (BoundSamples): each blend merged by a cuBLASLt matmul that reads W
//   as C, then the batch's GEMMs on the copies (GroupJobs, shared with BoundGroups' kept copies).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "kernels.h"

namespace fdlora_cuda {
namespace {

constexpr int64_t SMALL_M = 32;

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK(false, "fdlora_cuda: dtype ", t, " is not fp16, bf16 or fp32");
  }
}

// Every operand on `x`'s CUDA device: a kernel handed a host (or another GPU's) pointer faults the whole context
// (an illegal memory access, reported later at some unrelated call), so a misplaced tensor is refused here.
void check_device(const char* op, const at::Tensor& x, std::initializer_list<const at::Tensor*> others) {
  TORCH_CHECK(x.is_cuda(), "fdlora_cuda.", op, ": tensors must be on a CUDA device, got x on ", x.device());
  for (const at::Tensor* t : others)
    TORCH_CHECK(t->device() == x.device(), "fdlora_cuda.", op, ": every tensor must be on ", x.device(),
                " (x's device); got one of shape ", t->sizes(), " on ", t->device(), ". Move the adapter bank with "
                "the model (.to()), or report a bug if an offload hook moved it");
}

void check_bank(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const char* op) {
  check_device(op, x, {&A, &B});
  TORCH_CHECK(x.dim() == 2 && A.dim() == 3 && B.dim() == 3, "fdlora_cuda.", op,
              ": expected x [M, K], A [S, R, K], B [N, S, R]");
  TORCH_CHECK(A.size(2) == x.size(1) && B.size(1) == A.size(0) && B.size(2) == A.size(1), "fdlora_cuda.", op,
              ": shapes do not match: x ", x.sizes(), ", A ", A.sizes(), ", B ", B.sizes());
  TORCH_CHECK(x.scalar_type() == A.scalar_type() && A.scalar_type() == B.scalar_type(), "fdlora_cuda.", op,
              ": x, A and B must share a dtype (got ", x.scalar_type(), ", ", A.scalar_type(), ", ",
              B.scalar_type(), ")");
  TORCH_CHECK(A.is_contiguous(), "fdlora_cuda.", op, ": A must be contiguous");
  TORCH_CHECK(B.stride(2) == 1 && B.stride(1) == B.size(2), "fdlora_cuda.", op,
              ": B's [S, R] must be contiguous (a slice of slots is fine)");
}

at::Tensor rows_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// h [M, S*R] fp32 = x [M, K] @ A2 [S*R, K]^T: the intermediate is never rounded.
void shrink_into(at::Tensor& h, const at::Tensor& x, const at::Tensor& A2) {
  const int64_t M = x.size(0), K = x.size(1), SR = A2.size(0);
  if (M == 0 || SR == 0) return;
  if (K == 0) {
    h.zero_();
    return;
  }
  TORCH_CHECK(M < INT32_MAX && K < INT32_MAX && SR < INT32_MAX, "fdlora_cuda: sizes exceed cuBLAS' int range");
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.f, beta = 0.f;
  const cudaDataType_t t = cuda_type(x.scalar_type());
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)SR, (int)M, (int)K, &alpha,
                                    A2.data_ptr(), t, (int)A2.stride(0), x.data_ptr(), t, (int)x.stride(0), &beta,
                                    h.data_ptr(), CUDA_R_32F, (int)h.stride(0), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

// C = op(A) op(B) + beta C, column-major, operands and C in dtype, fp32 compute (cuBLAS directly: no dispatcher).
void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, at::ScalarType dtype) {
  if (m == 0 || n == 0) return;
  TORCH_CHECK(m < INT32_MAX && n < INT32_MAX && k < INT32_MAX, "fdlora_cuda: sizes exceed cuBLAS' int range");
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.f;
  const cudaDataType_t t = cuda_type(dtype);
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, ta, tb, (int)m, (int)n, (int)k, &alpha, A, t, (int)lda, B, t, (int)ldb,
                                    &beta, C, t, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// y += ((x A^T) * w) B^T through cuBLAS over the masked bank.
void delta_large(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& scale, const at::Tensor& ranks, const Weights& w) {
  const int64_t M = x.size(0), S = A.size(0), R = A.size(1), K = A.size(2), N = B.size(0);
  auto Am = at::empty({S * R, K}, A.options());
  auto Bm = at::empty({N, S * R}, B.options());
  launch_mask(Am, Bm, A, B, scale, ranks);
  auto h = at::empty({M, S * R}, x.options().dtype(at::kFloat));
  shrink_into(h, x, Am);
  auto hw = at::empty({M, S * R}, x.options());
  launch_weigh(hw, h, w, S, R);
  y.addmm_(hw, Bm.t());
}

void delta_impl(at::Tensor& y, const at::Tensor& x_in, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& scale, const at::Tensor& ranks, Weights w, const char* op) {
  check_bank(x_in, A, B, op);
  check_device(op, x_in, {&y, &scale, &ranks});
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == A.size(0) && ranks.is_contiguous(),
              "fdlora_cuda.", op, ": ranks must be contiguous int32 [S]");
  w.ranks = ranks.data_ptr<int>();
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x_in.size(0) && y.size(1) == B.size(0) && y.scalar_type() ==
              x_in.scalar_type(), "fdlora_cuda.", op, ": y must be [M, N] in x's dtype, got ", y.sizes());
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = rows_contiguous(x_in);
  if (x.size(0) == 0 || y.size(1) == 0 || A.size(0) == 0) return;
  if (y.stride(1) == 1 && x.size(0) <= SMALL_M && launch_delta_small(y, x, A, B, ranks, w)) return;
  if (y.stride(1) == 1) {
    delta_large(y, x, A, B, scale, ranks, w);
    return;
  }
  auto yc = y.contiguous();
  delta_large(yc, x, A, B, scale, ranks, w);
  y.copy_(yc);
}

// The merged path pays the merge (one kernel: W read, W' written, the live rank's product on tensor cores, on CUDA
// cores for fp32; the GEMM then reads W' instead of W) instead of the delta's bytes (x re-read, y read-modify-written)
// and its launches and scratch: a rough cost model in bytes-equivalents (the merge runs at about half a copy's
// bandwidth on an H200: benchmarks/probes/probe_merge_kernel.py), a launch with its host work counted as 10e6 (on an
// H100 host, SDXL's text-attention k/v, 154 x 2048 -> 1280, took 59.5 us of host per call on the delta path, ~21 us
// on the merged path, where F.linear takes 17; benchmarks/probes/probe_bound_linear.py re-measures it).
bool merged_wins(int64_t M, int64_t N, int64_t K, int64_t SR, int64_t elt) {
  const double merge = (double)N * K * 3 * elt + 2 * 10e6;  // W read, W' written, + the product; merge + GEMM
  const double delta = (double)M * (K * elt + 2 * N * elt + (double)SR * 8) + 4 * 10e6;  // GEMM, mask, shrink, expand
  return merge < delta;
}

// Whether lora_linear runs the merged path for these shapes (a blend, more rows than the small-M kernel takes).
bool takes_merged(int64_t M, int64_t N, int64_t K, int64_t SR, int64_t G, int64_t elt) {
  return G == 1 && M > SMALL_M && SR > 0 && merged_wins(M, N, K, SR, elt);
}

MergeEntry entry_of(const at::Tensor& out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& scale) {
  return MergeEntry{(int64_t)out.data_ptr(), (int64_t)W.data_ptr(), (int64_t)A.data_ptr(), (int64_t)B.data_ptr(),
                    (int64_t)scale.data_ptr(), W.size(0), W.size(1), out.stride(0), out.stride(1), W.stride(0),
                    W.stride(1), B.stride(0), 0};
}

int64_t tiles_of(int64_t N, int64_t K) {
  return ((N + MERGE_BN - 1) / MERGE_BN) * ((K + MERGE_BK - 1) / MERGE_BK);
}

void check_merge(const at::Tensor& out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& scale) {
  check_device("lora_merge", W, {&out, &A, &B, &scale});
  TORCH_CHECK(W.dim() == 2 && out.sizes() == W.sizes() && A.dim() == 3 && B.dim() == 3 && A.size(2) == W.size(1) &&
              B.size(0) == W.size(0) && B.size(1) == A.size(0) && B.size(2) == A.size(1),
              "fdlora_cuda.lora_merge: expected out, W [N, K], A [S, R, K], B [N, S, R]; got W ", W.sizes(), ", A ",
              A.sizes(), ", B ", B.sizes());
  TORCH_CHECK(out.scalar_type() == W.scalar_type() && W.scalar_type() == A.scalar_type() &&
              A.scalar_type() == B.scalar_type(), "fdlora_cuda.lora_merge: out, W, A and B must share a dtype");
  TORCH_CHECK(A.is_contiguous() && B.stride(2) == 1 && B.stride(1) == B.size(2),
              "fdlora_cuda.lora_merge: A must be contiguous and B's [S, R] contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.stride(0) == 1, "fdlora_cuda.lora_merge: scale must be "
              "contiguous fp32");
}

// ---- ops --------------------------------------------------------------------------------------------------------
at::Tensor lora_shrink(const at::Tensor& x_in, const at::Tensor& A) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() == 2 && A.dim() == 3 && A.size(2) == x_in.size(1) &&
              A.scalar_type() == x_in.scalar_type(), "fdlora_cuda.lora_shrink: expected x [M, K], A [S, R, K] of "
              "one dtype on CUDA");
  check_device("lora_shrink", x_in, {&A});
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = rows_contiguous(x_in);
  auto h = at::empty({x.size(0), A.size(0) * A.size(1)}, x.options().dtype(at::kFloat));
  shrink_into(h, x, A.contiguous().view({A.size(0) * A.size(1), A.size(2)}));
  return h;
}

void lora_expand_add(at::Tensor y, const at::Tensor& h, const at::Tensor& B, const at::Tensor& scale,
                     const at::Tensor& group_weight) {
  TORCH_CHECK(y.is_cuda() && h.scalar_type() == at::kFloat && h.dim() == 2 && B.dim() == 3 &&
              h.size(1) == B.size(1) * B.size(2) && y.size(0) == h.size(0) && y.size(1) == B.size(0),
              "fdlora_cuda.lora_expand_add: expected y [M, N], h [M, S*R] fp32, B [N, S, R]");
  check_device("lora_expand_add", y, {&h, &B, &scale, &group_weight});
  c10::cuda::CUDAGuard guard(y.device());
  const int64_t M = h.size(0), S = B.size(1), R = B.size(2);
  const Weights w = weights_of(scale, group_weight, c10::nullopt, M);
  auto hw = at::empty({M, S * R}, y.options());
  launch_weigh(hw, h.contiguous(), w, S, R);
  y.addmm_(hw, B.reshape({B.size(0), S * R}).t());
}

void lora_delta(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale,
                const at::Tensor& group_weight, const at::Tensor& ranks) {
  check_device("lora_delta", x, {&group_weight});
  delta_impl(y, x, A, B, scale, ranks, weights_of(scale, group_weight, c10::nullopt, x.size(0)), "lora_delta");
}

void lora_delta_rows(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                     const at::Tensor& scale, const at::Tensor& row_slot, const at::Tensor& ranks) {
  TORCH_CHECK(row_slot.size(0) == x.size(0), "fdlora_cuda.lora_delta_rows: row_slot has ", row_slot.size(0),
              " entries for ", x.size(0), " rows");
  check_device("lora_delta_rows", x, {&row_slot});
  delta_impl(y, x, A, B, scale, ranks, weights_of(scale, c10::nullopt, row_slot, x.size(0)), "lora_delta_rows");
}

// out = W + sum_s scale[s] gw[s] B_s A_s; blends > 1: as many merges, blend b's multipliers gw + b * gw_s0, its
// output the b-th [N, K] block after out's start (out: the first block of a contiguous [blends, N, K]).
void merge_one(const at::Tensor& out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
               const at::Tensor& scale, const at::Tensor& ranks, const float* gw, int64_t gw_s1, int* stamp,
               const int* version, int64_t blends = 1, int64_t gw_s0 = 0) {
  MergeEntry e = entry_of(out, W, A, B, scale);
  launch_merge(W.scalar_type(), e, nullptr, 1, tiles_of(W.size(0), W.size(1)), A.size(0), A.size(1),
               ranks.data_ptr<int>(), gw, gw_s1, stamp, version, W.device(), blends, gw_s0, W.numel());
}

// y = x W^T (+ bias), x [M, K] rows contiguous: cuBLAS directly for a row-major W without bias, else at::linear.
at::Tensor base_linear(const at::Tensor& x, const at::Tensor& W, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = W.size(0), K = W.size(1);
  if (bias.has_value() || W.stride(1) != 1 || M == 0) return at::linear(x, W, bias);
  at::Tensor y = at::empty({M, N}, x.options());
  gemm(CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, W.data_ptr(), W.stride(0), x.data_ptr(), x.stride(0), 0.f, y.data_ptr(), N,
       W.scalar_type());
  return y;
}

// W' = W + sum_s scale[s] gw[s] B_s A_s into scratch (one merge kernel, fp32 sum, one rounding), for the merged path.
at::Tensor merged_scratch(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale,
                          const at::Tensor& group_weight, const at::Tensor& ranks) {
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == A.size(0) && ranks.is_contiguous(),
              "fdlora_cuda.lora_linear: ranks must be contiguous int32 [S]");
  TORCH_CHECK(group_weight.scalar_type() == at::kFloat, "fdlora_cuda.lora_linear: group_weight must be fp32");
  const at::Tensor s = scale.stride(0) == 1 ? scale : scale.contiguous();
  at::Tensor Wm = at::empty({W.size(0), W.size(1)}, W.options());
  merge_one(Wm, W, A, B, s, ranks, group_weight.data_ptr<float>(), group_weight.stride(1), nullptr, nullptr);
  return Wm;
}

at::Tensor lora_linear(const at::Tensor& x_in, const at::Tensor& W, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale,
                       const at::Tensor& group_weight, const at::Tensor& ranks) {
  check_bank(x_in, A, B, "lora_linear");
  check_device("lora_linear", x_in, {&W, &scale, &group_weight, &ranks});
  if (bias.has_value()) check_device("lora_linear", x_in, {&*bias});
  TORCH_CHECK(W.dim() == 2 && W.size(1) == x_in.size(1) && W.size(0) == B.size(0) && W.scalar_type() ==
              x_in.scalar_type(), "fdlora_cuda.lora_linear: W must be [N, K] in x's dtype, got ", W.sizes());
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = rows_contiguous(x_in);
  const int64_t M = x.size(0), N = W.size(0), K = W.size(1), SR = A.size(0) * A.size(1);
  if (takes_merged(M, N, K, SR, group_weight.size(0), x.element_size()))
    return base_linear(x, merged_scratch(W, A, B, scale, group_weight, ranks), bias);  // then one GEMM on W'
  at::Tensor y = base_linear(x, W, bias);
  delta_impl(y, x, A, B, scale, ranks, weights_of(scale, group_weight, c10::nullopt, M), "lora_linear");
  return y;
}

void lora_merge(at::Tensor out, const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& scale, const at::Tensor& ranks, const c10::optional<at::Tensor>& stamp,
                const c10::optional<at::Tensor>& version) {
  check_merge(out, W, A, B, scale);
  check_device("lora_merge", W, {&ranks});
  TORCH_CHECK(stamp.has_value() == version.has_value(), "fdlora_cuda.lora_merge: give stamp and version together");
  if (stamp.has_value())
    TORCH_CHECK(stamp->scalar_type() == at::kInt && stamp->numel() == A.size(0) + 2 && stamp->is_contiguous() &&
                version->scalar_type() == at::kInt, "fdlora_cuda.lora_merge: stamp must be int32 [S + 2], version "
                "int32 [1]");
  if (stamp.has_value()) check_device("lora_merge", W, {&*stamp, &*version});
  c10::cuda::CUDAGuard guard(W.device());
  merge_one(out, W, A, B, scale, ranks, nullptr, 0, stamp ? stamp->data_ptr<int>() : nullptr,
            version ? version->data_ptr<int>() : nullptr);
}

void lora_merge_many(at::TensorList outs, at::TensorList Ws, at::TensorList As, at::TensorList Bs,
                     at::TensorList scales) {
  const int64_t L = (int64_t)Ws.size();
  TORCH_CHECK(outs.size() == Ws.size() && As.size() == Ws.size() && Bs.size() == Ws.size() &&
              scales.size() == Ws.size(), "fdlora_cuda.lora_merge_many: give one out, W, A, B and scale per layer");
  if (L == 0) return;
  const at::Tensor& A0 = As[0];
  auto host = at::empty({L * (int64_t)(sizeof(MergeEntry) / sizeof(int64_t))},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* rows = reinterpret_cast<MergeEntry*>(host.data_ptr());
  int64_t tiles = 0;
  for (int64_t l = 0; l < L; ++l) {
    check_merge(outs[l], Ws[l], As[l], Bs[l], scales[l]);
    TORCH_CHECK(As[l].size(0) == A0.size(0) && As[l].size(1) == A0.size(1) &&
                Ws[l].scalar_type() == Ws[0].scalar_type() && Ws[l].device() == Ws[0].device(),
                "fdlora_cuda.lora_merge_many: every layer of one call must share the device, dtype and bank shape "
                "[S, R]");
    rows[l] = entry_of(outs[l], Ws[l], As[l], Bs[l], scales[l]);
    rows[l].first = tiles;
    tiles += tiles_of(Ws[l].size(0), Ws[l].size(1));
  }
  c10::cuda::CUDAGuard guard(Ws[0].device());
  auto table = host.to(Ws[0].device(), /*non_blocking=*/true);
  launch_merge(Ws[0].scalar_type(), rows[0], &table, L, tiles, A0.size(0), A0.size(1), nullptr, nullptr, 0,
               nullptr, nullptr, Ws[0].device());
}

void lora_conv_delta(at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                     const at::Tensor& scale, const at::Tensor& group_weight, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, std::optional<c10::string_view> padding_mode) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && A.dim() == 5 && B.dim() == 3, "fdlora_cuda.lora_conv_delta: expected "
              "x [Bt, C, H, W], A [S, R, C, kh, kw], B [N, S, R]");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t S = A.size(0), R = A.size(1), Bt = y.size(0), N = y.size(1), G = group_weight.size(0);
  auto A2 = A.reshape({S * R, A.size(2), A.size(3), A.size(4)});
  at::Tensor h = padding_mode.has_value() ? at::conv2d(x, A2, c10::nullopt, stride, *padding_mode, dilation)
                                          : at::conv2d(x, A2, c10::nullopt, stride, padding, dilation);
  auto w = (group_weight.to(at::kFloat) * scale.to(at::kFloat).unsqueeze(0)).repeat_interleave(Bt / G, 0);
  auto hw = (h.to(at::kFloat).view({Bt, S, R, -1}) * w.view({Bt, S, 1, 1})).to(x.scalar_type());
  auto delta = at::conv2d(hw.view({Bt, S * R, h.size(2), h.size(3)}), B.reshape({N, S * R, 1, 1}));
  y.copy_((y.to(at::kFloat) + delta.to(at::kFloat)).to(y.scalar_type()));
}

void lora_bias_add(at::Tensor y, const at::Tensor& bias, const at::Tensor& scale, const at::Tensor& group_weight,
                   const c10::optional<at::Tensor>& row_slot) {
  c10::cuda::CUDAGuard guard(y.device());
  const int64_t S = bias.size(0), M = y.size(0);
  at::Tensor w;
  if (row_slot.has_value()) {
    w = (row_slot->to(at::kLong).unsqueeze(1) == at::arange(S, row_slot->options().dtype(at::kLong))).to(at::kFloat) *
        scale.to(at::kFloat);
  } else {
    w = (group_weight.to(at::kFloat) * scale.to(at::kFloat)).repeat_interleave(M / group_weight.size(0), 0);
  }
  y.copy_((y.to(at::kFloat) + at::mm(w, bias.to(at::kFloat))).to(y.scalar_type()));
}

// The eager per-row layer call with everything but x bound (fdlora/layers/decode.py keeps one per layer and shape):
// y = x W^T (+ bias) by cuBLAS, then each row's slot delta (one kernel for few rows). x: [..., K] holding exactly
// row_slot's M rows, in W's dtype, on W's device; y: [..., N].
struct BoundRows {
  at::Tensor W;
  c10::optional<at::Tensor> bias;
  at::Tensor A, B, scale, row_slot, ranks;
  at::Tensor operator()(const at::Tensor& x_in) const {
    const int64_t N = W.size(0), K = W.size(1), M = row_slot.size(0);
    TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K && x_in.numel() == M * K && x_in.scalar_type() ==
                W.scalar_type() && x_in.device() == W.device(), "fdlora_cuda.BoundRows: x ", x_in.sizes(), " (",
                x_in.scalar_type(), ", ", x_in.device(), ") is not the ", M, " rows of ", K, " in ", W.scalar_type(),
                " on ", W.device(), " this launch was bound for");
    std::vector<int64_t> sizes = x_in.sizes().vec();
    sizes.back() = N;
    const at::Tensor x = rows_contiguous(x_in.reshape({M, K}));
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor y = base_linear(x, W, bias);
    delta_impl(y, x, A, B, scale, ranks, weights_of(scale, c10::nullopt, row_slot, M), "lora_delta_rows");
    return y.view(sizes);
  }
};

// A cuBLASLt matmul planned once: its descriptor, the layouts of A, B and C (D shares C's), and the algorithm the
// heuristic picked for them (`find`); `ok` false where any step failed or no algorithm fits.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    for (auto* l : {a, b, c})
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
  // The heuristic's first algorithm for op, a, b, c within `workspace` bytes, every operand 16-byte aligned (the
  // callers check their pointers per call).
  void find(size_t workspace) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return;
    const uint32_t align = 16;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
    cublasLtMatmulHeuristicResult_t found{};
    int returned = 0;
    ok = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), op, a, b, c, c, pref, 1, &found,
                                        &returned) == CUBLAS_STATUS_SUCCESS && returned > 0;
    if (ok) algo = found.algo;
    cublasLtMatmulPreferenceDestroy(pref);
  }
};

// One per-prompt job as a cuBLASLt matmul planned once (layouts, bias epilogue, algorithm): a call is one launch
// with no heuristic query and no bias pre-fill. Y block^T (N x rows, ld N) = W^T-read (N x K) x X block^T (K x rows),
// count blocks `stride` rows apart (block i on the weight `wstride` elements past block 0's), + bias per output
// feature. `ok` false: no algorithm (the cuBLAS path runs).
struct LtJob : LtPlan {
  LtJob(int64_t N, int64_t K, int64_t rows, int64_t count, int64_t stride, int64_t wstride, cudaDataType_t t,
        const void* bias, size_t workspace) {
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return;
    const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof(tr));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt));
    if (bias != nullptr) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    }
    if (cublasLtMatrixLayoutCreate(&a, t, K, N, K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&b, t, K, rows, K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&c, t, N, rows, N) != CUBLAS_STATUS_SUCCESS) return;
    if (count > 1) {
      const int32_t n = (int32_t)count;
      const int64_t a_off = wstride, b_off = stride * K, c_off = stride * N;
      for (auto* l : {a, b, c}) cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n));
      cublasLtMatrixLayoutSetAttribute(a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &a_off, sizeof(a_off));
      cublasLtMatrixLayoutSetAttribute(b, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &b_off, sizeof(b_off));
      cublasLtMatrixLayoutSetAttribute(c, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &c_off, sizeof(c_off));
    }
    find(workspace);
  }
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
constexpr size_t LT_WORKSPACE = 4 << 20;  // bytes a planned matmul may use (Hopper's split-K kernels want some)

// The planned matmuls' workspace: PyTorch's own cuBLASLt workspace of the current device and stream where it holds
// LT_WORKSPACE bytes (no allocation per call; calls on one stream run in order), else LT_WORKSPACE bytes from the
// caching allocator, held until the call's launches are queued.
struct LtWorkspace {
  at::Tensor owned;
  void* ptr = nullptr;
  explicit LtWorkspace(const at::TensorOptions& options) {
    if (at::cuda::getCUDABlasLtWorkspaceSize() >= LT_WORKSPACE) {
      ptr = at::cuda::getCUDABlasLtWorkspace();
    } else {
      owned = at::empty({(int64_t)LT_WORKSPACE}, options.dtype(at::kByte));
      ptr = owned.data_ptr();
    }
  }
};

// lora_linear with every argument but x bound, for the M rows it was bound for: what an eager layer keeps and calls
// (one pybind call, no dispatcher argument parsing). The path (merged: one merge kernel into scratch, then the GEMM
// on W'; else the GEMM, then the delta) is chosen once, and the GEMM is one cuBLASLt matmul planned once (layouts,
// bias epilogue, algorithm): a call is two launches on the merged path with no heuristic query and no bias pre-fill
// (the SDXL UNet without the merged-weight cache issues 722 of these per step, and the step is host-bound). Other
// row counts, or operands the plan cannot take, run lora_linear itself.
struct BoundLinear {
  at::Tensor W;
  c10::optional<at::Tensor> bias;
  at::Tensor A, B, scale, group_weight, ranks;
  int64_t M;
  bool merged = false;
  std::shared_ptr<LtJob> lt;  // y [M, N] = x W^T (+ bias), planned for W's device and dtype; null: no plan
  BoundLinear(at::Tensor W_, c10::optional<at::Tensor> bias_, at::Tensor A_, at::Tensor B_, at::Tensor scale_,
              at::Tensor group_weight_, at::Tensor ranks_, int64_t M_)
      : W(std::move(W_)), bias(std::move(bias_)), A(std::move(A_)), B(std::move(B_)), scale(std::move(scale_)),
        group_weight(std::move(group_weight_)), ranks(std::move(ranks_)), M(M_) {
    const int64_t N = W.size(0), K = W.size(1);
    merged = takes_merged(M, N, K, A.size(0) * A.size(1), group_weight.size(0), W.element_size());
    const void* bp = bias.has_value() ? bias->data_ptr() : nullptr;
    if (!W.is_cuda() || W.dim() != 2 || !W.is_contiguous() || !aligned16(W.data_ptr()) || N % 8 || K % 8 || M <= 0 ||
        (bp != nullptr && !(bias->is_contiguous() && bias->scalar_type() == W.scalar_type() && aligned16(bp))))
      return;
    c10::cuda::CUDAGuard guard(W.device());
    auto job = std::make_shared<LtJob>(N, K, M, 1, 0, 0, cuda_type(W.scalar_type()), bp, LT_WORKSPACE);
    if (job->ok) lt = std::move(job);
  }
  at::Tensor run(const at::Tensor& x) const {  // x [rows, K]
    if (!lt || x.size(0) != M || !x.is_contiguous() || !aligned16(x.data_ptr()) || x.scalar_type() != W.scalar_type()
        || x.device() != W.device())
      return lora_linear(x, W, bias, A, B, scale, group_weight, ranks);
    const int64_t N = W.size(0);
    c10::cuda::CUDAGuard guard(x.device());
    const at::Tensor Wx = merged ? merged_scratch(W, A, B, scale, group_weight, ranks) : W;
    at::Tensor y = at::empty({M, N}, x.options());
    const LtWorkspace ws(x.options());
    const float alpha = 1.f, beta = 0.f;
    TORCH_CUDABLAS_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), lt->op, &alpha, Wx.data_ptr(), lt->a,
                                        x.data_ptr(), lt->b, &beta, y.data_ptr(), lt->c, y.data_ptr(), lt->c,
                                        &lt->algo, ws.ptr, LT_WORKSPACE, at::cuda::getCurrentCUDAStream()));
    if (!merged)
      delta_impl(y, x, A, B, scale, ranks, weights_of(scale, group_weight, c10::nullopt, M), "lora_linear");
    return y;
  }
  at::Tensor operator()(const at::Tensor& x) const {  // x [..., K] -> y [..., N]
    if (x.dim() == 2) return run(x);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == W.size(1), "fdlora_cuda.BoundLinear: x ", x.sizes(), " does not end in ",
                W.size(1));
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = W.size(0);
    return run(x.reshape({-1, W.size(1)})).view(sizes);
  }
};

// The GEMMs of a per-prompt batch, planned once. jobs: 6 ints per job (weight, first row, rows, count, stride, step):
// `count` blocks of `rows` rows, `stride` rows apart, block i on weight `weight + i * step` (step 1: consecutive
// [N, K] blocks of one buffer). Each job is one cuBLASLt matmul with the bias in its epilogue; where Lt has no plan,
// one strided-batched cuBLAS GEMM onto a bias pre-fill.
struct GroupJobs {
  int64_t N = 0, K = 0, M = 0;
  c10::optional<at::Tensor> bias;
  std::vector<int64_t> jobs;
  std::vector<std::shared_ptr<LtJob>> lt;  // one per job (planned for the weights' device and dtype)
  bool all_lt = false;
  GroupJobs(const at::Tensor& W0, c10::optional<at::Tensor> bias_, std::vector<int64_t> jobs_, int64_t M_)
      : N(W0.size(0)), K(W0.size(1)), M(M_), bias(std::move(bias_)), jobs(std::move(jobs_)) {
    TORCH_CHECK(jobs.size() % 6 == 0, "fdlora_cuda: per-prompt jobs take 6 ints each, got ", jobs.size());
    c10::cuda::CUDAGuard guard(W0.device());
    const void* bp = bias.has_value() ? bias->data_ptr() : nullptr;
    const bool usable = (bp == nullptr || (bias->is_contiguous() && bias->scalar_type() == W0.scalar_type() &&
                                           aligned16(bp))) && N % 8 == 0 && K % 8 == 0;
    all_lt = usable;
    for (size_t j = 0; j + 5 < jobs.size(); j += 6) {
      auto job = usable ? std::make_shared<LtJob>(N, K, jobs[j + 2], jobs[j + 3], jobs[j + 4], jobs[j + 5] * N * K,
                                                  cuda_type(W0.scalar_type()), bp, LT_WORKSPACE)
                        : nullptr;
      all_lt = all_lt && job && job->ok;
      lt.push_back(job);
    }
  }
  // y = the batch's rows, each block on its weight; weights: addresses of [N, K] row-major weights in the dtype and
  // on the device of `like` (one of them), which x must share. `ws`: a caller's workspace for the planned matmuls
  // (one is taken when none is given).
  at::Tensor run(const at::Tensor& x_in, const std::vector<const void*>& weights, const at::Tensor& like,
                 const char* who, const LtWorkspace* ws_given = nullptr) const {
    TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K && x_in.numel() == M * K && x_in.scalar_type() ==
                like.scalar_type() && x_in.device() == like.device(), "fdlora_cuda.", who, ": x ", x_in.sizes(),
                " is not the ", M, " rows of ", K, " in ", like.scalar_type(), " on ", like.device(),
                " it was bound for");
    std::vector<int64_t> sizes = x_in.sizes().vec();
    sizes.back() = N;
    const at::Tensor x = x_in.reshape({M, K}).contiguous();
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t elt = x.element_size();
    bool planned = all_lt && aligned16(x.data_ptr());
    for (const void* w : weights) planned = planned && aligned16(w);
    float beta = 0.f;
    at::Tensor y;
    if (bias.has_value() && !planned) {
      y = bias->expand({M, N}).contiguous();  // the GEMMs add onto it (fp32 sum, one rounding, as addmm)
      beta = 1.f;
    } else {
      y = at::empty({M, N}, x.options());
    }
    if (M == 0 || N == 0) return y.view(sizes);
    const float alpha = 1.f;
    const cudaDataType_t t = cuda_type(x.scalar_type());
    auto* xp = static_cast<char*>(x.data_ptr());
    auto* yp = static_cast<char*>(y.data_ptr());
    c10::optional<LtWorkspace> own;  // the planned matmuls' workspace, where the caller gave none
    const LtWorkspace* ws = ws_given;
    cublasLtHandle_t lt_handle = nullptr;
    cublasHandle_t handle = nullptr;
    if (planned) {
      if (ws == nullptr) ws = &own.emplace(x.options());
      lt_handle = at::cuda::getCurrentCUDABlasLtHandle();
    } else {
      handle = at::cuda::getCurrentCUDABlasHandle();
    }
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    for (size_t j = 0, i = 0; j + 5 < jobs.size(); j += 6, ++i) {
      const int64_t wi = jobs[j], first = jobs[j + 1], rows = jobs[j + 2], count = jobs[j + 3],
                    stride = jobs[j + 4], step = jobs[j + 5];
      TORCH_CHECK(first >= 0 && rows >= 0 && count >= 1 && first + (count - 1) * stride + rows <= M,
                  "fdlora_cuda.", who, ": a job reaches past the ", M, " rows");
      TORCH_CHECK(wi >= 0 && wi + (count - 1) * step < (int64_t)weights.size(), "fdlora_cuda.", who,
                  ": a job names a weight past the ", weights.size(), " given");
      const void* W = weights[wi];
      for (int64_t b = 1; step != 0 && b < count; ++b)  // the blocks' weights: one buffer, step [N, K] apart
        TORCH_CHECK(static_cast<const char*>(weights[wi + b * step]) ==
                    static_cast<const char*>(W) + b * step * N * K * elt, "fdlora_cuda.", who,
                    ": a job's weights are not consecutive blocks of one buffer");
      if (rows == 0) continue;
      void* xb = xp + first * K * elt;
      void* yb = yp + first * N * elt;
      if (planned) {
        TORCH_CHECK(aligned16(xb) && aligned16(yb), "fdlora_cuda.", who, ": a block is not 16-byte aligned");
        const LtJob& p = *lt[i];
        TORCH_CUDABLAS_CHECK(cublasLtMatmul(lt_handle, p.op, &alpha, W, p.a, xb, p.b, &beta, yb, p.c, yb, p.c,
                                            &p.algo, ws->ptr, LT_WORKSPACE, stream));
      } else {  // y block^T (column-major N x rows) = W (row-major N x K, read transposed) x block^T
        TORCH_CUDABLAS_CHECK(cublasGemmStridedBatchedEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)rows, (int)K, &alpha, W, t, (int)K,
            step * N * K, xb, t, (int)K, stride * K, &beta, yb, t, (int)N, stride * N, (int)count,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    }
    return y.view(sizes);
  }
};

std::vector<int64_t> with_step(const std::vector<int64_t>& jobs5) {  // 5-int jobs, each on one weight: step 0
  TORCH_CHECK(jobs5.size() % 5 == 0, "fdlora_cuda.BoundGroups: jobs take 5 ints each, got ", jobs5.size());
  std::vector<int64_t> jobs;
  for (size_t j = 0; j + 4 < jobs5.size(); j += 5) {
    jobs.insert(jobs.end(), jobs5.begin() + j, jobs5.begin() + j + 5);
    jobs.push_back(0);
  }
  return jobs;
}

// The eager per-prompt layer call (fdlora/layers/fused.py, _grouped_forward) with its copies bound: jobs of 5 ints
// (weight index, first row, rows, count, stride), each on one of `weights` (GroupJobs).
struct BoundGroups {
  std::vector<at::Tensor> weights;  // [N, K] row-major, x's dtype
  GroupJobs plan;
  bool all_lt = false;
  BoundGroups(std::vector<at::Tensor> weights_, c10::optional<at::Tensor> bias, const std::vector<int64_t>& jobs,
              int64_t M)
      : weights(std::move(weights_)), plan(weights.at(0), std::move(bias), with_step(jobs), M) {
    all_lt = plan.all_lt;
    for (const at::Tensor& w : weights) all_lt = all_lt && aligned16(w.data_ptr());
  }
  at::Tensor operator()(const at::Tensor& x) const {
    std::vector<const void*> ptrs;
    ptrs.reserve(weights.size());
    for (const at::Tensor& w : weights) ptrs.push_back(w.data_ptr());
    return plan.run(x, ptrs, weights.at(0), "BoundGroups");
  }
};

// W' = W + Bg A as one cuBLASLt matmul with W read as C and W' written as D (fp32 sum, one rounding), planned once:
// column-major, D (K x N, ld K) = A^T-as-stored (K x nR, ld K) x Bg^T-as-stored (nR x N, ld nR) + C.
struct LtMerge : LtPlan {
  LtMerge(int64_t N, int64_t K, int64_t nR, cudaDataType_t t, size_t workspace) {
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return;
    if (cublasLtMatrixLayoutCreate(&a, t, K, nR, K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&b, t, nR, N, nR) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&c, t, K, N, K) != CUBLAS_STATUS_SUCCESS) return;
    find(workspace);
  }
};

// Per-prompt blends with no kept copy (the merged-weight cache off or full), bound for x's row count: each call
// merges every blend's W'_b into one scratch [nb, N, K] and runs the batch's GEMMs on the copies (GroupJobs; a batch
// of one sample per blend is one strided-batched matmul over the scratch). Weight index nb is W itself (samples with
// no adapter). Two ways to merge, bound at construction:
// - from the bank (A [S, R, K], B [N, S, R], scale [S], ranks [S], blends [nb, S] fp32): every blend in one launch
//   of the merge kernel (W'_b = W + sum_s scale[s] blends[b, s] B_s A_s, fp32 sum, one rounding): for weights small
//   enough that the call's launches, not its bytes, set its cost;
// - from factors (A [nR, K], Bg [nb, N, nR]: each blend's B columns scaled by alpha/r and its weights, nR a multiple
//   of 8): one planned cuBLASLt matmul per blend, W read in place as C (faster on large weights).
// `planned` false: some matmul has no Lt plan, and the caller keeps its other form.
struct BoundSamples {
  at::Tensor W, A, Bg;  // factors
  at::Tensor bankA, bankB, scale, ranks, blends;  // bank (defined when the merge kernel merges)
  GroupJobs plan;
  std::shared_ptr<LtMerge> merge;
  bool planned = false;
  BoundSamples(at::Tensor W_, c10::optional<at::Tensor> bias, at::Tensor A_, at::Tensor Bg_, std::vector<int64_t> jobs,
               int64_t M)
      : W(std::move(W_)), A(std::move(A_)), Bg(std::move(Bg_)), plan(W, std::move(bias), std::move(jobs), M) {
    const int64_t N = W.size(0), K = W.size(1), nR = A.size(0);
    TORCH_CHECK(W.is_cuda() && W.dim() == 2 && A.dim() == 2 && Bg.dim() == 3 && A.size(1) == K && Bg.size(1) == N &&
                Bg.size(2) == nR && A.scalar_type() == W.scalar_type() && Bg.scalar_type() == W.scalar_type() &&
                A.device() == W.device() && Bg.device() == W.device(), "fdlora_cuda.BoundSamples: expected W [N, K], "
                "A [nR, K], Bg [nb, N, nR] of one dtype and device; got W ", W.sizes(), ", A ", A.sizes(), ", Bg ",
                Bg.sizes());
    if (!W.is_contiguous() || !A.is_contiguous() || !Bg.is_contiguous() || nR % 8 || !aligned16(W.data_ptr()) ||
        !aligned16(A.data_ptr()) || !aligned16(Bg.data_ptr()) || !plan.all_lt)
      return;
    c10::cuda::CUDAGuard guard(W.device());
    auto m = std::make_shared<LtMerge>(N, K, nR, cuda_type(W.scalar_type()), LT_WORKSPACE);
    if (!m->ok) return;
    merge = std::move(m);
    planned = true;
  }
  BoundSamples(at::Tensor W_, c10::optional<at::Tensor> bias, at::Tensor A_, at::Tensor B_, at::Tensor scale_,
               at::Tensor ranks_, at::Tensor blends_, std::vector<int64_t> jobs, int64_t M)
      : W(std::move(W_)), bankA(std::move(A_)), bankB(std::move(B_)), scale(std::move(scale_)),
        ranks(std::move(ranks_)), blends(std::move(blends_)), plan(W, std::move(bias), std::move(jobs), M) {
    check_merge(W, W, bankA, bankB, scale);
    check_device("BoundSamples", W, {&ranks, &blends});
    TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == bankA.size(0) && ranks.is_contiguous() &&
                blends.scalar_type() == at::kFloat && blends.dim() == 2 && blends.size(1) == bankA.size(0) &&
                blends.is_contiguous() && scale.numel() == bankA.size(0), "fdlora_cuda.BoundSamples: expected ranks "
                "int32 [S], scale fp32 [S] and blends fp32 [nb, S] for a bank of ", bankA.size(0), " slots");
    planned = W.is_contiguous() && aligned16(W.data_ptr()) && plan.all_lt;
  }
  at::Tensor operator()(const at::Tensor& x) const {
    TORCH_CHECK(planned, "fdlora_cuda.BoundSamples: no cuBLASLt plan for these shapes; use the unbound form");
    const bool banked = blends.defined();
    const int64_t nb = banked ? blends.size(0) : Bg.size(0), N = W.size(0), K = W.size(1);
    c10::cuda::CUDAGuard guard(W.device());
    at::Tensor scratch = at::empty({nb, N, K}, W.options());
    const int64_t elt = W.element_size();
    char* out = static_cast<char*>(scratch.data_ptr());
    const LtWorkspace ws(W.options());  // the cuBLASLt merges' and the GEMMs'
    if (banked) {
      merge_one(scratch.select(0, 0), W, bankA, bankB, scale, ranks, blends.data_ptr<float>(), 1, nullptr, nullptr, nb,
                blends.size(1));
    } else {
      const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
      const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
      const float alpha = 1.f, beta = 1.f;
      const LtMerge& m = *merge;
      char* bg = static_cast<char*>(Bg.data_ptr());
      for (int64_t b = 0; b < nb; ++b)
        TORCH_CUDABLAS_CHECK(cublasLtMatmul(handle, m.op, &alpha, A.data_ptr(), m.a, bg + b * N * A.size(0) * elt, m.b,
                                            &beta, W.data_ptr(), m.c, out + b * N * K * elt, m.c, &m.algo, ws.ptr,
                                            LT_WORKSPACE, stream));
    }
    std::vector<const void*> weights;
    weights.reserve(nb + 1);
    for (int64_t b = 0; b < nb; ++b) weights.push_back(out + b * N * K * elt);
    weights.push_back(W.data_ptr());
    return plan.run(x, weights, W, "BoundSamples", &ws);
  }
};

}  // namespace
}  // namespace fdlora_cuda

// Direct entry points for plain eager calls (fdlora/kernels/cuda/ops.py decides when a call may skip the
// dispatcher); everything traced or compiled goes through torch.ops.fdlora_cuda.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_delta", &fdlora_cuda::lora_delta);
  m.def("lora_delta_rows", &fdlora_cuda::lora_delta_rows);
  m.def("lora_linear", &fdlora_cuda::lora_linear);
  pybind11::class_<fdlora_cuda::BoundLinear>(m, "BoundLinear")
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, int64_t>())
      .def_readonly("merged", &fdlora_cuda::BoundLinear::merged)
      .def_property_readonly("planned", [](const fdlora_cuda::BoundLinear& b) { return b.lt != nullptr; })
      .def("__call__", &fdlora_cuda::BoundLinear::operator());
  pybind11::class_<fdlora_cuda::BoundRows>(m, "BoundRows")
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor>())
      .def("__call__", &fdlora_cuda::BoundRows::operator());
  pybind11::class_<fdlora_cuda::BoundGroups>(m, "BoundGroups")
      .def_readonly("planned", &fdlora_cuda::BoundGroups::all_lt)
      .def(pybind11::init<std::vector<at::Tensor>, c10::optional<at::Tensor>, std::vector<int64_t>, int64_t>())
      .def("__call__", &fdlora_cuda::BoundGroups::operator());
  pybind11::class_<fdlora_cuda::BoundSamples>(m, "BoundSamples")
      .def_readonly("planned", &fdlora_cuda::BoundSamples::planned)
      .def_property_readonly("banked", [](const fdlora_cuda::BoundSamples& b) { return b.blends.defined(); })
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor, std::vector<int64_t>,
                          int64_t>())
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, std::vector<int64_t>, int64_t>())
      .def("__call__", &fdlora_cuda::BoundSamples::operator());
}

TORCH_LIBRARY(fdlora_cuda, m) {
  m.def("lora_shrink(Tensor x, Tensor A) -> Tensor");
  m.def("lora_expand_add(Tensor(a!) y, Tensor h, Tensor B, Tensor scale, Tensor group_weight) -> ()");
  m.def("lora_delta(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor scale, Tensor group_weight, Tensor ranks) -> ()");
  m.def("lora_delta_rows(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor scale, Tensor row_slot, Tensor ranks) -> ()");
  m.def("lora_linear(Tensor x, Tensor W, Tensor? bias, Tensor A, Tensor B, Tensor scale, Tensor group_weight, "
        "Tensor ranks) -> Tensor");
  m.def("lora_merge(Tensor(a!) out, Tensor W, Tensor A, Tensor B, Tensor scale, Tensor ranks, Tensor(b!)? stamp=None, "
        "Tensor? version=None) -> ()");
  m.def("lora_merge_many(Tensor(a!)[] outs, Tensor[] Ws, Tensor[] As, Tensor[] Bs, Tensor[] scales) -> ()");
  m.def("lora_conv_delta(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor scale, Tensor group_weight, int[] stride, "
        "int[] padding, int[] dilation, str? padding_mode=None) -> ()");
  m.def("lora_bias_add(Tensor(a!) y, Tensor bias, Tensor scale, Tensor group_weight, Tensor? row_slot=None) -> ()");
}

TORCH_LIBRARY_IMPL(fdlora_cuda, CUDA, m) {
  m.impl("lora_shrink", &fdlora_cuda::lora_shrink);
  m.impl("lora_expand_add", &fdlora_cuda::lora_expand_add);
  m.impl("lora_delta", &fdlora_cuda::lora_delta);
  m.impl("lora_delta_rows", &fdlora_cuda::lora_delta_rows);
  m.impl("lora_linear", &fdlora_cuda::lora_linear);
  m.impl("lora_merge", &fdlora_cuda::lora_merge);
  m.impl("lora_merge_many", &fdlora_cuda::lora_merge_many);
  m.impl("lora_conv_delta", &fdlora_cuda::lora_conv_delta);
  m.impl("lora_bias_add", &fdlora_cuda::lora_bias_add);
}
