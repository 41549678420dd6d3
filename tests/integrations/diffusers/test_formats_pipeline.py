"""Files in each community format, loaded by `pipe.load_fd_lora` and by diffusers' `load_lora_weights`."""

from __future__ import annotations

import copy

import pytest
import torch
from support import loras
from support import tiny as shapes_of

import fdlora
from fdlora.fixtures import tiny_pipeline as tiny

from .conftest import Pair


def write(files, d):
    for name, data in files.items():
        (d / name).write_bytes(data)
    return next(iter(files))


@pytest.mark.parametrize("kind,sgm", [("sd15", False), ("sdxl", True)], ids=["sd15-kohya", "sdxl-kohya-sgm-names"])
def test_kohya_file_through_the_pipeline(kind, sgm, tmp_path):
    base = tiny.BUILDERS[kind]()
    base.set_progress_bar_config(disable=True)
    tes = []  # text-encoder kohya keys vs diffusers: tests/hub/test_formats.py (diffusers' pipeline loader
    # cannot infer kohya TE keys against transformers 5 CLIP models, so this compares the UNet part)
    comps = {"unet": loras.make_lora(shapes_of.shapes(base.unet, ("to_q", "to_v", "ff.net.2"), convs=("conv1",)),
                                     rank=4, seed=3, alpha=2.0, b_scale=2.0)}
    for i, te in enumerate(tes):  # LoRA files name CLIP modules with `text_model.`, transformers 5 may not
        paths = {"text_model." + p.removeprefix("text_model."): s
                 for p, s in shapes_of.shapes(getattr(base, te), ("q_proj", "v_proj")).items()}
        comps[te] = loras.make_lora(paths, rank=4, seed=4 + i, alpha=8.0, b_scale=2.0)
    name = write(loras.kohya_file(comps, kind=kind, sgm=sgm), tmp_path)
    ref, fd = copy.deepcopy(base), copy.deepcopy(base)
    ref.load_lora_weights(str(tmp_path), weight_name=name, adapter_name="k")
    report = fd.load_fd_lora(str(tmp_path), weight_name=name, adapter_name="k")
    assert report.format == "kohya" and set(fd.get_list_adapters()) == {"unet"}
    assert any(l.kind == "conv2d" and any(l.bank.used) for l in fdlora.handle(fd.unet).layers.values())
    pair = Pair.__new__(Pair)
    pair.arch, pair.latents = kind, torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    want, got, plain = pair.gen(ref), pair.gen(fd), pair.gen(base)
    assert float((want - plain).abs().max()) > 1e-2
    assert float((got - want).abs().max()) < 1e-4
