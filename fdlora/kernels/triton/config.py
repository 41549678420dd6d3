"""Launch settings shared by the Triton kernels: interpreter mode, autotune configs, block checks.

Configs are bounded sets, tuned per (bucketed M, K, N, rank tile). The CPU interpreter cannot
autotune (it has no driver to time on), so it gets one small config; it also mis-computes bf16
`tl.dot`, so kernels upcast dot operands to fp32 there (`UPCAST`).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
from torch._library.triton import is_wrap_triton_enabled, wrap_triton
from torch.library import triton_op

from ... import env
from ...errors import FdLoraError

INTERPRET = env.triton_interpret()
MIN_BLOCK = 16  # tl.dot needs >= 16 on the GPU; the interpreter accepts less, so we check here
MAX_RANK_TILE = 64  # packed rank columns kept on chip per pass (h is [BM, RC] fp32 in registers)
MAX_SLOTS = 64  # slots a kernel packs per row block (S is a tl.arange extent)
MAX_RANK = 256  # bank rank capacity R the kernels accept (more works, in more passes; kept bounded)


def cfg(warps: int, stages: int, **blocks: int) -> triton.Config:
    return triton.Config(blocks, num_warps=warps, num_stages=stages)


FEW_ROWS = 64  # M at or below which the few-rows config sets apply

# Row-block kernels (fused delta, per-row delta, expand-add): BM rows x BN columns of y, BK of K.
# NSPLIT caps how many programs share one row block's N sweep (see n_split); it only shapes the grid.
# Many rows: each program owns a row block, streams x once (K loop) and y once (N sweep).
# Few rows (decode): one row tile; programs spread over N tiles (and slots, per-row mode).
DELTA = {
    "many": [
        cfg(4, 2, BM=16, BN=64, BK=64, PREFETCH=False, NSPLIT=64),
        cfg(4, 2, BM=16, BN=64, BK=64, PREFETCH=True, NSPLIT=64),
        cfg(4, 3, BM=16, BN=64, BK=128, PREFETCH=True, NSPLIT=64),
        cfg(4, 3, BM=16, BN=128, BK=128, PREFETCH=True, NSPLIT=64),
        cfg(4, 3, BM=32, BN=64, BK=128, PREFETCH=True, NSPLIT=64),
        cfg(4, 3, BM=32, BN=128, BK=64, PREFETCH=True, NSPLIT=64),
        cfg(4, 3, BM=32, BN=128, BK=64, PREFETCH=False, NSPLIT=64),
        cfg(4, 3, BM=64, BN=128, BK=64, PREFETCH=True, NSPLIT=64),
        cfg(8, 3, BM=64, BN=256, BK=64, PREFETCH=True, NSPLIT=64),
        # from benchmarks/probes/sweep_delta.py on an H100: 2 warps on 640-1280-wide SDXL rows,
        # a longer K step on 5120-deep ones, 64 rows x 256 columns unsplit for rank 64 on Flux
        cfg(2, 3, BM=16, BN=128, BK=128, PREFETCH=True, NSPLIT=64),
        cfg(2, 5, BM=16, BN=128, BK=128, PREFETCH=True, NSPLIT=64),  # SDXL 5120->1280 (H100)
        cfg(4, 4, BM=32, BN=128, BK=256, PREFETCH=True, NSPLIT=64),
        cfg(8, 3, BM=64, BN=256, BK=128, PREFETCH=True, NSPLIT=1),
        cfg(8, 3, BM=64, BN=128, BK=128, PREFETCH=True, NSPLIT=1),  # Flux 3072^2 4xr16 blend: 63 us (H100)
    ],
    "few": [
        cfg(4, 3, BM=16, BN=128, BK=128, PREFETCH=False, NSPLIT=32),
        cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=False, NSPLIT=16),  # 4 stages: decode, 8 adapters by row
        # the same with the first y / B tiles loaded before the shrink and the N split's programs walking K from
        # different starts: decode, 8 adapters by row, +9.2 us on the base GEMM (H100, sweep_delta.py)
        cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=2, NSPLIT=16, WRAP=True),
        cfg(4, 4, BM=16, BN=256, BK=256, PREFETCH=False, NSPLIT=8),
        cfg(4, 3, BM=16, BN=256, BK=256, PREFETCH=False, NSPLIT=4),
        cfg(4, 2, BM=16, BN=128, BK=512, PREFETCH=False, NSPLIT=8),
        cfg(8, 3, BM=16, BN=256, BK=512, PREFETCH=False, NSPLIT=4),
    ],
    "interpret": [cfg(4, 1, BM=16, BN=32, BK=32, PREFETCH=True, NSPLIT=2)],
}
for _config in (c for table in DELTA.values() for c in table):
    # every kernel of this table declares WRAP; a config names it even where it is the default, because Inductor
    # launches a kernel it compiled with exactly the constexprs the config holds
    _config.kwargs.setdefault("WRAP", False)
# Shrink alone (h = x A^T): BM rows x one rank chunk, K split across programs when rows are few.
SHRINK = {
    "many": [cfg(4, 3, BM=64, BK=64), cfg(4, 3, BM=128, BK=64), cfg(8, 3, BM=128, BK=128)],
    "few": [cfg(4, 3, BM=16, BK=128), cfg(4, 3, BM=16, BK=256), cfg(8, 3, BM=16, BK=512)],
    "interpret": [cfg(4, 1, BM=16, BK=32)],
}


AUTOTUNE = not INTERPRET  # tests turn it off (one config each: fewer compiles); the interpreter cannot tune
# Integer arguments that only bound loops or mask rows: not specialized, so new M or S never recompile.
# K, N and strides stay specialized (divisibility by 16 lets loads along them vectorize).
NO_SPECIALIZE = ["M", "S", "R", "P", "rows_per_group", "M_BUCKET"]


def configs(table: dict[str, list[triton.Config]], few: bool) -> list[triton.Config]:
    return table["interpret"] if INTERPRET else table["few" if few else "many"]


def tune_bench(fn, quantiles=None, reps: int = 10):
    """Autotune timing on GPU time alone: `fn` captured once in a CUDA graph, replayed `reps` times with L2 flushed
    before each (fdlora.testing.graph_ms). Triton's default times eager launches, and an eager launch of a kernel with
    this many arguments costs more host time than a few-row kernel runs, so the choice among configs would be noise
    (Llama-3-8B q/k/v at 32 rows on one H100: two processes chose differently for 4 of 6 keys, and the same grouped
    delta took 23.4 and 21.8 us). Graph repeats without the flush (triton.testing's do_bench_cudagraph)
    time a 2048-row x on a warm L2 and chose configs 10-30% slower when x comes from memory."""
    from ...testing import graph_ms

    ms = torch.tensor(graph_ms(fn, reps))
    if quantiles is None:
        return float(ms.median())
    return [float(q) for q in torch.quantile(ms, torch.tensor(quantiles))]


def kernels(fn, table: dict[str, list[triton.Config]], key: list[str], **autotune_args) -> dict:
    """Autotuned wrappers of one jit function: (few rows?, tuned?) -> kernel (untuned: first config), timed by
    `tune_bench` unless autotune_args say otherwise."""
    jitted = triton.jit(fn, do_not_specialize=[a for a in NO_SPECIALIZE if a in fn.__code__.co_varnames])
    autotune_args.setdefault("do_bench", tune_bench)
    return {
        (few, tune): triton.autotune(configs(table, few)[: None if tune else 1], key=key, **autotune_args)(jitted)
        for few in (True, False)
        for tune in (True, False)
    }


def pick(table: dict, M: int):
    return table[(M <= FEW_ROWS, AUTOTUNE)]


_CHOSEN: dict[tuple, triton.Config] = {}  # (autotuner, tuning key) -> the config it chose
_COMPILED: dict[tuple, tuple] = {}  # (autotuner, tuning key) -> (specialization, compiled kernel) of the last launch
_I32 = (-(2 ** 31), 2 ** 31)
_current_device = getattr(torch._C, "_cuda_getDevice", lambda: -1)  # (torch.cuda.current_device minus its checks)


def launch(table: dict, M: int, grid, key: tuple, *args, keep: tuple[int, ...] | None = None,
           config: triton.Config | None = None, **kwargs) -> Prepared | None:
    """Launch the autotuned kernel of `table` for M rows; with `keep` (argument positions of tensors that change
    per call), also return the launch kept ready (`Prepared`) when it went to a compiled kernel, else None.

    Traced calls (wrap_triton enabled: torch.compile, the torch.ops path) go through wrap_triton. Plain eager
    launches go through the autotuner once per `key` (the tuning key: M bucket, K, N, tiles, dtypes), then
    through the jitted kernel with the config it chose, which compiles (or finds) the kernel for the
    arguments' specialization; while later calls have that same specialization (`_specialization`, at least
    as fine as Triton's own) the compiled kernel is launched directly. Both shortcuts skip per-call work
    (the autotuner's key building, the binder, the cache lookup) that costs more host time than a
    decode-sized kernel runs (benchmarks/probes/profile_layer.py). A kept launch skips the rest: its caller replays
    it instead of calling here (fdlora.layers.fastpath.decode). An explicit `config` runs that config, untuned (sweeps).
    """
    tuner = pick(table, M)
    if config is not None:
        check_blocks([config])
        run = wrap_triton(tuner.fn) if is_wrap_triton_enabled() else tuner.fn
        run[grid](*args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        return None
    if is_wrap_triton_enabled():
        wrap_triton(tuner)[grid](*args, **kwargs)
        return None
    chosen = _CHOSEN.get((tuner, key))
    if chosen is None and len(tuner.configs) > 1 and memory_short(args):  # no autotuning allocations under pressure
        chosen = _CHOSEN[(tuner, key)] = tuner.configs[0]
    if chosen is None:
        tuner[grid](*args, **kwargs)
        _CHOSEN[(tuner, key)] = tuner.best_config
        return None
    jitted = tuner.fn
    merged = {**kwargs, **chosen.all_kwargs()}
    spec = full = None
    bound = None if INTERPRET else _bound(jitted, args, merged)
    if bound is not None:
        full, options = bound
        args_spec = _specialization(jitted, full)
        spec = None if args_spec is None else (args_spec, options)
    got = _COMPILED.get((tuner, key))
    if spec is not None and got is not None and got[0] == spec:
        run = got[1][_grid3(grid, jitted, full)]
        run(*full)
    else:
        kernel = jitted[grid](*args, **merged)
        if spec is None or not (hasattr(kernel, "__getitem__") and hasattr(kernel, "packed_metadata")):
            return None
        _COMPILED[(tuner, key)] = (spec, kernel)
        if keep is None:
            return None
        run = kernel[_grid3(grid, jitted, full)]
    return None if keep is None else Prepared(run, full, keep)


AUTOTUNE_MIN_FREE = 1 << 30  # bytes a first launch needs free to autotune (Triton's do_bench flushes 256 MiB of L2)
_warned_short: set[int] = set()


def memory_short(args: tuple) -> bool:
    """True when the device of the first CUDA tensor in `args` has less than AUTOTUNE_MIN_FREE bytes to give (the
    driver's free memory plus what torch's allocator holds unused): the first launch of a shape then runs the first
    config instead of autotuning, whose timing buffers would raise out-of-memory inside a step that fits (the rule: a
    step that diffusers+PEFT runs must run). Warns once per device."""
    t = next((a for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if t is None:
        return False
    free, _ = torch.cuda.mem_get_info(t.device)
    free += torch.cuda.memory_reserved(t.device) - torch.cuda.memory_allocated(t.device)
    if free >= AUTOTUNE_MIN_FREE:
        return False
    if t.device.index not in _warned_short:
        _warned_short.add(t.device.index)
        import warnings

        warnings.warn(f"fd-lora: {free / 2**20:.0f} MiB free on {t.device}: new kernel shapes run their default Triton "
                      "config instead of autotuning (which allocates timing buffers); free memory and restart the "
                      "process for tuned kernels.", ResourceWarning, stacklevel=3)
    return True


def kept(jitted, grid, *args, **kwargs) -> Prepared | None:
    """Launch `jitted` once (eager, plain tensors) and return that launch kept ready with every argument fixed (a
    Prepared replayed with no tensors), or None where none can be kept (the interpreter)."""
    kernel = jitted[grid](*args, **kwargs)
    bound = None if INTERPRET else _bound(jitted, args, kwargs)
    if bound is None or not (hasattr(kernel, "__getitem__") and hasattr(kernel, "packed_metadata")):
        return None
    full = bound[0]
    return Prepared(kernel[_grid3(grid, jitted, full)], full, ())


def _grid3(grid, jitted, full: list) -> tuple[int, int, int]:
    """The launch grid as three extents, from the bound arguments when `grid` is a function of them."""
    g = grid(dict(zip(jitted.arg_names, full))) if callable(grid) else grid
    return g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1


class Prepared:
    """One launch kept ready for repeats (`launch(..., keep=...)`): the compiled kernel bound to its grid, and
    every argument, of which the tensors at positions `keep` are replaced per call. Valid while those
    tensors keep the shape, strides and dtype they had when it was made (the caller keys on them);
    a call whose tensors changed 16-byte alignment returns False and launches nothing."""

    __slots__ = ("run", "full", "swap", "aligned")

    def __init__(self, run, full: list, swap: tuple[int, ...]) -> None:
        self.aligned = tuple(full[i].data_ptr() % 16 == 0 for i in swap)
        self.run, self.swap = run, swap
        self.full = [None if i in swap else v for i, v in enumerate(full)]  # keeps no per-call tensor alive

    def __call__(self, *tensors: torch.Tensor) -> bool:
        full = self.full.copy()
        for i, t, aligned in zip(self.swap, tensors, self.aligned):
            if (t.data_ptr() % 16 == 0) is not aligned:
                return False
            full[i] = t
        self.run(*full)
        return True


def _bound(jitted, args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
    """(every parameter's value in order, as Triton's binder passes them on; the compile options among
    `kwargs`, e.g. num_warps), or None if a parameter has no value."""
    names = jitted.arg_names
    params = jitted.signature.parameters
    full = list(args)
    for name in names[len(args):]:
        if name in kwargs:
            full.append(kwargs[name])
        elif params[name].default is not params[name].empty:
            full.append(params[name].default)
        else:
            return None
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return full, options


def _specialization(jitted, full: list) -> tuple | None:
    """What Triton specializes a launch on, or finer: the current device; constexpr values; tensor dtypes,
    devices and 16-byte alignment; for integers their width class and, unless `do_not_specialize`, == 1 and
    divisibility by 16; bool values; None. Anything else: None (no direct launch)."""
    flags = jitted.__dict__.get("_fdlora_flags")
    if flags is None:
        flags = jitted.__dict__["_fdlora_flags"] = [(p.is_constexpr, p.do_not_specialize) for p in jitted.params]
    out = [_current_device()]
    add = out.append
    tensor = torch.Tensor
    for (const, nospec), v in zip(flags, full):
        t = type(v)
        if const or v is None or t is bool:
            add(v)
        elif t is int:
            small = _I32[0] <= v < _I32[1]
            add(small if nospec else (small, v == 1, v % 16 == 0, v >= 0))
        elif isinstance(v, tensor):
            add((v.dtype, v.device, v.data_ptr() % 16 == 0))
        elif t is float:
            add(float)
        else:
            return None
    return tuple(out)


def check_blocks(configs: list[triton.Config], **extra: int) -> None:
    """Every tl.dot extent must be >= 16 (the GPU compiler rejects less; the interpreter does not)."""
    for c in configs:
        for name in ("BM", "BN", "BK"):
            if c.kwargs.get(name, MIN_BLOCK) < MIN_BLOCK:
                raise FdLoraError(f"Triton config {c} has {name}={c.kwargs[name]} < {MIN_BLOCK}: tl.dot needs >= 16.")
    for name, v in extra.items():
        if v < MIN_BLOCK or v & (v - 1):
            raise FdLoraError(f"Triton block {name}={v} must be a power of two >= {MIN_BLOCK}.")


for _table in (DELTA, SHRINK):
    for _set in _table.values():
        check_blocks(_set)


def dims(t: torch.Tensor) -> tuple[int, ...]:
    """Shape as plain ints (specializes symbolic sizes: launch math and kernel choice stay static)."""
    return tuple(int(v) for v in t.shape)


def strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in t.stride())


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a ConstexprFunction: slow to call from Python per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side triton.next_power_of_2 for n >= 1 (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def bucket(M: int) -> int:
    """Autotune key for M: powers of two up to 16384, so a new sequence length rarely re-tunes."""
    return min(next_pow2(max(M, 1)), 16384)


def rank_tile(width: int) -> int:
    """Packed rank columns per pass for a rank axis of `width` columns (16..MAX_RANK_TILE)."""
    return min(MAX_RANK_TILE, max(MIN_BLOCK, next_pow2(width)))


def n_split(meta: dict, M: int, N: int, sms: int, per_block: int = 1) -> int:
    """Programs sharing one row block's N sweep (each recomputes its h): enough programs for about
    64 rows per SM overall (small BM runs several programs per SM), at most NSPLIT, at most the
    N tiles. per_block: programs a row block already has on another grid axis (per-row slots)."""
    m_blocks = cdiv(M, meta["BM"])
    want = round(sms * 64 / meta["BM"] / (m_blocks * per_block))
    return max(1, min(want, meta["NSPLIT"], cdiv(N, meta["BN"])))


def slot_pad(S: int) -> int:
    return max(2, next_pow2(S))


@functools.cache
def sm_count(device_index: int) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return sm_count(t.device.index or 0) if t.device.type == "cuda" else sm_count(-1)


def dot_flags(dtype: torch.dtype) -> dict[str, bool]:
    """UPCAST under the interpreter; IEEE for fp32 operands (match eager fp32, no tf32)."""
    return {"UPCAST": INTERPRET, "IEEE": dtype == torch.float32}


def check_operands(op: str, y: torch.Tensor | None, x: torch.Tensor | None, A: torch.Tensor | None,
                   B: torch.Tensor | None, **small: torch.Tensor) -> None:
    """Shapes and dtypes the kernels rely on; the message says what to pass instead."""
    def fail(why: str) -> None:
        raise FdLoraError(f"fdlora triton {op}: {why}")

    mats = {k: t for k, t in (("y", y), ("x", x), ("A", A), ("B", B)) if t is not None}
    for k, t in mats.items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            fail(f"{k} is {t.dtype}; use float16, bfloat16 or float32.")
    ops = [t for k, t in mats.items() if k in ("x", "A", "B")]
    if len({t.dtype for t in ops}) > 1:
        fail("x, A and B must share one dtype (got " + ", ".join(f"{t.dtype}" for t in ops) + "); cast x to A's dtype.")
    if A is not None and A.dim() != 3:
        fail(f"A must be [S, R, K], got {tuple(A.shape)}.")
    if B is not None and B.dim() != 3:
        fail(f"B must be [N, S, R], got {tuple(B.shape)}.")
    if A is not None and B is not None and tuple(B.shape[1:]) != tuple(A.shape[:2]):
        fail(f"A {tuple(A.shape)} and B {tuple(B.shape)} disagree on [S, R].")
    R = A.shape[1] if A is not None else (B.shape[2] if B is not None else 16)
    if R % 16:
        fail(f"rank capacity R={R} must be a multiple of 16 (AdapterBank pads it); pad A and B with zeros.")
    if A is not None and A.shape[0] > MAX_SLOTS:
        fail(f"{A.shape[0]} slots > {MAX_SLOTS}; use the torch backend or fewer slots.")
    if A is not None and A.shape[1] > MAX_RANK:
        fail(f"rank capacity {A.shape[1]} > {MAX_RANK}; use the torch backend.")
    if x is not None and A is not None and x.shape[-1] != A.shape[2]:
        fail(f"x has K={x.shape[-1]} but A has K={A.shape[2]}.")
    if y is not None and x is not None and y.shape[0] != x.shape[0]:
        fail(f"y has {y.shape[0]} rows but x has {x.shape[0]}.")
    if y is not None and B is not None and y.shape[1] != B.shape[0]:
        fail(f"y has N={y.shape[1]} but B has N={B.shape[0]}.")
    for k, t in small.items():
        want = torch.int32 if k in ("ranks", "row_slot") else torch.float32
        if t.dtype != want:
            fail(f"{k} is {t.dtype}; it must be {want}.")
    devices = {t.device for t in (*mats.values(), *small.values())}
    if len(devices) > 1:
        fail(f"tensors on several devices {sorted(map(str, devices))}; move them to one.")


def register(spec, fn):
    """`fn` registered as the op `spec` names (torch.library triton_op: torch.compile traces into its kernels), with
    the contract's signature and schema (fdlora.kernels.ops): `fn` takes the same parameters, unannotated."""
    params = tuple(inspect.signature(fn).parameters)
    if params != spec.params:
        raise TypeError(f"Triton {spec.name}{params} does not take the contract's parameters {spec.params}")
    fn.__signature__ = inspect.signature(spec.reference, eval_str=True)
    return triton_op(spec.qualname, fn, mutates_args=set(spec.mutates))
