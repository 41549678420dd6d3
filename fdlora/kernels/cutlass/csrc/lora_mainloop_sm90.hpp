// LoRA-fused main loop for CUTLASS's Hopper warp-specialized cooperative GEMM kernel.
//
//   y = x W^T (+ bias) + ((x A^T) * w) B^T          x [M, K], W [N, K], A [RC, K], B [N, RC], w [RC] fp32
//
// A drop-in replacement for cutlass::gemm::collective::CollectiveMma<MainloopSm90TmaGmmaWarpSpecialized>
// (cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized.hpp, CUTLASS 4.2, BSD-3-Clause, which this
// file follows line by line where it can), used by the stock kernel (GemmUniversal, cooperative schedule)
// and the stock TMA epilogue. Two changes:
//
// - every pipeline stage also carries the k-slice of A ([RCT, BK]); the consumer warpgroups multiply
//   the x tile they already have in shared memory by it (a second, N = RCT wgmma per k-block), so
//   h = x A^T [BM, RCT] accumulates in fp32 beside the [BM, BN] accumulator, at RCT/BN of the MMA work;
// - the kernel is launched with K padded by one k-tile: that extra stage carries the N tile of B
//   ([BN, RCT], TMA zero-fills the columns past RC up to BK) in place of W, and the consumers finish the tile
//   with acc += bf16(h * w) B^T (A operand from registers: the h accumulator layout is the wgmma A layout).
//
// So the epilogue (bias, cast, TMA store) sees base + delta in fp32 and rounds once. Everything the
// kernel knows about K (k-tile counts) comes from the padded problem shape; the real K lives in Params.
// The column weights w (scale * blend weight, zero past a slot's rank) are computed from the bank's
// per-slot scale [S], weight [S] and rank [S] (S * R = RC columns, slot-major like A [S, R, K]).
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/algorithm/gemm.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"

namespace fdlora {
using namespace cute;

// SHRINK = false leaves the shrink wgmma out (h stays zero): a timing probe of the other costs, never a result.
template <int Stages, class TileShape_, class Element, int RCT, bool SHRINK = true>
struct LoraMainloopSm90 {
  using ClusterShape = Shape<_1, _1, _1>;
  using DispatchPolicy = cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<
      Stages, ClusterShape, cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using TileShape = TileShape_;
  using ElementA = Element;
  using ElementB = Element;
  using StrideA = cute::Stride<int64_t, _1, int64_t>;  // K-major x [M, K]
  using StrideB = cute::Stride<int64_t, _1, int64_t>;  // K-major W [N, K]
  using ArchTag = typename DispatchPolicy::ArchTag;

  static constexpr int BM = size<0>(TileShape{});
  static constexpr int BN = size<1>(TileShape{});
  static constexpr int BK = size<2>(TileShape{});
  static_assert(BM == 128, "cooperative: two consumer warpgroups of 64 rows");
  static_assert(RCT % 16 == 0 && RCT <= BK, "the packed rank tile is a multiple of 16 up to BK");

  using AtomLayout = Layout<Shape<_2, _1, _1>>;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BN>, Int<BK>>>(), AtomLayout{}));
  using TiledMmaH = decltype(make_tiled_mma(  // h += x A^T
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<RCT>, Int<BK>>>(), AtomLayout{}));
  using TiledMmaE = decltype(make_tiled_mma(  // acc += h B^T, h from registers
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<BN>, Int<RCT>>>(), AtomLayout{}));
  using ElementAccumulator = float;

  using GmemTiledCopyA = SM90_TMA_LOAD;
  using GmemTiledCopyB = SM90_TMA_LOAD;
  using SmemLayoutAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutA = decltype(tile_to_shape(SmemLayoutAtom{}, make_shape(Int<BM>{}, Int<BK>{}, Int<Stages>{})));
  using SmemLayoutB = decltype(tile_to_shape(SmemLayoutAtom{}, make_shape(Int<BN>{}, Int<BK>{}, Int<Stages>{})));
  using SmemLayoutL = decltype(tile_to_shape(SmemLayoutAtom{}, make_shape(Int<RCT>{}, Int<BK>{}, Int<Stages>{})));

  using MainloopPipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  static constexpr int NumProducerThreadEvents = 1;

  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, _0> {
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutA>> smem_A;
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutB>> smem_B;
      cute::array_aligned<Element, cute::cosize_v<SmemLayoutL>> smem_L;
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  struct Arguments {
    Element const* ptr_A;  // x
    StrideA dA;
    Element const* ptr_B;  // W
    StrideB dB;
    Element const* ptr_LA;  // A [RC, K]
    Element const* ptr_LB;  // B [N, RC]
    int K;                  // real K (the problem shape carries K padded by one k-tile)
    int RC;                 // packed rank columns S * R
    int slot_rank;          // rank capacity R of one slot
    float const* scale;     // [S]
    float const* weight;    // [S] blend weights (group_weight row 0)
    int const* ranks;       // [S]
  };

  static constexpr uint32_t TmaTransactionBytes =
      (BM * BK + BN * BK + RCT * BK) * static_cast<uint32_t>(sizeof(Element));

  template <class T>
  static auto make_tensor_2d(T const* ptr, int rows, int cols) {  // K-major [rows, cols] with a unit L mode
    return make_tensor(ptr, make_layout(make_shape(rows, cols, 1),
                                        make_stride(int64_t(cols), _1{}, int64_t(rows) * cols)));
  }

  struct Params {
    using TMA_A = decltype(make_tma_copy_A_sm90(
        GmemTiledCopyA{}, make_tensor_2d(static_cast<Element const*>(nullptr), 0, 0),
        SmemLayoutA{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{}));
    using TMA_B = decltype(make_tma_copy_B_sm90(
        GmemTiledCopyB{}, make_tensor_2d(static_cast<Element const*>(nullptr), 0, 0),
        SmemLayoutB{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{}));
    using TMA_L = decltype(make_tma_copy_B_sm90(
        GmemTiledCopyB{}, make_tensor_2d(static_cast<Element const*>(nullptr), 0, 0),
        SmemLayoutL{}(_, _, cute::Int<0>{}), Shape<Int<BM>, Int<RCT>, Int<BK>>{}, ClusterShape{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    TMA_B tma_load_lb;  // B [N, RC] through W's box and shared-memory layout
    TMA_L tma_load_la;
    int K, RC, slot_rank;
    float const* scale;
    float const* weight;
    int const* ranks;
    uint32_t tma_transaction_bytes = TmaTransactionBytes;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    (void)workspace;
    auto [M, N, Kpad, L] = append<4>(problem_shape, 1);
    (void)Kpad;
    (void)L;
    auto tensor_a = make_tensor_2d(args.ptr_A, M, args.K);
    auto tensor_b = make_tensor_2d(args.ptr_B, N, args.K);
    auto tensor_la = make_tensor_2d(args.ptr_LA, args.RC, args.K);
    auto tensor_lb = make_tensor_2d(args.ptr_LB, N, args.RC);
    return {
        make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, cute::Int<0>{}), TileShape{},
                             ClusterShape{}),
        make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_b, SmemLayoutB{}(_, _, cute::Int<0>{}), TileShape{},
                             ClusterShape{}),
        make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_lb, SmemLayoutB{}(_, _, cute::Int<0>{}), TileShape{},
                             ClusterShape{}),
        make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_la, SmemLayoutL{}(_, _, cute::Int<0>{}),
                             Shape<Int<BM>, Int<RCT>, Int<BK>>{}, ClusterShape{}),
        args.K, args.RC, args.slot_rank, args.scale, args.weight, args.ranks};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, Kpad, L] = append<4>(problem_shape, 1);
    (void)M;
    (void)L;
    constexpr int align = 16 / sizeof(Element);  // TMA: 16-byte aligned rows
    return args.K % align == 0 && N % align == 0 && args.RC % align == 0 && args.RC <= RCT &&
           Kpad == ((args.K + BK - 1) / BK + 1) * BK;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_b.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_lb.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_load_la.get_tma_descriptor());
  }

  // (gA_mkl, gB_nkl) as the kernel expects them (k tiles of the real K), then A's and B's tiles.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = Underscore;
    auto [M, N, Kpad, L] = problem_shape_MNKL;
    (void)Kpad;
    Tensor mA_mkl = p.tma_load_a.get_tma_tensor(make_shape(M, p.K, L));
    Tensor mB_nkl = p.tma_load_b.get_tma_tensor(make_shape(N, p.K, L));
    Tensor mLA = p.tma_load_la.get_tma_tensor(make_shape(p.RC, p.K, 1));
    Tensor mLB = p.tma_load_lb.get_tma_tensor(make_shape(N, p.RC, 1));
    Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,m,k,l)
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BN,BK,n,k,l)
    Tensor gLA = local_tile(mLA, Shape<Int<RCT>, Int<BK>>{}, make_coord(0, _, 0));            // (RCT,BK,k)
    Tensor gLB = local_tile(mLB, Shape<Int<BN>, Int<BK>>{}, make_coord(_, 0, 0));             // (BN,BK,n)
    return cute::make_tuple(gA_mkl, gB_nkl, gLA, gLB);
  }

  // Producer: Kt real stages (x, W, A slices), then one stage with B's N tile where W goes (and, to keep
  // every stage's transaction bytes equal, x's and A's first k-slices again).
  template <class TensorA, class TensorB, class TensorLA, class TensorLB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorLA, TensorLB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    (void)thread_idx;
    (void)block_rank_in_cluster;
    if (!cute::elect_one_sync()) {
      return;
    }
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sL = make_tensor(make_smem_ptr(shared_tensors.smem_L.data()), SmemLayoutL{});
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor gA = get<0>(load_inputs)(_, _, m_coord, _, l_coord);  // (BM,BK,k)
    Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BN,BK,k)
    Tensor gLA = get<2>(load_inputs);                            // (RCT,BK,k)
    Tensor gLB = get<3>(load_inputs)(_, _, n_coord);             // (BN,BK)
    auto tma_a = p.tma_load_a.get_slice(0);
    auto tma_b = p.tma_load_b.get_slice(0);
    auto tma_lb = p.tma_load_lb.get_slice(0);
    auto tma_la = p.tma_load_la.get_slice(0);
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(gB);
    Tensor tBsB = tma_b.partition_D(sB);
    Tensor tEgB = tma_lb.partition_S(gLB);
    Tensor tEsB = tma_lb.partition_D(sB);
    Tensor tLgL = tma_la.partition_S(gLA);
    Tensor tLsL = tma_la.partition_D(sL);

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* bar = pipeline.producer_get_barrier(smem_pipe_write);
      int stage = smem_pipe_write.index();
      if (k_tile_count > 1) {
        int k = *k_tile_iter;
        copy(p.tma_load_a.with(*bar), tAgA(_, _, _, k), tAsA(_, _, _, stage));
        copy(p.tma_load_b.with(*bar), tBgB(_, _, _, k), tBsB(_, _, _, stage));
        copy(p.tma_load_la.with(*bar), tLgL(_, _, _, k), tLsL(_, _, _, stage));
        ++k_tile_iter;
      } else {  // the expand stage
        copy(p.tma_load_a.with(*bar), tAgA(_, _, _, 0), tAsA(_, _, _, stage));
        copy(p.tma_load_lb.with(*bar), tEgB, tEsB(_, _, _, stage));
        copy(p.tma_load_la.with(*bar), tLgL(_, _, _, 0), tLsL(_, _, _, stage));
      }
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) {
      pipeline.producer_tail(smem_pipe_write);
    }
  }

  // Consumer: k_tile_count = Kt + 1 (the last stage is the expand).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& p) {
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sL = make_tensor(make_smem_ptr(shared_tensors.smem_L.data()), SmemLayoutL{});

    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    int wg_thread = warp_group_idx * cutlass::NumThreadsPerWarpGroup;
    TiledMma tiled_mma;
    TiledMmaH tiled_mma_h;
    TiledMmaE tiled_mma_e;
    auto thr = tiled_mma.get_slice(wg_thread);
    auto thr_h = tiled_mma_h.get_slice(wg_thread);
    auto thr_e = tiled_mma_e.get_slice(thread_idx);

    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));      // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));      // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tHrA = thr_h.make_fragment_A(thr_h.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tHrB = thr_h.make_fragment_B(thr_h.partition_B(sL));  // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tErB = thr_e.make_fragment_B(thr_e.partition_B(sB));  // (MMA,MMA_N,BK/16,PIPE): B's tile in W's place
    Tensor h = partition_fragment_C(tiled_mma_h, Shape<Int<BM>, Int<RCT>>{});     // ((2,2,RCT/8),1,1) fp32
    Tensor tErA = thr_e.partition_fragment_A(make_tensor((Element*)nullptr,       // ((2,2,2),1,RCT/16)
                                                          make_layout(Shape<Int<BM>, Int<RCT>>{})));
    static_assert(size(decltype(h){}) == size(decltype(tErA){}), "h accumulator and the A fragment hold the same values");

    // This thread's columns of h: 8c + 2(lane % 4) + a (the wgmma accumulator layout); their weights.
    float w[RCT / 4];
    {
      int lane4 = (thread_idx % 32) % 4;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < RCT / 8; ++c) {
        CUTLASS_PRAGMA_UNROLL
        for (int a = 0; a < 2; ++a) {
          int j = 8 * c + 2 * lane4 + a;
          float v = 0.f;
          if (j < p.RC) {
            int s = j / p.slot_rank;
            if (j - s * p.slot_rank < __ldg(p.ranks + s)) {
              v = __ldg(p.scale + s) * __ldg(p.weight + s);
            }
          }
          w[2 * c + a] = v;
        }
      }
    }

    PipelineState smem_pipe_release = smem_pipe_read;
    assert(k_tile_count >= 2);
    if constexpr (!SHRINK) {
      clear(h);
    }
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(h);
    {  // prologue: the first k-tile, accumulators start from zero
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int stage = smem_pipe_read.index();
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      tiled_mma_h.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        if constexpr (SHRINK) {
          cute::gemm(tiled_mma_h, tHrA(_, _, kb, stage), tHrB(_, _, kb, stage), h);
        }
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        tiled_mma_h.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(h);
    k_tile_count -= 1;

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 1; --k_tile_count) {  // the remaining real k-tiles
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      warpgroup_fence_operand(h);
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), accum);
      if constexpr (SHRINK) {
        cute::gemm(tiled_mma_h, tHrA(_, _, _, stage), tHrB(_, _, _, stage), h);
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      warpgroup_fence_operand(h);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }

    {  // the expand stage: acc += bf16(h * w) B^T
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int stage = smem_pipe_read.index();
      warpgroup_wait<0>();
      warpgroup_fence_operand(h);
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < RCT / 16; ++kb) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          CUTLASS_PRAGMA_UNROLL
          for (int b = 0; b < 2; ++b) {
            CUTLASS_PRAGMA_UNROLL
            for (int a = 0; a < 2; ++a) {
              int cc = 2 * kb + c;  // the accumulator's n8 block
              tErA(make_coord(make_coord(a, b, c), 0, kb)) =
                  Element(h(make_coord(make_coord(a, b, cc), 0, 0)) * w[2 * cc + a]);
            }
          }
        }
      }
      warpgroup_fence_operand(tErA);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      tiled_mma_e.accumulate_ = GMMA::ScaleOut::One;
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < RCT / 16; ++kb) {
        cute::gemm(tiled_mma_e, tErA(_, _, kb), tErB(_, _, kb, stage), accum);
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }
    warpgroup_fence_operand(accum);
  }

  // As the stock main loop: wait for the last batch, release the last stage.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release, int k_tile_count) {
    smem_pipe_release.advance(k_tile_count - 1);
    warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

}  // namespace fdlora
