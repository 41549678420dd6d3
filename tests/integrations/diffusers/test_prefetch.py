"""pipe.prefetch_fd_lora: a background load equals load_fd_lora, publishes only between calls, fails cleanly.

Oracles: the same adapter loaded by `load_fd_lora` (outputs compared exactly), and the pipeline's own state
before the prefetch (banks, names, active set, outputs bit-identical after a failed or cancelled one).
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch
from safetensors.torch import load_file, save_file

import fdlora
from fdlora import errors
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.integrations import prefetch as prefetching
from fdlora.integrations.transformers import adapter_from_peft
from fdlora.layers import match_targets
from fdlora.runtime import background
from fdlora.runtime.scope import lock_of

from .conftest import ATTN, Pair

WAIT = 60  # seconds: generous bounds for a busy 2-core CI box; nothing here sleeps that long when it works


@pytest.fixture(scope="module")
def sd15():
    return Pair("sd15")


def gen(pair: Pair, pipe, **kw) -> torch.Tensor:
    """One denoising step at 16x16 latents: the cheapest call that runs every LoRA layer (~2 s on a busy CPU)."""
    n = len(kw["prompt"]) if isinstance(kw.get("prompt"), list) else 1
    latents = torch.randn(n, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    return pair.gen(pipe, latents=latents, size=32, num_inference_steps=1, **kw)


def snapshot(pipe) -> dict:
    """Everything a load can change: names, active sets, every bank, the scale tables."""
    out = {}
    for c, h in pipe.fd_lora_handles().items():
        out[c] = (h.list_adapters(), dict(h.state.active), sorted(fdlora.AdapterPool.of(h).known()),
                  {p: (l.bank.A.clone(), l.bank.B.clone(), l.bank.ranks.clone()) for p, l in h.layers.items()},
                  h.state.table.host().clone())
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for c in a:
        assert a[c][:3] == b[c][:3], c
        assert a[c][3].keys() == b[c][3].keys()
        for p in a[c][3]:
            assert all(torch.equal(x, y) for x, y in zip(a[c][3][p], b[c][3][p])), (c, p)
        assert torch.equal(a[c][4], b[c][4])


def scaled(adapter: LoraAdapter, k: float) -> LoraAdapter:
    return LoraAdapter({p: m.replace(m.A, m.B * k, m.bias) for p, m in adapter.modules.items()}, adapter.use_rslora)


def gated(pipe, gate: threading.Event):
    """Make the pipe's read step wait for `gate` (a slow download, under the test's control)."""
    read = pipe._fd_read

    def slow(*a, **kw):
        assert gate.wait(WAIT)
        return read(*a, **kw)

    pipe._fd_read = slow
    return pipe


def test_prefetch_then_use_equals_load_then_use(sd15):
    """From the diffusers files on disk, into a fresh pipe and into one already serving: same banks, same images
    (blend and per prompt); the prefetch leaves the active set alone."""
    loaded, fetched = copy.deepcopy(sd15.base), copy.deepcopy(sd15.base)
    for name in ("style_a", "locon_b"):
        loaded.load_fd_lora(sd15.dirs[name], name)
    job = fetched.prefetch_fd_lora(sd15.dirs["style_a"], adapter_name="style_a")
    assert job.result(WAIT) is not None and job.done() and job.stage == "done"  # the load report
    assert fetched.get_active_adapters() == []  # not activated: a fresh pipe still serves the base model
    fetched.set_adapters(["style_a"], [0.6])
    job = fetched.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="locon_b")
    job.result(WAIT)
    assert fetched.get_active_adapters() == ["style_a"]
    for pipe in (loaded, fetched):
        pipe.set_adapters(["style_a", "locon_b"], [0.7, 0.4])
    assert_same(snapshot(fetched), snapshot(loaded))  # every bank, name, active set and scale table
    assert torch.equal(gen(sd15, fetched), gen(sd15, loaded))
    per_prompt = dict(prompt=["a cat", "a dog"], fd_lora_adapters=["locon_b", "style_a"])
    assert torch.equal(gen(sd15, fetched, **per_prompt), gen(sd15, loaded, **per_prompt))
    assert fetched.get_list_adapters() == loaded.get_list_adapters()


def test_the_read_step_runs_the_same_python_whatever_the_adapter_size(sd15, tmp_path, monkeypatch):
    """With the reader process, a prefetch's thread makes the same number of Python and C calls before publication
    (resolve, the reader's answer, the copy and the finite check over one block) for 4 modules as for every
    attention projection of the UNet: everything per tensor or per module waits for publication, when no step
    runs. (A busy Python thread made an H100 host's steps 300x slower.)"""
    from support.loras import diffusers_files, make_lora

    unet = sd15.base.unet
    paths = match_targets(unet, ATTN)
    dirs = {}
    for n, chosen in (("small", paths[:4]), ("big", paths)):
        shapes = {p: (unet.get_submodule(p).in_features, unet.get_submodule(p).out_features) for p in chosen}
        (tmp_path / n).mkdir()
        for name, data in diffusers_files({"unet": make_lora(shapes, rank=4, seed=len(chosen))}).items():
            (tmp_path / n / name).write_bytes(data)
        dirs[n] = str(tmp_path / n)
    calls: dict[str, list[int]] = {}
    step = background.Prefetch._step

    def counting(job, stage):  # count on the job's thread from "reading" until its next stage
        sys.setprofile(None)
        step(job, stage)
        if stage == "reading":
            count = calls.setdefault(job.name, [0])

            def prof(frame, event, arg):
                if event in ("call", "c_call"):
                    count[0] += 1

            sys.setprofile(prof)

    monkeypatch.setattr(background.Prefetch, "_step", counting)
    pipe = copy.deepcopy(sd15.fd)
    pipe.prefetch_fd_lora(dirs["small"], "warm", cache=None).result(WAIT)  # (a reader process runs from here on)
    for n in ("small", "big"):
        pipe.prefetch_fd_lora(dirs[n], n, cache=None).result(WAIT)
    assert len(paths) >= 40 and abs(calls["big"][0] - calls["small"][0]) <= 0.05 * calls["small"][0], calls
    ref = copy.deepcopy(sd15.fd)
    ref.load_fd_lora(dirs["big"], "big")
    for p in (pipe, ref):
        p.set_adapters(["style_a", "big"], [0.5, 0.8])
    assert torch.equal(gen(sd15, pipe), gen(sd15, ref))


def test_a_prefetch_runs_in_its_callers_inference_mode(sd15):
    """A pipe first loaded under torch.inference_mode holds inference tensors (its scale tables), which only code
    under inference_mode may write: a prefetch started there publishes on its own thread in the same mode."""
    pipe = copy.deepcopy(sd15.base)
    with torch.inference_mode():
        pipe.load_fd_lora(sd15.dirs["style_a"], "style_a")
        pipe.prefetch_fd_lora(sd15.dirs["locon_b"], "locon_b").result(WAIT)
    assert sorted(pipe.get_list_adapters()["unet"]) == ["locon_b", "style_a"]


def test_read_runs_off_the_lock_and_publication_waits_for_calls(sd15):
    """While a call holds the pipeline's lock, the prefetch reads and converts (it gets as far as waiting for the
    pipeline) but publishes nothing; the name appears only after the lock is released."""
    pipe = copy.deepcopy(sd15.fd)
    before = snapshot(pipe)
    with lock_of(pipe):  # a generation in flight holds exactly this lock
        job = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="fresh")
        deadline = time.monotonic() + WAIT
        while job.stage != "waiting for the pipeline" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.stage == "waiting for the pipeline" and not job.done()
        assert job.seconds["reading"] > 0
        assert_same(snapshot(pipe), before)
        with pytest.raises(errors.UnknownAdapterError, match=r"prefetched.*\.result\(\)"):
            pipe.set_adapters(["fresh"])  # (re-entrant: this thread holds the lock)
        with pytest.raises(errors.UnknownAdapterError, match=r"prefetched.*\.result\(\)"):
            gen(sd15, pipe, prompt=["a cat"], fd_lora_adapters=["fresh"])
    job.result(WAIT)
    assert "fresh" in pipe.get_list_adapters()["unet"]
    ref = copy.deepcopy(sd15.fd)
    ref.load_fd_lora(sd15.dirs["locon_b"], "fresh")
    for p in (pipe, ref):
        p.set_adapters(["style_a", "fresh"], [0.5, 0.8])
    assert_same(snapshot(pipe), snapshot(ref))


def test_calls_in_another_thread_see_before_or_after_never_a_mix(sd15):
    """A serving thread generates back to back while a prefetch completes. Each call takes the pipeline's lock,
    uses the new adapter if it is published by then, and its output must equal exactly the state before
    (style_a alone) or after (style_a + the new one, as load_fd_lora makes it); never the half-loaded state
    (the new adapter on half of its modules)."""
    pipe = gated(copy.deepcopy(sd15.fd), gate := threading.Event())
    unet_b = adapter_from_peft(sd15.ref.unet, "locon_b")
    full = {"unet": unet_b, "text_encoder": adapter_from_peft(sd15.ref.text_encoder, "locon_b")}
    half = {"unet": LoraAdapter(dict(list(unet_b.modules.items())[: len(unet_b.modules) // 2]))}
    states = {}
    for key, adapters in (("after", full), ("half", half)):
        ref = copy.deepcopy(sd15.fd)
        ref.load_fd_lora(adapters, "new")
        ref.set_adapters(["style_a", "new"], [0.7, 0.9])
        states[key] = gen(sd15, ref)
    pipe.set_adapters(["style_a"], [0.7])
    states["before"] = gen(sd15, pipe)
    assert not torch.equal(states["half"], states["after"]) and not torch.equal(states["half"], states["before"])

    outputs, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            with lock_of(pipe):
                ready = "new" in pipe._fd_all_names()
                pipe.set_adapters(["style_a", "new"] if ready else ["style_a"], [0.7, 0.9] if ready else [0.7])
                outputs.append((ready, gen(sd15, pipe)))
            if len(outputs) == 1:
                gate.set()  # the download "finishes" while calls keep coming

    server = threading.Thread(target=serve)
    server.start()
    try:
        job = pipe.prefetch_fd_lora(full, adapter_name="new")
        job.result(WAIT)
        deadline = time.monotonic() + WAIT
        while not any(ready for ready, _ in outputs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
        stop.set()
        server.join(WAIT)
    assert any(not r for r, _ in outputs) and any(r for r, _ in outputs)
    for ready, out in outputs:
        assert not torch.equal(out, states["half"])
        assert torch.equal(out, states["after" if ready else "before"]), ready


def test_a_bad_source_raises_on_result_and_leaves_the_pipe_bit_identical(sd15, tmp_path):
    pipe = copy.deepcopy(sd15.fd)
    pipe.set_adapters(["style_a"], [0.8])
    before, image = snapshot(pipe), gen(sd15, pipe)
    good = adapter_from_peft(sd15.ref.unet, "style_a")
    bad_te = LoraAdapter({"encoder.layers.0.self_attn.q_proj": ModuleLora(torch.ones(4, 7), torch.ones(32, 4))})
    nan = scaled(good, float("nan"))
    nan_file = tmp_path / "nan" / "pytorch_lora_weights.safetensors"  # read in the reader process, checked here
    nan_file.parent.mkdir()
    tensors = load_file(f"{sd15.dirs['style_a']}/pytorch_lora_weights.safetensors")
    key = sorted(k for k in tensors if k.startswith("unet.") and "lora_B" in k)[-1]
    tensors[key][0, 0] = float("inf")
    save_file(tensors, str(nan_file))
    cases = [({"unet": good, "text_encoder": bad_te}, errors.AdapterShapeError),  # the unet part alone was fine
             ({"unet": nan}, errors.FdLoraError),  # NaN weights (validate=True)
             (str(nan_file.parent), errors.NonFiniteError),  # an Inf in a file
             (str(tmp_path / "no-such-lora.safetensors"), Exception),  # resolve fails
             ({"unet": good}, errors.DuplicateAdapterError)]  # name taken ("style_a")
    for source, kind in cases:
        name = "style_a" if kind is errors.DuplicateAdapterError else "new"
        job = pipe.prefetch_fd_lora(source, adapter_name=name)
        with pytest.raises(kind) as got:
            job.result(WAIT)
        with pytest.raises(type(got.value)) as direct:  # the error load_fd_lora itself raises
            copy.deepcopy(pipe).load_fd_lora(source, name)
        assert str(got.value) == str(direct.value)
        assert job.stage == "failed" and isinstance(job.exception(), kind)
        assert_same(snapshot(pipe), before)
    assert torch.equal(gen(sd15, pipe), image)


def test_delete_or_cancel_during_prefetch(sd15):
    """delete_adapters of a name still being prefetched cancels it (never published later); cancel() likewise;
    deleting another adapter meanwhile works; cancel after publication is refused and the adapter stays."""
    pipe = gated(copy.deepcopy(sd15.fd), gate := threading.Event())
    pipe.set_adapters(["style_a"])
    before = snapshot(pipe)
    a = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="x")
    b = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="y")
    again = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="y")
    with pytest.raises(errors.DuplicateAdapterError, match="being prefetched"):
        again.result(WAIT)
    assert sorted(prefetching.pending(pipe)) == ["x", "y"]
    pipe.delete_adapters("x")  # cancels the prefetch
    assert b.cancel() and b.cancelled()
    gate.set()
    for job in (a, b):
        with pytest.raises(CancelledError):
            job.result(WAIT)
        assert job.stage == "cancelled"
    assert_same(snapshot(pipe), before)
    assert prefetching.pending(pipe) == {}
    with pytest.raises(errors.UnknownAdapterError):
        pipe.delete_adapters("x")  # nothing left under that name

    c = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="z")
    pipe.delete_adapters("style_a")  # another adapter, while z is in flight
    c.result(WAIT)
    assert not c.cancel() and not c.cancelled()
    assert sorted(pipe.get_list_adapters()["unet"]) == ["locon_b", "z"]
    pipe.delete_adapters("z")
    assert pipe.get_list_adapters()["unet"] == ["locon_b"]


def test_unload_cancels_pending_prefetches(sd15):
    """unload_lora_weights while a prefetch reads: the prefetch is cancelled, nothing comes back afterwards."""
    pipe = gated(copy.deepcopy(sd15.fd), gate := threading.Event())
    job = pipe.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="late")
    pipe.unload_lora_weights()
    gate.set()
    with pytest.raises(CancelledError):
        job.result(WAIT)
    assert type(pipe) is type(sd15.base) and not any(n.endswith(".base") for n, _ in pipe.unet.named_modules())


def test_prefetches_into_a_full_pool_evict_like_loads(sd15):
    """Two slots, style_a active: every prefetch evicts the least recently used *inactive* adapter (into RAM),
    never the active one; several in flight at once all land; each one then serves exactly what a pipe with
    room for all of them serves. With every slot active, the prefetch fails with CapacityError and changes
    nothing."""
    base_unet = adapter_from_peft(sd15.ref.unet, "locon_b")
    extra = {f"k{i}": {"unet": scaled(base_unet, 0.5 + i)} for i in range(3)}
    pipe = copy.deepcopy(sd15.base)
    pipe.load_fd_lora(sd15.dirs["style_a"], "style_a", max_slots=2)
    roomy = copy.deepcopy(sd15.base)
    roomy.load_fd_lora(sd15.dirs["style_a"], "style_a", max_slots=8)
    for n, a in extra.items():
        roomy.load_fd_lora(a, n)
    pool = pipe.fd_lora_pools()["unet"]
    pipe.prefetch_fd_lora(extra["k0"], "k0").result(WAIT)
    assert pool.resident() == ["style_a", "k0"]
    pipe.prefetch_fd_lora(extra["k1"], "k1").result(WAIT)
    assert pool.resident() == ["style_a", "k1"] and pool.evictions == 1  # k0 out to RAM, style_a stays (active)
    jobs = [pipe.prefetch_fd_lora(extra["k2"], "k2"), pipe.prefetch_fd_lora(sd15.dirs["locon_b"], "locon_b")]
    for job in jobs:
        job.result(WAIT)
    assert pipe.get_active_adapters() == ["style_a"] and len(pool.resident()) == 2
    assert sorted(pipe.get_list_adapters()["unet"]) == ["k0", "k1", "k2", "locon_b", "style_a"]
    roomy.load_fd_lora(sd15.dirs["locon_b"], "locon_b")
    for name in ["k0", "k2", "locon_b"]:  # k0 comes back from RAM
        pipe.set_adapters([name], [0.9])
        roomy.set_adapters([name], [0.9])
        assert torch.equal(gen(sd15, pipe), gen(sd15, roomy)), name

    pipe.set_adapters(["style_a", "k0"])  # both slots active
    before = snapshot(pipe)
    job = pipe.prefetch_fd_lora({"unet": scaled(base_unet, 7.0)}, "k9")
    with pytest.raises(errors.CapacityError, match="max_slots"):
        job.result(WAIT)
    assert_same(snapshot(pipe), before)


def test_model_level_prefetch_on_a_diffusers_model(sd15):
    """fdlora.integrations.prefetch.prefetch(unet, ...) is fdlora.load_fd_lora(unet, ...) in the background."""
    x = adapter_from_peft(sd15.ref.unet, "locon_b")
    loaded, fetched = copy.deepcopy(sd15.base.unet), copy.deepcopy(sd15.base.unet)
    fdlora.load_fd_lora(loaded, x, "b")
    prefetching.prefetch(fetched, x, "b").result(WAIT)
    assert fdlora.active_adapters(fetched) == []
    fdlora.set_adapters(fetched, ["b"])
    sample = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(1, 77, sd15.base.unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = loaded(sample, 10, hidden).sample
        got = fetched(sample, 10, hidden).sample
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_on_cuda_stages_on_a_side_stream_and_equals_load(sd15):
    """On CUDA the adapter reaches the device on the side stream before publication; the banks and the images
    equal load_fd_lora's exactly."""
    loaded, fetched = copy.deepcopy(sd15.fd).to("cuda"), copy.deepcopy(sd15.fd).to("cuda")
    loaded.load_fd_lora(sd15.dirs["locon_b"], "new")
    job = fetched.prefetch_fd_lora(sd15.dirs["locon_b"], adapter_name="new")
    job.result(WAIT)
    assert job.seconds.get("reading", 0) > 0 and background._streams  # the side stream was used
    for pipe in (loaded, fetched):
        pipe.set_adapters(["style_a", "new"], [0.5, 1.0])
    a, b = snapshot(loaded), snapshot(fetched)
    assert_same(a, b)
    kw = dict(latents=sd15.latents.cuda())
    with torch.inference_mode():
        from fdlora.fixtures import tiny_pipeline as tiny

        outs = [p(**tiny.generate_kwargs(p, **kw)).images for p in (loaded, fetched)]
    assert torch.equal(outs[0], outs[1])
