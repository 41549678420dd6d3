"""fd-lora under accelerate offload / device maps and diffusers offload modes (issue 26, part 2).

Oracle: the same model or pipeline with the same adapters and no offload (fd-lora), and diffusers+PEFT / PEFT under
the same offload. CPU cases: a tiny Llama with a device_map holding "cpu" and "disk" entries (from_pretrained of a
saved model), accelerate's cpu_offload / disk_offload / dispatch_model with adapters loaded before and after, and
diffusers' group offloading (block and leaf level) and model offload on a tiny SD1.5 pipeline with onload and offload
device "cpu". The CPU cases turn the merged-weight cache on, so the "offloaded layers never cache" rule is exercised.
GPU cases (marked): enable_model_cpu_offload, enable_sequential_cpu_offload, group offloading with and without
streams, each against the same pipeline without offload and against diffusers+PEFT under the same offload.
(diffusers' enable_sequential_cpu_offload cannot run on a CPU: accelerate fails on the text encoder's embedding
with this torch, fd-lora or not.)
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import fdlora  # noqa: E402
from fdlora.layers.modules.fused import _FusedLora  # noqa: E402
from fdlora.layers.storage.offload import offloaded_layers  # noqa: E402

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from .diffusers.conftest import lora_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _merge_cache_on():
    """The merged-weight cache on (it is off on CPU by default): offloaded layers must still never use it."""
    fdlora.set_merge_cache(1 << 28)
    yield
    fdlora.set_merge_cache("auto")


def _cached_offloaded(model) -> list[str]:
    """Offloaded fused layers that hold a merged-weight copy (must be none)."""
    off = offloaded_layers(model)
    return [n for n, m in model.named_modules() if n in off and m.merged.buf is not None]


# --- transformers: a tiny Llama with accelerate hooks --------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    d = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.save_pretrained(d / "base")
    for i, name in enumerate("ab"):
        torch.manual_seed(i + 1)
        p = get_peft_model(copy.deepcopy(m), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                        init_lora_weights=False))
        p.save_pretrained(d / name)
    return d


IDS = torch.randint(2, 96, (3, 6), generator=torch.Generator().manual_seed(1))
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
              "model.rotary_emb": "cpu", "lm_head": "disk"}


def _fresh(d, **kw):
    return transformers.LlamaForCausalLM.from_pretrained(d / "base", **kw).eval()


def _load(m, d):
    m = fdlora.load_fd_lora(m, d / "a", adapter_name="a")
    fdlora.load_fd_lora(m, d / "b", adapter_name="b")
    return m


@torch.no_grad()
def _outputs(m) -> list[torch.Tensor]:
    """Blend of both adapters, then a per-row batch, then a switch to one adapter (set_adapters under offload)."""
    fdlora.set_adapters(m, ["a", "b"], [0.7, 0.4])
    blend = m(IDS).logits
    rows = m(IDS, fd_lora_adapters=["a", None, "b"]).logits
    fdlora.set_adapters(m, ["b"])
    one = m(IDS).logits
    return [blend, rows, one]


@pytest.fixture(scope="module")
def llama_ref(llama):
    with torch.no_grad(), fdlora.use_backend("auto"):  # a CPU reference, whatever FDLORA_BACKEND pins
        return _outputs(_load(_fresh(llama), llama))


LLAMA_CASES = [
    pytest.param(lambda d, t: _load(_fresh(d, device_map=DEVICE_MAP, offload_folder=t), d), 7,
                 id="device_map-cpu+disk-load-after"),
    pytest.param(lambda d, t: accelerate.cpu_offload(_load(_fresh(d), d), execution_device="cpu"), 14,
                 id="cpu_offload-load-before"),
    pytest.param(lambda d, t: _load(accelerate.cpu_offload(_fresh(d), execution_device="cpu"), d), 14,
                 id="cpu_offload-load-after"),
    pytest.param(lambda d, t: accelerate.disk_offload(_load(_fresh(d), d), t, execution_device="cpu"), 14,
                 id="disk_offload-load-before"),
    pytest.param(lambda d, t: _load(accelerate.disk_offload(_fresh(d), t, execution_device="cpu"), d), 14,
                 id="disk_offload-load-after"),
    pytest.param(lambda d, t: accelerate.dispatch_model(_load(_fresh(d), d), device_map=DEVICE_MAP, offload_dir=t,
                                                        main_device="cpu"), 7,
                 id="dispatch_model-cpu+disk-load-before"),
]


@pytest.mark.parametrize("build, n_offloaded", LLAMA_CASES)
def test_llama_offload_matches_no_offload(llama, llama_ref, tmp_path, build, n_offloaded):
    m = build(llama, tmp_path)
    got = _outputs(m)
    for what, g, r in zip(("blend", "per-row", "switched"), got, llama_ref):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=lambda s, w=what: f"{w}: {s}")
    assert len(offloaded_layers(m)) == n_offloaded  # the offloaded layers; device_map's resident ones stay plain
    assert _cached_offloaded(m) == []
    for layer in (mod for mod in m.modules() if isinstance(mod, _FusedLora)):
        assert layer.bank.A.device.type == "cpu"  # the execution device, never meta


@pytest.mark.parametrize("order", ["before", "after"])
def test_llama_generate_per_row_under_cpu_offload(llama, order):
    """generate with PEFT's adapter_names through accelerate's hook on the model itself (its forward is fd-lora's)."""
    ref = _load(_fresh(llama), llama).generate(IDS, adapter_names=["a", "__base__", "b"], max_new_tokens=4,
                                               do_sample=False)
    m = (accelerate.cpu_offload(_load(_fresh(llama), llama), execution_device="cpu") if order == "before"
         else _load(accelerate.cpu_offload(_fresh(llama), execution_device="cpu"), llama))
    got = m.generate(IDS, adapter_names=["a", "__base__", "b"], max_new_tokens=4, do_sample=False)
    assert torch.equal(got, ref)
    assert not torch.equal(got, _fresh(llama).generate(IDS, max_new_tokens=4, do_sample=False))


def test_llama_cpu_offload_matches_peft_under_same_offload(llama, tmp_path):
    from peft import PeftModel

    peft = PeftModel.from_pretrained(_fresh(llama), llama / "a", adapter_name="a").eval()
    accelerate.cpu_offload(peft, execution_device="cpu")
    m = accelerate.cpu_offload(fdlora.load_fd_lora(_fresh(llama), llama / "a", adapter_name="a"),
                               execution_device="cpu")
    with torch.no_grad():
        ref, got = peft(IDS).logits, m(IDS).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (got - _fresh(llama)(IDS).logits).abs().max() > 1e-3  # the LoRA does something


def _gpu_map(second):
    return {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": second, "model.norm": 0,
            "model.rotary_emb": 0, "lm_head": 0}


GPU_MAPS = {"cuda+cpu": ("cpu", 7), "cuda+disk": ("disk", 7), "two-gpus": (1, 0)}


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("where", list(GPU_MAPS))
def test_llama_device_map_gpu(llama, llama_ref, tmp_path, where, order):
    """A device_map with the GPU as main device: offloaded layers run on it with their banks there, never cached."""
    second, n_offloaded = GPU_MAPS[where]
    if second == 1 and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    fdlora.set_merge_cache("auto")
    dm = _gpu_map(second)
    if order == "after":
        m = _load(_fresh(llama, device_map=dm, offload_folder=tmp_path), llama)
    else:
        m = accelerate.dispatch_model(_load(_fresh(llama), llama), device_map=dm, offload_dir=tmp_path,
                                      main_device="cuda:0")
    got = _outputs(m)
    for what, g, r in zip(("blend", "per-row", "switched"), got, llama_ref):  # (TF32 dots in the Triton kernels)
        torch.testing.assert_close(g.cpu(), r, rtol=5e-3, atol=5e-3, msg=lambda s, w=what: f"{w}: {s}")
    assert len(offloaded_layers(m)) == n_offloaded
    assert _cached_offloaded(m) == []
    for name, layer in ((n, mod) for n, mod in m.named_modules() if isinstance(mod, _FusedLora)):
        assert layer.bank.A.device.type == "cuda", name
        if name.startswith("model.layers.1.") and second == 1:
            assert layer.bank.A.device == torch.device("cuda", 1), name


# --- diffusers: a tiny SD1.5 pipeline --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd15():
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    return pipe, lora_dir(pipe, "sd15", "style_a", 1), lora_dir(pipe, "sd15", "locon_b", 2)


def _fd(pipe, a, b):
    pipe.load_fd_lora(a, adapter_name="a")
    pipe.load_fd_lora(b, adapter_name="b")
    return pipe


def _peft(pipe, a, b):
    pipe.load_lora_weights(a, adapter_name="a")
    pipe.load_lora_weights(b, adapter_name="b")
    return pipe


def _images(pipe, per_prompt: bool = True, size: int = 32) -> list[torch.Tensor]:
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe.set_adapters(["a", "b"], [0.8, 0.5])
    out = [pipe(**tiny.generate_kwargs(pipe, steps=2, size=size, output_type="pt")).images]
    pipe.set_adapters(["b"], [1.0])
    out.append(pipe(**tiny.generate_kwargs(pipe, steps=2, size=size, output_type="pt")).images)
    if per_prompt:
        kw = tiny.generate_kwargs(pipe, steps=2, size=size, output_type="pt")
        kw["prompt"] = ["a cat", "a dog"]
        out.append(pipe(**kw, fd_lora_adapters=["a", "b"]).images)
    return out


def _group_offload(pipe, device, **kw):
    from diffusers.hooks import apply_group_offloading

    for name in ("unet", "text_encoder", "vae"):
        apply_group_offloading(getattr(pipe, name), onload_device=torch.device(device),
                               offload_device=torch.device("cpu"), **kw)
    return pipe


@pytest.fixture(scope="module")
def sd15_ref(sd15):
    pipe, a, b = sd15
    return _images(_fd(copy.deepcopy(pipe), a, b)), None


GROUP = {"block": {"offload_type": "block_level", "num_blocks_per_group": 1}, "leaf": {"offload_type": "leaf_level"}}


@pytest.mark.parametrize("kind", list(GROUP))
@pytest.mark.parametrize("order", ["before", "after"])
def test_sd15_group_offload_cpu(sd15, sd15_ref, kind, order):
    pipe, a, b = sd15
    p = copy.deepcopy(pipe)
    p = _group_offload(_fd(p, a, b), "cpu", **GROUP[kind]) if order == "before" else \
        _fd(_group_offload(p, "cpu", **GROUP[kind]), a, b)
    got = _images(p)
    for g, r in zip(got, sd15_ref[0]):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)  # merged W' (reference) vs per-call delta
    if kind == "leaf":  # every base carries diffusers' hook: offloaded, never cached (block level on one device:
        assert offloaded_layers(p.unet) and _cached_offloaded(p.unet) == []  # nothing moves, nothing to avoid)
    if order == "after":
        return
    peft = _images(_group_offload(_peft(copy.deepcopy(pipe), a, b), "cpu", **GROUP[kind]), per_prompt=False)
    for g, r in zip(got, peft):  # diffusers+PEFT under the same offload
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_sd15_model_cpu_offload_cpu(sd15, sd15_ref):
    pipe, a, b = sd15
    p = _fd(copy.deepcopy(pipe), a, b)
    p.enable_model_cpu_offload(device="cpu")
    for g, r in zip(_images(p), sd15_ref[0]):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)  # merged W' (reference) vs per-call delta


# --- GPU: diffusers' offload modes ------------------------------------------------------------------------------

def _gpu_modes():
    def model(p):
        p.enable_model_cpu_offload()

    def sequential(p):
        p.enable_sequential_cpu_offload()

    def group(**kw):
        return lambda q: _group_offload(q, "cuda", **kw)
    return {"model": model, "sequential": sequential,
            "group-block": group(offload_type="block_level", num_blocks_per_group=1),
            "group-block-stream": group(offload_type="block_level", num_blocks_per_group=1, use_stream=True),
            "group-leaf-stream": group(offload_type="leaf_level", use_stream=True)}


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("mode", list(_gpu_modes()))
def test_sd15_offload_gpu(sd15, mode, order):
    """Oracle: diffusers+PEFT under the same offload. fd-lora under offload may differ from it by what fd-lora
    without offload differs from PEFT without offload (fp32 with TF32 in cuDNN convs and Triton dots, merged W'
    against per-call deltas: a few 1e-3 on these [0, 1] images) plus 2e-3, and by far less than the LoRA's effect."""
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe, a, b = sd15
    enable = _gpu_modes()[mode]
    ref_fd = _images(_fd(copy.deepcopy(pipe).to("cuda"), a, b), size=64)
    peft_ref = _images(_peft(copy.deepcopy(pipe).to("cuda"), a, b), per_prompt=False, size=64)
    plain = copy.deepcopy(pipe).to("cuda")
    plain = plain(**tiny.generate_kwargs(plain, steps=2, size=64, output_type="pt")).images
    p = copy.deepcopy(pipe)
    if order == "before":
        enable(_fd(p, a, b))
    else:
        enable(p)
        _fd(p, a, b)
    got = _images(p, size=64)
    q = copy.deepcopy(pipe)
    enable(q)
    peft = _images(_peft(q, a, b), per_prompt=False, size=64)
    gap = lambda xs, ys: max(float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(xs, ys))  # noqa: E731
    resident, offloaded, effect = gap(ref_fd, peft_ref), gap(got, peft), gap(peft_ref[:1], [plain])
    assert offloaded <= resident + 2e-3 and offloaded < effect / 10, (
        f"fd-lora vs diffusers+PEFT: {offloaded:.2e} under {mode} offload, {resident:.2e} without; LoRA effect "
        f"{effect:.2e}")
    # per-prompt adapters (PEFT has no such call): against fd-lora without offload, within the two gaps above
    assert gap(got[2:], ref_fd[2:]) <= resident + offloaded + 2e-3
    if mode != "model":  # model offload moves whole components with .to(): cached copies go with them
        assert _cached_offloaded(p.unet) == [] and offloaded_layers(p.unet)
    for layer in (m for m in p.unet.modules() if isinstance(m, _FusedLora)):
        assert layer.bank.A.device.type in ("cuda", "cpu")


# --- the benchmark's CPU smoke mode -----------------------------------------------------------------------------

def test_bench_offload_smoke(tmp_path):
    out = tmp_path / "offload.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {row["impl"] for row in rows} == {"fd-lora", "diffusers+peft"}
    assert all(row["ok"] for row in rows)
