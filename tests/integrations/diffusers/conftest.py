"""Tiny diffusers pipelines with LoRAs loaded by diffusers+PEFT (the reference) and by fd-lora."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP = ["q_proj", "k_proj", "v_proj", "out_proj"]
ARCHS = {  # denoiser targets per adapter, text encoders that get LoRA
    "sd15": {"den": "unet", "targets": {"style_a": ATTN, "locon_b": ["to_q", "to_v", "conv1", "conv2"]},
             "te": ["text_encoder"]},
    "sdxl": {"den": "unet", "targets": {"style_a": ATTN + ["ff.net.2"], "locon_b": ["to_k", "conv1"]},
             "te": ["text_encoder", "text_encoder_2"]},
    "sd3": {"den": "transformer", "targets": {"style_a": ATTN, "locon_b": ["add_q_proj", "to_v", "ff.net.2"]},
            "te": ["text_encoder"]},
    "flux": {"den": "transformer", "targets": {"style_a": ATTN, "locon_b": ["proj_mlp", "to_k", "ff.net.2"]},
             "te": ["text_encoder"]},
}


def lora_dir(pipe, arch: str, name: str, seed: int) -> str:
    """A diffusers-format LoRA file for `pipe`, made with PEFT (random, clearly visible B)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    spec = ARCHS[arch]
    p = copy.deepcopy(pipe)
    torch.manual_seed(seed)
    r = 4 if name == "style_a" else 8
    den = getattr(p, spec["den"])
    den.add_adapter(LoraConfig(r=r, lora_alpha=2 * r, target_modules=spec["targets"][name], init_lora_weights=False),
                    adapter_name="src")
    layers = {f"{spec['den']}_lora_layers": get_peft_model_state_dict(den, adapter_name="src")}
    for te in spec["te"]:
        inject_adapter_in_model(LoraConfig(r=r, lora_alpha=r, target_modules=CLIP, init_lora_weights=False),
                                getattr(p, te), "src")
        layers[f"{te}_lora_layers"] = get_peft_model_state_dict(getattr(p, te), adapter_name="src")
    with torch.no_grad():
        for sd in layers.values():
            for k, v in sd.items():
                if "lora_B" in k:
                    v.mul_(3)
    d = tempfile.mkdtemp(prefix=f"fdlora-{arch}-{name}-")
    type(pipe).save_lora_weights(d, **layers)
    return d


class Pair:
    """The same tiny pipeline twice: `ref` with diffusers+PEFT LoRAs, `fd` with fd-lora, plus `base`."""

    def __init__(self, arch: str) -> None:
        from fdlora.fixtures import tiny_pipeline as tiny
        from fdlora.integrations.transformers import adapter_from_peft

        self.arch = arch
        self.base = tiny.BUILDERS[arch]()
        self.base.set_progress_bar_config(disable=True)
        self.dirs = {n: lora_dir(self.base, arch, n, i + 1) for i, n in enumerate(ARCHS[arch]["targets"])}
        self.ref = copy.deepcopy(self.base)
        for n, d in self.dirs.items():
            self.ref.load_lora_weights(d, adapter_name=n)
        self.fd = copy.deepcopy(self.base)
        comps = [ARCHS[arch]["den"], *ARCHS[arch]["te"]]
        for n in self.dirs:
            self.fd.load_fd_lora({c: adapter_from_peft(getattr(self.ref, c), n) for c in comps}, n)
        self.latents = self.make_latents(1)

    def make_latents(self, n: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.arch == "flux":
            return torch.randn(n, 256, 16, generator=g)  # packed 32x32x4 latents
        return torch.randn(n, 4, 32, 32, generator=g)

    def gen(self, pipe, **kw):
        from fdlora.fixtures import tiny_pipeline as tiny

        kw.setdefault("latents", self.latents)
        with torch.inference_mode():
            return pipe(**tiny.generate_kwargs(pipe, **kw)).images

    def tolerance(self) -> float:
        """3x eager's own error: diffusers+PEFT in fp32 against the same pipeline in float64 (blend of both)."""
        if not hasattr(self, "_tol"):
            names, weights = ["style_a", "locon_b"], [0.7, 0.4]
            p64 = copy.deepcopy(self.ref).to(torch.float64)
            p64.set_adapters(names, weights)
            self.ref.set_adapters(names, weights)
            oracle = self.gen(p64, latents=self.latents.double())
            self._tol = 3 * float((self.gen(self.ref).double() - oracle).abs().max()) + 1e-6
        return self._tol


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    return Pair(request.param)


@pytest.fixture(scope="module")
def sd15():
    return Pair("sd15")
