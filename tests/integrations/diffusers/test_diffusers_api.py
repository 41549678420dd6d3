"""The pipeline surface: per-prompt adapters, threads, compile, fuse/unload exactness, atomic loads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import fdlora
from fdlora import errors
from fdlora.hub.adapter import LoraAdapter, ModuleLora

from .conftest import Pair


@pytest.fixture(scope="module")
def flux():
    return Pair("flux")


@pytest.mark.parametrize("arch", ["sd15", "flux"])  # with CFG (batch doubled) and without
def test_per_prompt_batch_equals_each_prompt_alone(arch, sd15, flux):
    pair = sd15 if arch == "sd15" else flux
    fd, n = pair.fd, 2
    lat = pair.make_latents(6, seed=3)
    specs = ["style_a", None, {"style_a": 0.5, "locon_b": 0.5}]
    prompts = ["a cat", "a dog", "a cow"]
    batch = pair.gen(fd, prompt=prompts, fd_lora_adapters=specs, num_images_per_prompt=n, latents=lat)
    assert fd.get_active_adapters() == ["locon_b"] or fd.get_active_adapters()  # untouched by the call
    for i, (p, spec) in enumerate(zip(prompts, specs)):
        with fdlora.adapters(fd, spec or []):
            alone = pair.gen(fd, prompt=p, num_images_per_prompt=n, latents=lat[n * i: n * (i + 1)])
        assert torch.allclose(batch[n * i: n * (i + 1)], alone, atol=1e-5), f"prompt {i} ({spec})"
    with pytest.raises(errors.FdLoraError, match="one per prompt"):
        pair.gen(fd, prompt=prompts, fd_lora_adapters=["style_a"])
    with pytest.raises(errors.UnknownAdapterError, match="nope"):
        pair.gen(fd, prompt=prompts, fd_lora_adapters=["nope", None, None])


def test_request_scope_restores_and_threads_do_not_bleed(sd15):
    fd = sd15.fd
    fd.set_adapters(["style_a", "locon_b"], [0.2, 0.9])
    with fdlora.adapters(fd, {"style_a": 0.7}):
        assert fd.get_active_adapters() == ["style_a"]
        solo_a = sd15.gen(fd)
    assert fd.get_active_adapters() == ["style_a", "locon_b"]
    with fdlora.adapters(fd, "locon_b"):
        solo_b = sd15.gen(fd)
    results, errors_seen = {}, []

    def worker(name, spec):
        try:
            for _ in range(3):
                with fdlora.adapters(fd, spec):
                    out = sd15.gen(fd)
                results.setdefault(name, []).append(out)
        except Exception as e:  # pragma: no cover - reported below
            errors_seen.append(e)

    threads = [threading.Thread(target=worker, args=("a", {"style_a": 0.7})),
               threading.Thread(target=worker, args=("b", "locon_b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors_seen
    assert all(torch.equal(o, solo_a) for o in results["a"]) and all(torch.equal(o, solo_b) for o in results["b"])


def test_compiled_denoiser_never_recompiles(sd15):
    import torch._dynamo

    torch._dynamo.reset()
    pipe = copy.deepcopy(sd15.base)
    with pytest.raises(errors.CompiledModelError, match="targets"):
        frozen = copy.deepcopy(sd15.base)
        frozen.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "style_a")}, "a")
        fdlora.handle(frozen.unet).freeze()
        frozen.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "locon_b")}, "b")
    pipe.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "style_a")}, "a",
                      max_slots=3, targets=["conv1", "conv2"])
    pipe.unet = torch.compile(pipe.unet, backend="eager")
    fdlora.handle(pipe.unet._orig_mod).freeze()
    sd15.gen(pipe)
    old = torch._dynamo.config.error_on_recompile
    torch._dynamo.config.error_on_recompile = True
    try:
        outs = [sd15.gen(pipe)]
        pipe.set_adapters(["a"], [0.3])
        outs.append(sd15.gen(pipe))
        pipe.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "locon_b")}, "b")
        outs.append(sd15.gen(pipe))  # a new adapter in a free slot (its convs were wrapped by `targets`)
        pipe.set_adapters(["a", "b"], [0.5, 0.5])
        outs.append(sd15.gen(pipe))
    except torch._dynamo.exc.RecompileError as e:
        pytest.fail(f"recompiled: {e}")
    finally:
        torch._dynamo.config.error_on_recompile = old
    assert len({float(o.sum()) for o in outs}) == len(outs)


def test_unload_and_fuse_are_exact(sd15):
    pipe = copy.deepcopy(sd15.fd)
    weights = {k: v.clone() for k, v in sd15.base.unet.state_dict().items()}
    pipe.set_adapters(["style_a", "locon_b"], [0.8, 0.6])
    dynamic = sd15.gen(pipe)
    pipe.fuse_lora(lora_scale=1.0)
    assert pipe.num_fused_loras == 2
    assert float((sd15.gen(pipe) - dynamic).abs().max()) < 1e-4
    h = fdlora.handle(pipe.unet)
    pipe.unfuse_lora()
    pipe.set_adapters(["style_a", "locon_b"], [{"unet": {"down": 0.0, "up": 1.5}}, 0.6])  # block-wise weights
    blockwise = sd15.gen(pipe)
    pipe.fuse_lora()
    assert float((sd15.gen(pipe) - blockwise).abs().max()) < 1e-4
    pipe.unfuse_lora()
    pipe.set_adapters(["style_a", "locon_b"], [0.8, 0.6])
    te_weights = {k: v.clone() for k, v in sd15.base.text_encoder.state_dict().items()}
    for _ in range(1000):  # no drift: the text encoder (few layers, so it is quick) through 1000 cycles
        pipe.fuse_lora(components=["text_encoder"])
        pipe.unfuse_lora(components=["text_encoder"])
    te_sd = {k.replace(".base.", "."): v for k, v in pipe.text_encoder.state_dict().items()}
    assert all(torch.equal(te_weights[k], te_sd[k]) for k in te_weights)
    unet_sd = {k.replace(".base.", "."): v for k, v in pipe.unet.state_dict().items()}
    assert all(torch.equal(weights[k], unet_sd[k]) for k in weights), "unfuse must restore the exact bits"
    assert h.active_adapters() == ["style_a", "locon_b"]
    pipe.unload_lora_weights()
    assert type(pipe) is type(sd15.base)
    assert torch.equal(sd15.gen(pipe), sd15.gen(sd15.base))
    assert all(torch.equal(v, pipe.unet.state_dict()[k]) for k, v in weights.items())


def test_failed_load_leaves_pipe_untouched(sd15):
    pipe = copy.deepcopy(sd15.fd)
    before = {c: (h.list_adapters(), h.active_adapters(), {p: l.bank.A.clone() for p, l in h.layers.items()})
              for c, h in pipe.fd_lora_handles().items()}
    good = fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "style_a")
    path = next(iter(good.modules))
    bad_te = LoraAdapter({"encoder.layers.0.self_attn.q_proj": ModuleLora(torch.ones(4, 7), torch.ones(32, 4))})
    with pytest.raises(errors.AdapterShapeError, match="q_proj"):
        pipe.load_fd_lora({"unet": good, "text_encoder": bad_te}, "new")  # the unet part was fine
    with pytest.raises(errors.DuplicateAdapterError):
        pipe.load_fd_lora({"unet": good}, "style_a")
    after = {c: (h.list_adapters(), h.active_adapters(), {p: l.bank.A.clone() for p, l in h.layers.items()})
             for c, h in pipe.fd_lora_handles().items()}
    assert before.keys() == after.keys()
    for c in before:
        assert before[c][:2] == after[c][:2]
        assert all(torch.equal(before[c][2][p], after[c][2][p]) for p in before[c][2])
    assert path in fdlora.handle(pipe.unet).layers


def test_diffusers_lora_and_fd_lora_do_not_mix_silently(sd15):
    pipe = copy.deepcopy(sd15.ref)  # has diffusers+PEFT adapters
    with pytest.raises(errors.FdLoraError, match="from_diffusers"):
        pipe.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "style_a")}, "x")
    fd = copy.deepcopy(sd15.base)
    fd.load_fd_lora({"unet": fdlora.integrations.transformers.adapter_from_peft(sd15.ref.unet, "style_a")}, "x")
    assert fd.get_list_adapters() == {"unet": ["x"]}


def test_encode_prompt_lora_scale_matches_diffusers(sd15):
    sd15.ref.set_adapters(["style_a"])
    sd15.fd.set_adapters(["style_a"])
    kw = dict(prompt="a cat", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
    with torch.inference_mode():
        ref = sd15.ref.encode_prompt(**kw, lora_scale=0.3)[0]
        fd = sd15.fd.encode_prompt(**kw, lora_scale=0.3)[0]
        full = sd15.fd.encode_prompt(**kw)[0]
    assert float((ref - fd).abs().max()) < 1e-5
    assert float((full - fd).abs().max()) > 1e-4  # the scale applied to that call only
    assert fdlora.handle(sd15.fd.text_encoder).state.table.multiplier == 1.0


def test_more_adapters_than_slots_evict_and_come_back_from_ram(sd15, tmp_path):
    """max_slots=1 and two adapters from disk: each load evicts the other, set_adapters brings an evicted one
    back from the pool's RAM copy (the files are gone by then), outputs equal an unevicted pipe's."""
    import shutil

    dirs = {n: shutil.copytree(d, tmp_path / n) for n, d in sd15.dirs.items()}
    pipe = copy.deepcopy(sd15.base)
    pipe.load_fd_lora(str(dirs["style_a"]), "style_a", max_slots=1)
    pipe.load_fd_lora(str(dirs["locon_b"]), "locon_b")  # the only slot held the active style_a
    pools = pipe.fd_lora_pools()
    assert pools["unet"].resident() == ["locon_b"] and pipe.get_active_adapters() == ["locon_b"]
    assert pipe.get_list_adapters()["unet"] == ["style_a", "locon_b"]
    for d in dirs.values():
        shutil.rmtree(d)
    roomy = copy.deepcopy(sd15.fd)  # both adapters resident, loaded from the same weights
    for name in ("style_a", "locon_b", "style_a"):
        pipe.set_adapters([name], [0.6])
        roomy.set_adapters([name], [0.6])
        assert pools["unet"].resident() == [name]
        torch.testing.assert_close(sd15.gen(pipe), sd15.gen(roomy), rtol=0, atol=1e-6)
    assert pools["unet"].reloads >= 2 and pools["unet"].evictions >= 3
    with pytest.raises(errors.CapacityError, match="max_slots"):  # both at once need two slots
        pipe(**fdlora.fixtures.tiny_pipeline.generate_kwargs(pipe, prompt=["a", "b"]),
             fd_lora_adapters=["style_a", "locon_b"])
    out = sd15.gen(pipe, prompt=["a cat"], fd_lora_adapters=["locon_b"])  # evicts the active style_a
    assert pipe.get_active_adapters() == ["style_a"]  # the blend is back after the call
    torch.testing.assert_close(sd15.gen(pipe), sd15.gen(roomy), rtol=0, atol=1e-6)
    roomy.set_adapters(["locon_b"])
    torch.testing.assert_close(out, sd15.gen(roomy, prompt=["a cat"]), rtol=0, atol=1e-6)
    pipe.delete_adapters("style_a")
    assert pipe.get_list_adapters()["unet"] == ["locon_b"]
