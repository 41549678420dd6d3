"""LyCORIS LoHa, LoKr, LoCon-Tucker and full ``diff`` modules, and DoRA magnitudes, as exact LoRA factors.

Every module becomes A [R, K] / B [N, R] with ``B A * scale == ΔW`` exactly (factors built in float64,
nothing truncated), so every fd-lora path — the fused per-call kernels, blends, per-sample and per-row
batches, the merged-weight cache, fuse / unfuse — serves it unchanged:

    LoHa   ΔW = (w1a w1b) ⊙ (w2a w2b) · alpha/r        Khatri-Rao: B = B1 ∗ B2 (columnwise), A = A1 ∗ A2 (rowwise),
                                                        rank r1·r2; Tucker halves (hada_t1/t2) rebuild as
                                                        B = w1aᵀ, A = t1 ×₂ w1b (rank r each)
    LoKr   ΔW = kron(w1, w2) · scale                   kron(B1 A1, B2 A2) = kron(B1, B2) kron(A1, A2); a full half
                                                        is factored through an identity on its shorter side
    LoCon  lora_down / lora_mid / lora_up (Tucker)      B = up, A = mid ×₂ down (rank r)
    full   ΔW = diff, bias delta = diff_b              (scale 1)

Where the factor rank would reach min(N, K) the module is stored as its dense ΔW instead (an identity factor
on the shorter side, rank min(N, K)): the exact product where it is cheap, otherwise the merged delta.
Banks grow to the largest rank loaded, so a full-rank module costs memory (FDLORA_MAX_RANK bounds it);
``lora_conversion="svd:RANK"`` (`convert_svd`) trades exactness for size and reports the error.

Scales are the format's own: LyCORIS alpha / lora_dim (alpha missing or 0: 1; a LoKr with both halves full:
1 whatever alpha says), PEFT's alpha / r from its config. A non-Tucker conv module stores A flat
[R, C·kh·kw]; `fit_to` gives it the kernel shape of the layer it lands on.

DoRA: ``dora_scale`` (LyCORIS / kohya, per output channel; the per-input-channel layout of old LyCORIS
versions is refused) and PEFT ``lora_magnitude_vector`` become `ModuleLora.magnitude`.
"""

from __future__ import annotations

import math
import re

import torch

from ...errors import AdapterShapeError, FormatError, UnsupportedFeatureError
from ..adapter import LoraAdapter, ModuleLora
from .base import MODEL, Converted, Options, Raw

PARTS = {  # key suffix -> algorithm (None: any)
    "hada_w1_a": "loha", "hada_w1_b": "loha", "hada_w2_a": "loha", "hada_w2_b": "loha", "hada_t1": "loha",
    "hada_t2": "loha",
    "lokr_w1": "lokr", "lokr_w1_a": "lokr", "lokr_w1_b": "lokr", "lokr_w2": "lokr", "lokr_w2_a": "lokr",
    "lokr_w2_b": "lokr", "lokr_t2": "lokr",
    "diff": "full", "diff_b": "full",
    "lora_down.weight": "lora", "lora_up.weight": "lora", "lora_mid.weight": "lora",
    "alpha": None, "dora_scale": None,
}
_SUFFIXES = sorted(PARTS, key=len, reverse=True)
OTHER_ALGOS = re.compile(r"\.(oft_\w+|oft_blocks|oft_diag|rescale|b1\.weight|b2\.weight|a1\.weight|a2\.weight|"
                         r"on_input|w_norm|b_norm|weight_norm|glora_\w+)$")
DENSE_SHARE = 1.0  # a factor rank >= DENSE_SHARE * min(N, K) is stored as the dense ΔW
PREFIX = "lycoris_"


def split(key: str) -> tuple[str, str] | None:
    """(module name, part) of a LyCORIS-style key ``<name>.<part>``, or None."""
    for suffix in _SUFFIXES:
        if key.endswith("." + suffix) and len(key) > len(suffix) + 1:
            return key[: -len(suffix) - 1], suffix
    return None


def is_lycoris(parts: dict[str, torch.Tensor]) -> bool:
    """Whether a module's parts need this converter (anything but a plain lora_down/lora_up/alpha)."""
    return any(PARTS[p] in ("loha", "lokr", "full") or p in ("lora_mid.weight", "dora_scale") for p in parts)


# --- ΔW as exact factors ------------------------------------------------------------------------------
def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def _tucker(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LyCORIS/PEFT rebuild_tucker(t, wa, wb) = einsum('ijhw,ip,jr->prhw') as (B [out, r], A [r, in, kh, kw])."""
    return _d(wa).t(), torch.einsum("ijhw,jc->ichw", _d(t), _d(wb))


def _full(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full matrix [n, k] as (B, A) through an identity on its shorter side (exact)."""
    w = _d(w).reshape(w.shape[0], -1)
    n, k = w.shape
    eye = torch.eye(min(n, k), dtype=torch.float64)
    return (eye, w) if n <= k else (w, eye)


def _kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.kron of two matrices (written out: torch.kron trips over the strides of a transposed [n, 1])."""
    return (a[:, None, :, None] * b[None, :, None, :]).reshape(a.shape[0] * b.shape[0], a.shape[1] * b.shape[1])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def loha(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...] | None]:
    """(B [N, r1 r2], A [r1 r2, ...], lora_dim, kernel shape of A's rows or None)."""
    if "hada_t1" in p:
        B1, A1 = _tucker(p["hada_t1"], p["hada_w1_a"], p["hada_w1_b"])
        B2, A2 = _tucker(p["hada_t2"], p["hada_w2_a"], p["hada_w2_b"])
        conv = tuple(A1.shape[1:])
    else:
        B1, A1, B2, A2 = _d(p["hada_w1_a"]), _d(p["hada_w1_b"]), _d(p["hada_w2_a"]), _d(p["hada_w2_b"])
        conv = None
    A1, A2 = _flat(A1), _flat(A2)
    if B1.shape[0] != B2.shape[0] or A1.shape[1] != A2.shape[1] or B1.shape[1] != A1.shape[0] \
            or B2.shape[1] != A2.shape[0]:
        raise AdapterShapeError(f"LoHa halves do not fit: w1 {tuple(B1.shape)} x {tuple(A1.shape)}, "
                                f"w2 {tuple(B2.shape)} x {tuple(A2.shape)}.")
    B = (B1[:, :, None] * B2[:, None, :]).reshape(B1.shape[0], -1)
    A = (A1[:, None, :] * A2[None, :, :]).reshape(-1, A1.shape[1])
    return B, A, int(p["hada_w1_b"].shape[0]), conv


def lokr(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int | None, tuple[int, ...] | None]:
    """(B, A, lora_dim (None when both halves are full), kernel shape of the conv's inner dims or None)."""
    dim = None
    if "lokr_w1" in p:
        B1, A1 = _full(p["lokr_w1"])
    else:
        B1, A1 = _d(p["lokr_w1_a"]), _d(p["lokr_w1_b"])
        dim = int(p["lokr_w1_b"].shape[0])
    conv = None
    if "lokr_w2" in p:
        w2 = p["lokr_w2"]
        B2, A2 = _full(w2)
        conv = tuple(w2.shape[2:]) or None
    elif "lokr_t2" in p:
        B2, A2 = _tucker(p["lokr_t2"], p["lokr_w2_a"], p["lokr_w2_b"])
        conv = tuple(A2.shape[2:])
        A2 = _flat(A2)
        dim = dim or int(p["lokr_w2_b"].shape[0])
    else:
        B2, A2 = _d(p["lokr_w2_a"]), _flat(_d(p["lokr_w2_b"]))
        dim = dim or int(p["lokr_w2_b"].shape[0])
    B, A = _kron(B1, B2), _kron(A1, A2)
    if conv is not None:  # kron(w1, w2) over [a, b] x [c, d, kh, kw]: the rows of A are [b*d, kh, kw]
        conv = (A.shape[1] // math.prod(conv), *conv)
    return B, A, dim, conv


def locon(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, ...] | None]:
    up, down = p["lora_up.weight"], p["lora_down.weight"]
    if "lora_mid.weight" in p:  # LoCon Tucker: 1x1 down, kh x kw mid, 1x1 up
        B, A = _tucker(p["lora_mid.weight"], _flat(up).t(), _flat(down))
        return B, _flat(A), int(down.shape[0]), tuple(A.shape[1:])
    return _flat(_d(up)), _flat(_d(down)), int(down.shape[0]), tuple(down.shape[1:]) if down.dim() == 4 else None


def exact_module(name: str, p: dict[str, torch.Tensor], *, scale: float | None = None,
                 dtype: torch.dtype | None = None) -> ModuleLora:
    """One LyCORIS-style module's parts -> an exact `ModuleLora`. `scale` overrides the LyCORIS alpha rule (PEFT
    configs give alpha / r); `dtype` is what the factors are stored in (default: the file's)."""
    algos = {PARTS[k] for k in p} - {None}
    if len(algos) != 1:
        raise FormatError(f"{name}: parts of {sorted(algos) or 'no'} algorithms ({sorted(p)}); a module is one of "
                          "LoRA, LoHa, LoKr or a full diff.")
    algo = algos.pop()
    dtype = dtype or next(t.dtype for k, t in p.items() if k not in ("alpha", "dora_scale"))
    alpha = float(p["alpha"]) if "alpha" in p else None
    bias = None
    try:
        if algo == "loha":
            B, A, dim, conv = loha(p)
        elif algo == "lokr":
            B, A, dim, conv = lokr(p)
        elif algo == "full":
            diff = p["diff"]
            if diff.dim() not in (2, 4):
                raise UnsupportedFeatureError(f"{name}: a full diff of a {diff.dim()}-D weight (a norm layer or an "
                                              "embedding); fd-lora wraps Linear and Conv2d layers only.")
            B, A = _full(diff)
            dim, conv, scale = None, tuple(diff.shape[1:]) if diff.dim() == 4 else None, 1.0
            bias = p.get("diff_b")
        else:
            B, A, dim, conv = locon(p)
    except KeyError as e:
        raise FormatError(f"{name}: a {algo} module without its {e.args[0]} tensor ({sorted(p)}).") from None
    except RuntimeError as e:  # shapes that do not multiply
        raise AdapterShapeError(f"{name}: {algo} tensors of mismatched shapes ({e}).") from None
    if scale is None:  # LyCORIS: alpha / lora_dim, alpha missing or 0 meaning lora_dim; both LoKr halves full: 1
        scale = 1.0 if dim is None or not alpha else alpha / dim
    N, K = B.shape[0], A.shape[1]
    if A.shape[0] >= DENSE_SHARE * min(N, K):  # the factors would be no smaller than ΔW itself
        B, A = _full(B @ A)
    R = A.shape[0]
    if conv is not None:
        A, B = A.reshape(R, *conv), B.reshape(N, R, 1, 1)
    mag, eps = None, 0.0
    if "dora_scale" in p:
        mag, eps = dora_scale(name, p["dora_scale"], N)
    return ModuleLora(A.to(dtype).contiguous(), B.to(dtype).contiguous(), alpha=scale * R, bias=bias,
                      magnitude=mag, dora_eps=eps, origin=algo)


def dora_scale(name: str, t: torch.Tensor, N: int) -> tuple[torch.Tensor, float]:
    """A LyCORIS / kohya ``dora_scale`` -> (magnitude [N], eps LyCORIS adds to the norm)."""
    if t.numel() != N or t.shape[0] != N:
        raise UnsupportedFeatureError(f"{name}.dora_scale {tuple(t.shape)} is a per-input-channel DoRA (LyCORIS "
                                      "wd_on_out=False); fd-lora implements DoRA per output channel (PEFT, LyCORIS's "
                                      "default). Re-save it with wd_on_out=True or merge it.")
    return t.detach().reshape(N).float(), float(torch.finfo(t.dtype).eps)


def group(keys: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """({module name: {part: tensor}}, keys that are not LyCORIS parts)."""
    mods: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for k, v in keys.items():
        s = split(k)
        if s is None:
            rest[k] = v
        else:
            mods.setdefault(s[0], {})[s[1]] = v
    return mods, rest


def why_other(key: str) -> str | None:
    """Why a key of another LyCORIS algorithm is dropped, or None."""
    m = OTHER_ALGOS.search(key)
    return None if m is None else (f"a LyCORIS {m.group(1)} tensor (OFT/BOFT/GLoRA/IA3/norm tuning): fd-lora loads "
                                   "LoRA, LoHa, LoKr, full diffs and DoRA")


def build(mods: dict[str, dict[str, torch.Tensor]], out: Converted, *,
          scale_of=None, where: str = "") -> dict[str, ModuleLora]:
    """Every grouped module -> exact `ModuleLora`; modules fd-lora cannot serve go to `out.dropped`."""
    built = {}
    for name, p in mods.items():
        if set(p) <= {"alpha", "dora_scale"}:
            why = "an alpha / dora_scale for a module that has no weights"
            out.unused.update({f"{name}.{k}": why for k in p})
            continue
        try:
            built[name] = exact_module(name, p, scale=scale_of(name, p) if scale_of else None)
        except UnsupportedFeatureError as e:
            if "per-input-channel" in str(e):
                raise
            out.dropped.update({f"{name}.{k}": str(e) for k in p})
            continue
        except (AdapterShapeError, FormatError) as e:
            raise type(e)(f"{where}: {e}" if where else str(e)) from None
        out.matched += len(p)
    return built


# --- the "lycoris" format: the LyCORIS wrapper's own names (lycoris_<module path with _>) ---------------
UNET_NAMES = tuple(PREFIX + s for s in ("down_blocks_", "up_blocks_", "mid_block_", "conv_in.", "conv_out."))


def detect(raw: Raw) -> str | None:
    n = sum(k.startswith(PREFIX) for k in raw.tensors)
    if not n or any(k.startswith(UNET_NAMES) for k in raw.tensors):  # (diffusers UNet names: the kohya format's)
        return None
    return f"{n} of {len(raw.tensors)} keys start with {PREFIX!r} (LyCORIS create_lycoris network)"


def convert(raw: Raw, opts: Options) -> Converted:
    """Module names keep LyCORIS's flat spelling (dots as _); `resolve` maps them onto the model at load time.
    (A network on a diffusers UNet is read by the kohya format, lycoris_ as lora_unet_.)"""
    out = Converted()
    mods, rest = group({k: v for k, v in raw.tensors.items() if k.startswith(PREFIX)})
    for k in raw.tensors:
        if not k.startswith(PREFIX):
            out.unused[k] = f"not a LyCORIS key (no {PREFIX} prefix)"
    for k in rest:
        out.dropped[k] = why_other(k) or "a LyCORIS key of no algorithm fd-lora knows"
    built = build(mods, out)
    comp = opts.component or MODEL
    out.components[comp] = {FLAT + name[len(PREFIX):]: m for name, m in built.items()}
    out.notes.append(f"component {comp}: LyCORIS module names are matched to the model's modules when loaded")
    return out


FLAT = "\x00flat:"  # a module path still in LyCORIS's flat spelling, resolved against the model by `resolve`


def resolve(adapter: LoraAdapter, model: torch.nn.Module) -> LoraAdapter:
    """`adapter` fitted to `model`: flat LyCORIS names mapped to module paths, flat conv factors shaped like the
    layer's kernel. The same object when nothing needs fitting (plain LoRA adapters)."""
    mods = adapter.modules
    if all(m.origin == "lora" and m.magnitude is None for m in mods.values()) and not any(
            p.startswith(FLAT) for p in mods):
        return adapter
    flat = None
    out, changed = {}, False
    for path, m in mods.items():
        if path.startswith(FLAT):
            if flat is None:
                flat = {n.replace(".", "_"): n for n, _ in model.named_modules() if n}
            name = path[len(FLAT):]
            path = flat.get(name, name)  # (an unknown name stays, and the handle names it as missing)
            changed = True
        try:
            target = model.get_submodule(path)
        except AttributeError:
            target = None
        fitted = fit_to(m, target)
        changed |= fitted is not m
        out[path] = fitted
    if not changed:
        return adapter
    return LoraAdapter(out, adapter.use_rslora, adapter.name, adapter.provenance)


def fit_to(m: ModuleLora, target: torch.nn.Module | None) -> ModuleLora:
    """A flat [R, C*kh*kw] factor pair shaped for the Conv2d it targets (C, kh, kw are the layer's)."""
    if not isinstance(target, torch.nn.Conv2d):
        target = getattr(target, "base", None)  # (an fd-lora layer wraps it already)
    if m.A.dim() != 2 or not isinstance(target, torch.nn.Conv2d):
        return m
    shape = (target.in_channels // target.groups, *target.kernel_size)
    if m.A.shape[1] != math.prod(shape):
        return m  # (check_fits names the mismatch)
    R = m.rank
    return m.replace(m.A.reshape(R, *shape), m.B.reshape(m.B.shape[0], R, 1, 1), m.bias)


# --- opt-in: LoHa / LoKr / diff as plain low-rank LoRA ----------------------------------------------------
def parse_conversion(spec: str | None) -> int | None:
    if spec is None:
        return None
    if isinstance(spec, str) and spec.startswith("svd:") and spec[4:].isdigit() and int(spec[4:]) > 0:
        return int(spec[4:])
    raise FormatError(f"lora_conversion={spec!r} is not valid; give 'svd:RANK' (e.g. 'svd:32') to turn LoHa / LoKr "
                      "/ full-diff modules into plain LoRA of that rank, or None to load them exactly.")


def convert_svd(conv: Converted, rank: int) -> None:
    """Replace every LoHa / LoKr / full module of `conv` by its best rank-`rank` LoRA (truncated SVD of ΔW, as PEFT's
    convert_to_lora). Each module's relative Frobenius error goes to ``conv.configs[component]["svd_errors"]``,
    their mean and max to the notes."""
    errors = {}
    for comp, mods in conv.components.items():
        for path, m in list(mods.items()):
            if m.origin == "lora":
                continue
            delta = _flat(_d(m.B)) @ _flat(_d(m.A)) * m.scaling()
            U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
            r = min(rank, S.shape[0])
            total = float(S.square().sum())
            err = math.sqrt(float(S[r:].square().sum()) / total) if total > 0 else 0.0
            conv.configs.setdefault(comp, {}).setdefault("svd_errors", {})[path.removeprefix(FLAT)] = err
            errors[f"{comp}.{path.removeprefix(FLAT)}"] = err
            B, A = U[:, :r] * S[:r], Vh[:r]
            if m.A.dim() == 4:
                A, B = A.reshape(r, *m.A.shape[1:]), B.reshape(B.shape[0], r, 1, 1)
            mods[path] = m.replace(A.to(m.A.dtype).contiguous(), B.to(m.B.dtype).contiguous(), m.bias,
                                   alpha=float(r), origin="lora", finite=False)
    if not errors:
        conv.notes.append("lora_conversion: no LoHa / LoKr / full-diff module to convert")
        return
    worst = max(errors, key=errors.get)
    conv.notes.append(f"lora_conversion svd:{rank}: {len(errors)} modules turned into plain LoRA; relative error of "
                      f"ΔW (Frobenius) mean {sum(errors.values()) / len(errors):.3g}, max {errors[worst]:.3g} "
                      f"({worst})")


# --- PEFT LoHa / LoKr (adapter_config.json with peft_type LOHA / LOKR) -----------------------------------
def peft_type(config: dict) -> str:
    t = config.get("peft_type") or "LORA"
    return str(getattr(t, "value", t)).upper()


def from_peft(sd: dict[str, torch.Tensor], config: dict, where: str) -> Converted:
    """PEFT LoHa / LoKr keys ``<path>.hada_w1_a`` / ``<path>.lokr_w1``... with PEFT's scale: alpha / r, both
    per module through rank_pattern / alpha_pattern (PEFT's get_pattern_key)."""
    from peft.utils.other import get_pattern_key

    r, alpha = int(config.get("r", 8)), float(config.get("alpha", 8))
    rank_pattern, alpha_pattern = dict(config.get("rank_pattern") or {}), dict(config.get("alpha_pattern") or {})

    def scale_of(path: str, parts: dict) -> float:
        rk = int(rank_pattern.get(get_pattern_key(rank_pattern.keys(), path), r))
        return float(alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), path), alpha)) / rk

    out = Converted()
    mods, rest = group(sd)
    for k in rest:
        out.dropped[k] = why_other(k) or ("a full base-layer tensor or a key no LoHa / LoKr module has: fd-lora "
                                          "applies adapter deltas and never replaces base weights")
    out.components[where] = build(mods, out, scale_of=scale_of, where=where)
    out.configs[where] = {k: config[k] for k in ("peft_type", "r", "alpha", "rank_pattern", "alpha_pattern")
                          if config.get(k)}
    out.configs[where]["peft_type"] = peft_type(config)
    return out


def summary(components: dict[str, dict[str, ModuleLora]]) -> str:
    """'LoHa 12, LoRA 16, DoRA 4' for adapters with anything but plain LoRA modules, else ''."""
    names = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr", "full": "full diff"}
    counts: dict[str, int] = {}
    for mods in components.values():
        for m in mods.values():
            counts[names.get(m.origin, m.origin)] = counts.get(names.get(m.origin, m.origin), 0) + 1
            if m.magnitude is not None:
                counts["DoRA"] = counts.get("DoRA", 0) + 1
    if set(counts) <= {"LoRA"}:
        return ""
    return ", ".join(f"{k} {v}" for k, v in counts.items())
