"""The trainer behind `fdlora train`: build the model, quantize it, add the adapter, run the steps, checkpoint, save.

One process or many: under `accelerate launch` (or torchrun) every process takes its slice of the same global
batch (fdlora.training.data), so N processes follow the one-process loss curve. The model is either replicated
(DDP, through the Accelerator) or, with `train.distributed: fsdp` or `accelerate launch --use_fsdp`, sharded
with FSDP2 (fdlora.training.fsdp says why the trainer shards it itself). Checkpoints (fdlora.training.checkpoint)
are written by the main process only and hold what is process-count independent, so a run resumes with another
process count, with or without FSDP. Dropout masks are drawn from a generator seeded by (seed, step, micro-step,
rank), and batches are indexed by step, so a resumed run repeats the uninterrupted run's loss curve exactly
(with the same process count; with `lora.dropout` > 0, N processes draw other masks than one does, so their
curves agree in distribution, not step by step).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fdlora.fixtures import tiny_tasks as tiny
from fdlora.integrations.transformers.trainable.adapters import add_trainable_adapter, trainable_parameters
from fdlora.training import checkpoint, fsdp

from .. import env
from ..errors import ConfigError, TargetError
from .data import source_for
from .push import push
from .quant import hf_quantization_config, quantize_manual
from .save import adapter_state_dict, save_adapter
from .schema import TrainConfig

ADAPTER = "default"


@dataclass
class TrainResult:
    losses: list[float]
    output: str
    model: nn.Module
    start_step: int = 0
    main: bool = True  # the main process (the one that wrote the output); the others print nothing at the end


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def build_model(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """The base model of `cfg`, quantized as asked (manual: swapped here; hf: loaded quantized)."""
    if cfg.quant is not None and cfg.quant_method == "hf":
        return _hf_quantized(cfg, device)
    if cfg.model in tiny.TASKS:
        model = tiny.build(cfg.model)
    else:
        model = _from_pretrained(cfg, cfg.model)
    if cfg.quant is not None:
        model = model.to(device)
        quantize_manual(model, cfg.quant, device)
    return model


def _from_pretrained(cfg: TrainConfig, name: str, **kw) -> nn.Module:
    if not Path(name).exists():
        reachable(cfg, name, "unet/config.json" if cfg.task == "text-to-image" else "config.json")
    if cfg.task == "text-to-image":
        from diffusers import UNet2DConditionModel

        sub = {} if Path(name, "config.json").exists() else {"subfolder": "unet"}
        return UNet2DConditionModel.from_pretrained(name, **sub, **kw)
    import transformers

    cls = (transformers.AutoModelForImageClassification if cfg.task == "image-classification"
           else transformers.AutoModelForCausalLM)
    return cls.from_pretrained(name, **kw)


def reachable(cfg: TrainConfig, name: str, config_file: str) -> None:
    """Fail at once, in one line naming the fix, when Hub model `name` is not in the local Hugging Face cache and
    cannot be downloaded (HF_HUB_OFFLINE set, the Hub unreachable: one request with a short timeout, where
    from_pretrained would retry for most of a minute) or does not exist. A cached model loads as usual."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub import errors as he

    if isinstance(try_to_load_from_cache(name, config_file), str):
        return
    builtins = f"the builtins {', '.join(tiny.TASKS)} need no download"
    if constants.is_offline_mode():
        raise ConfigError(f"{cfg.source}: model {name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                          f"set; fix: download it once with network access (`hf download {name}`) or unset "
                          f"HF_HUB_OFFLINE; {builtins}")
    try:
        model_info(name, timeout=10)
    except he.RepositoryNotFoundError:
        raise ConfigError(f"{cfg.source}: model {name!r} is neither a local directory nor a model on the Hub at "
                          f"{constants.ENDPOINT} (or it is private or gated: log in with `hf auth login`); fix: check "
                          "model.name") from None
    except Exception as e:
        if not (isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests")):
            return  # anything else (an HTTP error, a gated repo's answer): from_pretrained reports it
        raise ConfigError(f"{cfg.source}: model {name!r} is not in the local Hugging Face cache and the Hub at "
                          f"{constants.ENDPOINT} cannot be reached ({type(e).__name__}: {str(e)[:120]}); fix: connect "
                          f"to the network, or download it once where you can (`hf download {name}`) into this "
                          f"cache ({constants.HF_HUB_CACHE}); {builtins}") from None


def _hf_quantized(cfg: TrainConfig, device: torch.device) -> nn.Module:
    if cfg.task == "text-to-image":
        raise ConfigError(f"{cfg.source}: quantization.method: hf loads Transformers models; allowed: manual for "
                          "text-to-image; fix: set `method: manual`")
    q = hf_quantization_config(cfg.quant)
    if cfg.model not in tiny.TASKS:
        return _from_pretrained(cfg, cfg.model, quantization_config=q, device_map=str(device))
    with tempfile.TemporaryDirectory() as d:  # a tiny model goes through from_pretrained like any other
        tiny.build(cfg.model).save_pretrained(d)
        return _from_pretrained(cfg, d, quantization_config=q, device_map=str(device))


def _checkpoints(out: Path) -> list[Path]:
    d = out / "checkpoints"
    return sorted(d.glob("step-*"), key=lambda p: int(p.name[5:])) if d.is_dir() else []


def parallelism(cfg: TrainConfig, world: int, asked_fsdp: bool) -> str:
    """"single" | "ddp" | "fsdp": how `world` processes share the model (train.distributed; with auto, FSDP when
    accelerate launch was asked for it)."""
    if world == 1:
        return "single"
    mode = cfg.distributed if cfg.distributed != "auto" else "fsdp" if asked_fsdp else "ddp"
    if mode == "fsdp" and cfg.quant is not None:
        raise ConfigError(f"{cfg.source}: quantization with FSDP (accelerate launch --use_fsdp): FSDP does not shard "
                          "quantized weights; fix: launch without --use_fsdp (DDP) or set `quantization: "
                          "{enabled: false}`")
    return mode


def _optimizer(cfg: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def train(cfg: TrainConfig, *, progress: bool = True, stop_after: int | None = None, log=print) -> TrainResult:
    """Run `cfg`. `stop_after` ends the run after that many steps of this call (tests: an interrupted run)."""
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    device = _device(cfg)
    AcceleratorState._reset_state()  # a second run in one process may use other settings (the process group stays)
    asked_fsdp = env.accelerate_fsdp()  # `accelerate launch --use_fsdp`, read before the Accelerator hides it
    acc = fsdp.accelerator(mixed_precision=cfg.mixed_precision, cpu=device.type == "cpu")
    device = acc.device
    world, rank = acc.num_processes, acc.process_index
    if cfg.batch_size % world:
        raise ConfigError(f"{cfg.source}: train.batch_size: got {cfg.batch_size}; allowed: a multiple of the "
                          f"{world} processes; fix: set `batch_size: {cfg.batch_size // world * world or world}`")
    mode = parallelism(cfg, world, asked_fsdp)
    model = build_model(cfg, device)
    try:
        add_trainable_adapter(model, ADAPTER, cfg.lora_config())
    except TargetError as e:
        raise ConfigError(f"{cfg.source}: lora.target_modules: {e}") from None
    if mode == "fsdp":
        fsdp.shard(model, device, world)  # moves each process's shards to the device
        if acc.is_main_process:
            log(f"FSDP over {world} processes: {fsdp.held(model)}")
    elif cfg.quant is None or cfg.quant_method == "manual":
        model.to(device)
    model.train()
    params = trainable_parameters(model)
    opt = _optimizer(cfg, params)
    out = Path(cfg.output)
    start, losses = 0, []
    if cfg.resume:
        ck = Path(cfg.resume) if isinstance(cfg.resume, str) else (_checkpoints(out) or [None])[-1]
        if ck is not None:
            if not (ck / "state.json").exists():
                raise ConfigError(f"{cfg.source}: train.resume: got {str(ck)!r}; allowed: a checkpoint dir "
                                  f"(with state.json); fix: point it at {out / 'checkpoints'}/step-N or use true")
            start, losses = checkpoint.load(ck, model, opt, params)
            log(f"resuming from {ck} at step {start}")
    if mode == "fsdp":  # the model is sharded already: accelerate wraps only the optimizer (its loss scaler)
        dmodel, opt = model, acc.prepare_optimizer(opt, device_placement=False)
    else:
        dmodel, opt = acc.prepare(model, opt)
    data = source_for(cfg, model)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train",
               disable=not (progress and acc.is_main_process), dynamic_ncols=True)
    done = 0
    for step in bar:
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accumulation):
            i = step * cfg.grad_accumulation + micro
            batch = {k: v.to(device) for k, v in data.batch(i, cfg.batch_size, rank, world).items()}
            torch.manual_seed(cfg.seed * 1_000_003 + i * 131 + rank)  # dropout masks: a function of the step
            sync = micro == cfg.grad_accumulation - 1
            ctx = (fsdp.no_sync(dmodel, not sync) if mode == "fsdp"
                   else acc.no_sync(dmodel) if not sync and world > 1 else _null())
            with ctx, acc.autocast():
                loss = tiny.loss_of(cfg.task, dmodel, batch) / cfg.grad_accumulation
            acc.backward(loss)
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(acc.reduce(total, "mean").item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            tensors, opt_state = checkpoint.gather(model, opt)  # every process: FSDP gathers the shards
            if acc.is_main_process:
                checkpoint.write(out / "checkpoints" / f"step-{step + 1}", tensors, opt_state, step + 1, losses,
                                 world)
            acc.wait_for_everyone()
        done += 1
        if stop_after is not None and done >= stop_after:
            break
    bar.close()
    finished = start + done >= cfg.steps
    if finished and (mode == "fsdp" or acc.is_main_process):
        sd = adapter_state_dict(model, ADAPTER)  # every process under FSDP: it gathers the shards
        if acc.is_main_process:
            save_adapter(model, ADAPTER, out, None if cfg.model in tiny.TASKS else cfg.model, state_dict=sd)
            (out / "losses.json").write_text(json.dumps(losses))
    acc.wait_for_everyone()
    if finished and cfg.push_to_hub and acc.is_main_process:
        push(out, cfg.push_to_hub, log)
    return TrainResult(losses, str(out), model, start, acc.is_main_process)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def env_summary() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}"
