"""MODEL -> a module tree on the `meta` device plus meta inputs for one step, from config files only.

A MODEL is a builtin name (fdlora.plan.builtins), a local directory, or a Hub id. Only config.json /
model_index.json are read, through huggingface_hub's cache (never weights; a miss downloads only those
small files unless HF_HUB_OFFLINE is set). A pipeline (model_index.json) is planned on its denoiser: the
`transformer` or `unet` component, where the step time goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ResolveError, UnsupportedFeatureError
from .builtins import BUILTINS, DEFAULTS

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32}


@dataclass
class Spec:
    name: str
    family: str  # unet | flux | llm
    cls: str
    config: dict
    targets: tuple[str, ...]
    dtype: str
    workload: dict = field(default_factory=dict)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResolveError(f"cannot read {path}: {e}. Pass a directory holding a valid config.json.") from None


def _family(cfg: dict, where: str) -> tuple[str, str]:
    cls = cfg.get("_class_name", "")
    if cls == "UNet2DConditionModel":
        return "unet", cls
    if cls.startswith("Flux") and "Transformer" in cls:
        return "flux", "FluxTransformer2DModel"
    if "model_type" in cfg or "architectures" in cfg:
        return "llm", (cfg.get("architectures") or ["AutoModelForCausalLM"])[0]
    raise UnsupportedFeatureError(
        f"{where}: fdlora plan models UNet2DConditionModel, FluxTransformer2DModel and transformers causal LMs; "
        f"this config is {cls or 'of no known class'}. Plan the nearest builtin (sdxl, flux-dev, llama-3-8b) instead.")


def _hub_file(repo: str, name: str) -> Path | None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    for local in (True, False):
        try:
            return Path(hf_hub_download(repo, name, local_files_only=local))
        except EntryNotFoundError:
            return None
        except (LocalEntryNotFoundError, RepositoryNotFoundError, OSError, ValueError) as e:
            err = e
            if local:
                continue
    if "Repository Not Found" in str(err) or "404" in str(err):
        return None
    raise ResolveError(f"{repo}: {name} is not in the Hugging Face cache and could not be fetched "
                       f"({type(err).__name__}). Run once online, `huggingface-cli download {repo} {name}`, or "
                       "pass a local directory with the config.") from None


def resolve(model: str) -> Spec:
    """The Spec of `model`; raises ResolveError naming the fix when no config can be found."""
    if model in BUILTINS:
        fam, cls, cfg, targets, dtype, work = BUILTINS[model]
        return Spec(model, fam, cls, dict(cfg), targets, dtype, dict(work))
    path = Path(model)
    if path.is_dir():
        def get(n: str) -> Path | None:
            return path / n if (path / n).is_file() else None
    elif path.exists() or "/" not in model or model.count("/") > 1:
        raise ResolveError(
            f"{model!r} is not a builtin ({', '.join(BUILTINS)}), a directory with config.json or "
            "model_index.json, nor a Hub id (owner/name). Pass one of those.")
    else:
        def get(n: str) -> Path | None:
            return _hub_file(model, n)
    index = get("model_index.json")
    if index is not None:
        comps = _read_json(index)
        comp = next((c for c in ("transformer", "unet") if c in comps), None)
        cfg_path = get(f"{comp}/config.json") if comp else None
        if cfg_path is None:
            raise ResolveError(f"{model}: model_index.json has no transformer/unet component config "
                               "(transformer/config.json or unet/config.json). Plan the denoiser's own directory.")
    else:
        cfg_path = get("config.json")
        if cfg_path is None:
            raise ResolveError(f"{model}: no config.json or model_index.json found. Pass a diffusers pipeline or "
                               "model directory / Hub id, a transformers model, or a builtin "
                               f"({', '.join(BUILTINS)}).")
    cfg = _read_json(cfg_path)
    fam, cls = _family(cfg, str(cfg_path))
    _, _, _, targets, dtype, work = DEFAULTS[fam]
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or dtype).removeprefix("torch.")
    return Spec(model, fam, cls, cfg, targets, dtype if dtype in DTYPES else "bfloat16", dict(work))


def build(spec: Spec, dtype: torch.dtype) -> torch.nn.Module:
    """The module tree on `meta` (no memory, no weights)."""
    cfg = {k: v for k, v in spec.config.items() if not k.startswith("_")}
    with torch.device("meta"):
        if spec.family == "unet":
            from diffusers import UNet2DConditionModel

            model = UNet2DConditionModel.from_config(cfg)
        elif spec.family == "flux":
            from diffusers import FluxTransformer2DModel

            model = FluxTransformer2DModel.from_config(cfg)
        else:
            import transformers

            conf = transformers.AutoConfig.for_model(**cfg)
            conf._attn_implementation = "sdpa"
            model = transformers.AutoModelForCausalLM.from_config(conf)
    return model.to(dtype).eval()


def inputs(spec: Spec, model: torch.nn.Module, dtype: torch.dtype, w: dict) -> dict:
    """Meta inputs of one step: a denoiser call (batch, resolution, text tokens) or an LLM forward of
    `tokens` new rows per sequence (decode: 1; the KV context is applied to attention by the planner)."""
    dev, c = "meta", spec.config
    B = w["batch"]
    if spec.family == "unet":
        lat = w["resolution"] // 8
        out = dict(sample=torch.empty(B, c.get("in_channels", 4), lat, lat, device=dev, dtype=dtype),
                   timestep=torch.tensor(500, device=dev),
                   encoder_hidden_states=torch.empty(B, w["text_tokens"], c["cross_attention_dim"], device=dev,
                                                     dtype=dtype))
        if c.get("addition_embed_type") == "text_time":
            pooled = c["projection_class_embeddings_input_dim"] - 6 * c["addition_time_embed_dim"]
            out["added_cond_kwargs"] = {"text_embeds": torch.empty(B, pooled, device=dev, dtype=dtype),
                                        "time_ids": torch.empty(B, 6, device=dev, dtype=dtype)}
        return out
    if spec.family == "flux":
        img, txt = (w["resolution"] // 16) ** 2, w["text_tokens"]
        out = dict(hidden_states=torch.empty(B, img, c["in_channels"], device=dev, dtype=dtype),
                   encoder_hidden_states=torch.empty(B, txt, c["joint_attention_dim"], device=dev, dtype=dtype),
                   pooled_projections=torch.empty(B, c["pooled_projection_dim"], device=dev, dtype=dtype),
                   timestep=torch.empty(B, device=dev, dtype=dtype),
                   img_ids=torch.empty(img, 3, device=dev, dtype=dtype),
                   txt_ids=torch.empty(txt, 3, device=dev, dtype=dtype), return_dict=False)
        if c.get("guidance_embeds"):
            out["guidance"] = torch.empty(B, device=dev, dtype=dtype)
        return out
    # a ready 4-D mask: transformers builds 2-D ones with data-dependent checks (.item()) that meta cannot run
    T = w["tokens"]
    return dict(input_ids=torch.zeros(B, T, dtype=torch.long, device=dev), use_cache=False,
                attention_mask=torch.ones(B, 1, T, T, dtype=torch.bool, device=dev), logits_to_keep=1)
