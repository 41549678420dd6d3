"""The trainer behind `fdlora train`: build the model, quantize it, add the adapter, run the steps, checkpoint, save.

One process or many: under `accelerate launch` (or torchrun) the Accelerator wraps the model in DDP and every
process takes its slice of the same global batch (fdlora.training.data), so N processes follow the one-process
loss curve. Checkpoints are written by the main process only and hold what is process-count independent: the
trainable parameters by name, the optimizer state, the step and the loss curve so far. Dropout masks are drawn
from a generator seeded by (seed, step, micro-step, rank), and batches are indexed by step, so a resumed run
repeats the uninterrupted run's loss curve exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, TargetError
from . import tiny
from .adapters import add_trainable_adapter, trainable_parameters
from .data import source_for
from .quant import hf_quantization_config, quantize_manual
from .save import save_adapter
from .schema import TrainConfig

ADAPTER = "default"


@dataclass
class TrainResult:
    losses: list[float]
    output: str
    model: nn.Module
    start_step: int = 0


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
    if cfg.task == "text-to-image":
        from diffusers import UNet2DConditionModel

        sub = {} if Path(name, "config.json").exists() else {"subfolder": "unet"}
        return UNet2DConditionModel.from_pretrained(name, **sub, **kw)
    import transformers

    cls = (transformers.AutoModelForImageClassification if cfg.task == "image-classification"
           else transformers.AutoModelForCausalLM)
    return cls.from_pretrained(name, **kw)


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


def _named_trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int, losses: list[float],
                    world: int) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().cpu().contiguous() for n, p in _named_trainable(model).items()},
              tmp / "trainable.safetensors")
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "losses": losses, "processes": world}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # a checkpoint dir is complete or absent


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list[float]]:
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    saved = load_file(path / "trainable.safetensors")
    params = _named_trainable(model)
    if saved.keys() != params.keys():
        raise ConfigError(f"train.resume: {path} holds {len(saved)} trainable tensors, this model {len(params)}; "
                          "allowed: a checkpoint of the same config; fix: set `resume: false` or fix the config")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    opt.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    return int(state["step"]), list(state["losses"])


def _optimizer(cfg: TrainConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def train(cfg: TrainConfig, *, progress: bool = True, stop_after: int | None = None, log=print) -> TrainResult:
    """Run `cfg`. `stop_after` ends the run after that many steps of this call (tests: an interrupted run)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    device = _device(cfg)
    AcceleratorState._reset_state()  # a second run in one process may use other settings (the process group stays)
    acc = Accelerator(mixed_precision=cfg.mixed_precision, cpu=device.type == "cpu")
    device = acc.device
    world, rank = acc.num_processes, acc.process_index
    if cfg.batch_size % world:
        raise ConfigError(f"{cfg.source}: train.batch_size: got {cfg.batch_size}; allowed: a multiple of the "
                          f"{world} processes; fix: set `batch_size: {cfg.batch_size // world * world or world}`")
    model = build_model(cfg, device)
    try:
        add_trainable_adapter(model, ADAPTER, cfg.lora_config())
    except TargetError as e:
        raise ConfigError(f"{cfg.source}: lora.target_modules: {e}") from None
    if cfg.quant is None or cfg.quant_method == "manual":
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
            start, losses = load_checkpoint(ck, model, opt)
            log(f"resuming from {ck} at step {start}")
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
            ctx = acc.no_sync(dmodel) if not sync and world > 1 else _null()
            with ctx, acc.autocast():
                loss = tiny.loss_of(cfg.task, dmodel, batch) / cfg.grad_accumulation
            acc.backward(loss)
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(acc.reduce(total, "mean").item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            if acc.is_main_process:
                save_checkpoint(out / "checkpoints" / f"step-{step + 1}", model, opt, step + 1, losses, world)
            acc.wait_for_everyone()
        done += 1
        if stop_after is not None and done >= stop_after:
            break
    bar.close()
    finished = start + done >= cfg.steps
    if finished and acc.is_main_process:
        save_adapter(model, ADAPTER, out, None if cfg.model in tiny.TASKS else cfg.model)
        (out / "losses.json").write_text(json.dumps(losses))
        if cfg.push_to_hub:
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(cfg.push_to_hub, exist_ok=True)
            api.upload_folder(repo_id=cfg.push_to_hub, folder_path=str(out), ignore_patterns=["checkpoints/*"])
    acc.wait_for_everyone()
    return TrainResult(losses, str(out), model, start)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def env_summary() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}"
