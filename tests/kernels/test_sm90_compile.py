"""Every Triton kernel compiles for an H100 (sm_90) on a machine without a GPU.

The CPU interpreter runs the kernels' Python, so it misses what only the compiler checks: a loop
or branch that changes a variable's type, a tl.dot of the wrong shape, a constexpr that is not
one. Here each kernel goes through triton.compile to PTX and cubin for sm_90 (Triton ships ptxas),
with the constexpr sets it launches with: the first config of each table, bf16 and fp32 operands,
and each mode flag. This catches those errors in CI instead of on the GPU.
"""

from __future__ import annotations

import importlib.util

import pytest

from fdlora import env

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(env.triton_interpret(), reason="the interpreter process compiles nothing"),
]

FP32 = {"scale_ptr", "gw_ptr", "h_ptr"}
INT32 = {"ranks_ptr", "slot_ptr"}


def compile_sm90(jitted, flags: dict, dtype: str = "bf16", pointers: dict[str, str] | None = None, arch: int = 90):
    """triton.compile the jit function for sm_90 with these constexpr values (and num_warps / num_stages
    among them, as compile options); its metadata."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {k: flags[k] for k in ("num_warps", "num_stages") if k in flags}
    flags = {k: v for k, v in flags.items() if k not in options}
    names = jitted.arg_names
    missing = [p.name for p in jitted.params if p.is_constexpr and p.name not in flags]
    assert not missing, f"no value for constexpr {missing}"

    def kind(name: str) -> str:
        if pointers and name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*fp32" if name in FP32 else "*i32" if name in INT32 else f"*{dtype}"
        return "i32"

    sig = {n: "constexpr" if n in flags else kind(n) for n in names}
    constexprs = {(names.index(k),): v for k, v in flags.items()}
    src = triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).metadata


def first(table: dict, few: bool) -> dict:
    """The first config of a table (the one tests launch with), with its num_warps / num_stages."""
    c = table["few" if few else "many"][0]
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


@pytest.mark.parametrize("few,dtype,rmax,prefetch", [
    (False, "bf16", 64, None), (True, "bf16", 16, None), (True, "fp32", 64, None), (True, "bf16", 16, 2)])
def test_delta_kernels_compile(few: bool, dtype: str, rmax: int, prefetch) -> None:
    from fdlora.kernels.triton import config as C
    from fdlora.kernels.triton.forward import lora_delta, lora_delta_rows, lora_expand_add

    blocks = first(C.DELTA, few)
    if prefetch is not None:  # 2: first tiles loaded before the shrink (tiles.first_tiles)
        blocks["PREFETCH"] = prefetch
    blocks["WRAP"] = prefetch is not None  # the N split's K walk from per-program starts (tiles.shrink_tile)
    dots = {"UPCAST": False, "IEEE": dtype == "fp32"}
    for module, extra in ((lora_delta, {"S_PAD": 4}), (lora_delta_rows, {}),
                          (lora_expand_add, {"S_PAD": 4, "HAS_RANKS": True, "ROW_W": False}),
                          (lora_expand_add, {"S_PAD": 4, "HAS_RANKS": True, "ROW_W": True})):
        meta = compile_sm90(module._KERNELS[(few, False)].fn, {**blocks, **dots, "RMAX": rmax, **extra}, dtype)
        assert meta.name.startswith(module.__name__.rsplit(".", 1)[1])


@pytest.mark.parametrize("few", [False, True], ids=["many", "few"])
def test_shrink_compiles(few: bool) -> None:
    from fdlora.kernels.triton import config as C
    from fdlora.kernels.triton.forward import lora_shrink

    blocks = first(C.SHRINK, few)
    for skip, by_row in ((False, False), (True, False), (False, True)):
        compile_sm90(lora_shrink._KERNELS[(few, False)].fn,
                     {**blocks, "RC": 64, "HAS_SKIP": skip, "HAS_ROWS": by_row, "UPCAST": False, "IEEE": False})


@pytest.mark.parametrize("pre,persistent", [(False, 0), (True, 0), (False, 1)])
def test_lora_linear_compiles(pre: bool, persistent: int) -> None:
    from fdlora.kernels.triton.forward import lora_linear

    c = lora_linear.CONFIGS["many"][0]
    flags = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages, "PERSISTENT": persistent,
             "S_PAD": 4, "RMAX": 32, "MORE": not pre, "PRE": pre,
             "HAS_BIAS": True, "EVEN_K": False, "UPCAST": False, "IEEE": False}
    compile_sm90(lora_linear._JIT, flags, pointers={"bias_ptr": "*bf16"})


def test_merge_and_scatter_compile() -> None:
    from fdlora.kernels.triton.merge import bank_scatter, lora_merge

    blocks = lora_merge.BLOCKS["gpu"]
    for stamped in (False, True):
        compile_sm90(lora_merge.lora_merge_kernel, {**blocks, "S_PAD": 4, "RC": 16, "UPCAST": False, "IEEE": False,
                                                    "STAMPED": stamped},
                     pointers={"out_ptr": "*bf16", "w_ptr": "*bf16", "stamp_ptr": "*i32", "version_ptr": "*i32"})
    compile_sm90(bank_scatter.bank_scatter_kernel, {"FIELDS": bank_scatter.FIELDS, "BLOCK": bank_scatter.BLOCK},
                 pointers={"table_ptr": "*i64", "src_like": "*fp32", "dst_like": "*bf16", "rank_like": "*i32"})


def test_a_type_change_is_caught() -> None:
    """The check has teeth: a kernel whose branch turns an fp32 tile into bf16 fails to compile."""
    import triton
    import triton.language as tl

    @triton.jit
    def bad(x_ptr, FLAG: tl.constexpr):
        h = tl.zeros((16, 16), dtype=tl.float32)
        if tl.load(x_ptr) > 0:
            h = h.to(tl.bfloat16)
        tl.store(x_ptr + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :], h)

    with pytest.raises(Exception, match="h"):
        compile_sm90(bad, {"FLAG": True}, pointers={"x_ptr": "*fp32"})


@pytest.mark.parametrize("aligned", [False, True])
def test_merge_many_compiles_and_vectorizes_when_aligned(aligned: bool) -> None:
    """lora_merge_many reads its addresses from a table, which carry no alignment facts: without the ALIGNED hints
    every element moved alone (39 ms for an SDXL re-merge on an H100 instead of a few), so check the PTX."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from fdlora.kernels.triton.merge import lora_merge_many as M

    jit = M.lora_merge_many_kernel
    flags = dict(S=4, R=16, LOG_L=10, DTYPE=tl.bfloat16, UPCAST=False, IEEE=False, BN=64, BK=128, ALIGNED=aligned)
    sig = {n: "constexpr" if n in flags else {"addr_ptr": "*i64", "dims_ptr": "*i64", "first_ptr": "*i32"}.get(n, "i32")
           for n in jit.arg_names}
    src = triton.compiler.ASTSource(fn=jit, signature=sig,
                                    constexprs={(jit.arg_names.index(k),): v for k, v in flags.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    vector = len(re.findall(r"ld\.global\.v4\.b32", ptx))
    assert (vector > 0) == aligned and (len(re.findall(r"ld\.global\.b16", ptx)) == 0) == aligned


@pytest.mark.parametrize("arch", [80, 89, 100, 120], ids=lambda a: f"sm_{a}")
def test_every_kernel_compiles_for_each_gpu_generation(arch: int) -> None:
    """A100 (sm_80), L40/4090 (sm_89), B200 (sm_100), RTX 50xx (sm_120): each kernel's first config, bf16, through
    Triton's own ptxas (sm_90 has the full flag matrix above)."""
    from fdlora.kernels.triton import config as C
    from fdlora.kernels.triton.forward import lora_delta, lora_delta_rows, lora_expand_add, lora_linear, lora_shrink
    from fdlora.kernels.triton.merge import lora_merge

    dots = {"UPCAST": False, "IEEE": False}
    blocks = {**first(C.DELTA, False), "WRAP": False}
    for module, extra in ((lora_delta, {"S_PAD": 4}), (lora_delta_rows, {}),
                          (lora_expand_add, {"S_PAD": 4, "HAS_RANKS": True, "ROW_W": True})):
        compile_sm90(module._KERNELS[(False, False)].fn, {**blocks, **dots, "RMAX": 64, **extra}, arch=arch)
    compile_sm90(lora_shrink._KERNELS[(False, False)].fn,
                 {**first(C.SHRINK, False), "RC": 64, "HAS_SKIP": True, "HAS_ROWS": True, **dots}, arch=arch)
    c = lora_linear.CONFIGS["many"][0]
    compile_sm90(lora_linear._JIT, {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages,
                                    "PERSISTENT": 0, "S_PAD": 4, "RMAX": 32, "MORE": True, "PRE": False,
                                    "HAS_BIAS": True, "EVEN_K": False, **dots},
                 pointers={"bias_ptr": "*bf16"}, arch=arch)
    compile_sm90(lora_merge.lora_merge_kernel, {**lora_merge.BLOCKS["gpu"], "S_PAD": 4, "RC": 16, **dots,
                                                "STAMPED": True},
                 pointers={"out_ptr": "*bf16", "w_ptr": "*bf16", "stamp_ptr": "*i32", "version_ptr": "*i32"},
                 arch=arch)


@pytest.mark.parametrize("ieee", [False, True], ids=["bf16", "fp32"])
def test_backward_parts_compile(ieee: bool) -> None:
    """The LoRA backward's piece kernels (fdlora.kernels.triton.train.lora_backward_parts), both dot orientations, g plain
    and as fp32 partials."""
    from fdlora.kernels.triton.train import lora_backward_parts as parts

    dtype = "fp32" if ieee else "bf16"
    shape = {"RP": 16, "BM": 64, "IEEE": ieee, "num_warps": 4, "num_stages": 3}
    for round_g in (False, True):
        g = {"g_ptr": "*fp32" if round_g or ieee else f"*{dtype}"}
        compile_sm90(parts._grad_u_kernel, {**shape, "BK": 128, "ADD": True, "ROUND": round_g}, dtype, g)
        for trans in (False, True):
            compile_sm90(parts._grad_a_kernel, {**shape, "BK": 128, "TRANS": trans, "ROUND": round_g}, dtype,
                         {**g, "out_ptr": "*fp32"})
    for trans in (False, True):
        compile_sm90(parts._gy_kernel, {**shape, "BN": 128, "TRANS": trans}, dtype,
                     {"gp_ptr": "*fp32", "gbp_ptr": "*fp32"})
