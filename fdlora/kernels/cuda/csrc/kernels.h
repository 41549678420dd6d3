// fd-lora CUDA backend: the hand-written kernels (kernels.cu) that ops.cpp launches next to cuBLAS.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace fdlora_cuda {

// Per-row weights of the slots: blend / per-sample segments (group_weight [G, S], rows of group g are
// g*M/G..(g+1)*M/G) or per-row slots (row_slot [M], -1 = none). w(m, s) = scale[s] * group_weight[g(m), s], or
// scale[s] when row_slot[m] == s, else 0.
struct Weights {
  const float* scale;  // [S]
  int64_t scale_stride;
  const float* gw;  // [G, S] or nullptr
  int64_t gw_s0, gw_s1, rows_per_group;
  const int* row_slot;  // [M] or nullptr
  const int* ranks;  // [S] or nullptr: a slot of rank 0 weighs 0
};

Weights weights_of(const at::Tensor& scale, const c10::optional<at::Tensor>& group_weight,
                   const c10::optional<at::Tensor>& row_slot, int64_t M);

// A', B' = A, B with every chunk the kernels must not read (inactive slot: scale 0; past the live rank rounded up
// to 16) set to zero, so one cuBLAS GEMM over the whole bank computes only what is live.
// With gw (a [1, S] group weight, the blend's), B' is also scaled: B'_s = B_s * scale[s] * gw[s], rounded to B's
// dtype (the merge's operand: W' = W + B' A').
void launch_mask(at::Tensor& A_out, at::Tensor& B_out, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& scale, const at::Tensor& ranks, const float* gw = nullptr, int64_t gw_s1 = 0);

// hw[m, s*R + r] = h[m, s*R + r] * w(m, s), rounded to hw's dtype; exactly 0 where w is 0 (h may be NaN there).
void launch_weigh(at::Tensor& hw, const at::Tensor& h, const Weights& w, int64_t S, int64_t R);

// y[m] += sum_s w(m, s) (x[m] A_s^T) B_s^T for few rows: one block per (row, column tile), h in shared memory.
// Returns false (launching nothing) when the bank's S*R does not fit the shared-memory plan.
bool launch_delta_small(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                        const at::Tensor& ranks, const Weights& w);

// One merge job: out = W + sum_s scale[s] * gw[s] * B_s A_s (fp32 sum, one rounding).
struct MergeEntry {
  int64_t out, W, A, B, scale;  // addresses
  int64_t N, K, son, sok, swn, swk, ldb;  // sizes and strides (B: [N, S, R] with row stride ldb, S*R contiguous)
  int64_t first;  // tiles before this entry
};

constexpr int MERGE_BN = 64;
constexpr int MERGE_BK = 128;

// Merge every entry in one launch (entries: a device int64 table of MergeEntry rows, or one entry passed by value
// when the table is null). stamp/version: skip on the device when the stamp says nothing changed, then stamp.
// blends > 1 (no stamp): as many merges of the one entry, blend b with the multipliers gw + b * gw_s0 into
// out + b * blend_out elements (each per-prompt blend's W' in one launch).
void launch_merge(at::ScalarType dtype, const MergeEntry& one, const at::Tensor* table, int64_t n_entries,
                  int64_t total_tiles, int64_t S, int64_t R, const int* ranks, const float* gw, int64_t gw_s1,
                  int* stamp, const int* version, c10::Device device, int64_t blends = 1, int64_t gw_s0 = 0,
                  int64_t blend_out = 0);

}  // namespace fdlora_cuda
