"""A failure stays with the requests that cause it (fdlora.serve.engine.Engine.run_each): an adapter file corrupted
after start-up fails only the requests naming it; a batch out of device memory is run again one request at a time
and only a request that does not fit alone fails, with a 507 naming the limit."""

from __future__ import annotations

import weakref

import pytest
import torch
from support import serving

from fdlora.config import validate
from fdlora.fixtures import tiny_pipeline as tiny
from fdlora.serve import ImageRequest, RequestError
from fdlora.serve.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pipe, root = tiny.sd15(), tmp_path_factory.mktemp("adapters")
    for i in range(3):
        (f,) = tiny.random_lora_files(pipe, seed=70 + i).values()
        (root / f"f{i}.safetensors").write_bytes(f)
    cfg = validate({"pipeline": "tiny-sd15", "device": "cpu", "steps": 2, "size": 64,
                    "adapters": [{"name": f"f{i}", "source": str(root / f"f{i}.safetensors")} for i in range(3)],
                    "serve": {"adapters_per_replica": 3, "max_steps": 4, "max_size": 128}})
    eng = Engine(cfg, pipe)
    eng.root = root
    return eng


def R(adapters, seed=0, size=64):
    return ImageRequest("a cat", adapters, None, seed, 2, size, size)


def test_a_corrupt_adapter_fails_only_its_requests(engine):
    alone = [engine.run([r])[0] for r in (R({"f0": 1.0}, 1), R({}, 2))]
    (engine.root / "f2.safetensors").write_bytes(b"\0" * 64)  # never loaded yet: the server meets it on use
    failed = engine.failed_loads
    out = engine.run_each([R({"f0": 1.0}, 1), R({"f2": 1.0}, 3), R({}, 2), R({"f0": 0.5, "f2": 0.5}, 4)])
    assert [type(o).__name__ for o in out] == ["bytes", "RequestError", "bytes", "RequestError"]
    assert out[1].status == 500 and "'f2' failed to load" in str(out[1]) and "\n" not in str(out[1])
    assert str(engine.root) not in str(out[1])  # nothing about the server's files
    assert engine.failed_loads == failed + 1
    for got, ref in zip((out[0], out[2]), alone):
        assert abs(serving.decode_png(got) - serving.decode_png(ref)).max() <= 1
    with pytest.raises(RequestError):
        engine.run([R({"f2": 1.0})])


@pytest.fixture
def memory_limit(engine):
    """The UNet refuses inputs past one 64x64 prompt with CFG, as a device would past its memory."""
    side = 64 // engine.pipe.vae_scale_factor

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["sample"]
        if x.shape[0] * x.shape[2] * x.shape[3] > 2 * side * side:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = engine.pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    yield
    handle.remove()


def test_out_of_memory_reruns_the_batch_one_by_one(engine, memory_limit):
    reqs = [R({"f0": 1.0}, 1), R({"f1": 0.7}, 5), R({"f0": 0.4, "f1": 0.6}, 6), R({"f1": 1.0}, 7, size=96)]
    retries = engine.oom_retries
    out = engine.run_each(reqs)
    assert engine.oom_retries == retries + 1  # the three 64x64 ones together; the 96x96 one is its own call
    assert all(isinstance(o, bytes) for o in out[:3])
    assert isinstance(out[3], RequestError) and out[3].status == 507
    assert "out of device memory" in str(out[3]) and "device memory this server may use" in str(out[3])
    for got, r in zip(out[:3], reqs):
        assert abs(serving.decode_png(got) - serving.decode_png(engine.run([r])[0])).max() <= 1


def test_the_failed_calls_tensors_are_freed_before_its_requests_run_again(engine):
    """What the failed batch held when it ran out of memory (its activations, referenced from the frames of the
    exception's traceback) is gone before each request runs again alone: on a device the requests run again would
    otherwise run out of memory too, behind the failed call's memory."""
    reqs = [R({"f0": 1.0}, 31), R({"f1": 0.7}, 32), R({}, 33)]
    alone = [engine.run([r])[0] for r in reqs]
    held: list[weakref.ref] = []

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["sample"]
        if any(ref() is not None for ref in held):
            raise torch.OutOfMemoryError("CUDA out of memory (injected: the failed call's activations are held)")
        if x.shape[0] > 2:  # the batch: its activations stay referenced from this frame as it fails
            activations = torch.empty(1 << 10)
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = engine.pipe.unet.register_forward_pre_hook(hook, with_kwargs=True)
    retries = engine.oom_retries
    try:
        out = engine.run_each(reqs)
    finally:
        handle.remove()
    assert held and engine.oom_retries == retries + 1
    assert all(isinstance(o, bytes) for o in out), out
    for got, ref in zip(out, alone):
        assert abs(serving.decode_png(got) - serving.decode_png(ref)).max() <= 1


def test_a_call_that_fails_midway_leaves_the_pipeline_as_it_was(engine):
    """Out of memory while decoding, after the pipeline recast its VAE for the call (diffusers upcasts an fp16 SDXL
    VAE and casts it back only when decoding returns): the VAE goes back to its dtype, the batch is run again one by
    one, and every image equals the same request run alone."""
    reqs = [R({"f0": 1.0}, 11), R({"f1": 0.7}, 12)]
    alone = [engine.run([r])[0] for r in reqs]
    vae = engine.pipe.vae

    def hook(module, args):
        if args[0].shape[0] > 1:
            vae.to(torch.float64)  # recast for the call, as upcast_vae does
            raise torch.OutOfMemoryError("CUDA out of memory (injected, while decoding)")

    handle = vae.decoder.register_forward_pre_hook(hook)
    try:
        out = engine.run_each(reqs)
    finally:
        handle.remove()
    assert {p.dtype for p in vae.parameters()} == {torch.float32}
    assert all(isinstance(o, bytes) for o in out), out
    for got, ref in zip(out, alone):
        assert abs(serving.decode_png(got) - serving.decode_png(ref)).max() <= 1


def test_an_error_inside_the_pipeline_fails_only_its_request(engine):
    """A request whose call raises (here: its prompt) gets a one-line 500; the others of its batch are served."""
    reqs = [R({"f0": 1.0}, 21), R({"f1": 0.5}, 22), R({}, 23)]
    alone = [engine.run([r])[0] for r in (reqs[0], reqs[2])]
    bad = ImageRequest("boom", {"f1": 0.5}, None, 22, 2, 64, 64)
    real = engine.pipe.encode_prompt

    def encode_prompt(prompt, *a, **k):
        if "boom" in (prompt if isinstance(prompt, list) else [prompt]):
            raise ValueError("a prompt this pipeline cannot encode")
        return real(prompt, *a, **k)

    engine.pipe.encode_prompt = encode_prompt
    try:
        out = engine.run_each([reqs[0], bad, reqs[2]])
    finally:
        del engine.pipe.encode_prompt
    assert isinstance(out[1], RequestError) and out[1].status == 500 and "\n" not in str(out[1])
    for got, ref in zip((out[0], out[2]), alone):
        assert isinstance(got, bytes) and abs(serving.decode_png(got) - serving.decode_png(ref)).max() <= 1


def test_out_of_memory_with_merged_copies_drops_them_and_runs_the_request_again(engine, monkeypatch):
    """A request alone that runs out of memory while merged-weight copies hold device memory is not failed: the
    copies go, their budget halves, and the request runs again (a 507 only once no copy is left to drop)."""
    from fdlora.layers.fastpath import merged

    held = {"bytes": 6 * 2**30}
    limits = []
    monkeypatch.setattr(merged, "merge_cache_bytes", lambda device=None: held["bytes"])

    def set_merge_cache(limit):
        limits.append(limit)
        held["bytes"] = 0

    monkeypatch.setattr(merged, "set_merge_cache", set_merge_cache)
    real, calls = engine._call, []

    def call(reqs):
        calls.append(len(reqs))
        if held["bytes"]:
            raise torch.OutOfMemoryError("CUDA out of memory (injected: the copies took the room)")
        return real(reqs)

    monkeypatch.setattr(engine, "_call", call)
    req = R({"f0": 1.0}, 21)
    (out,) = engine.run_each([req])
    assert isinstance(out, bytes) and calls == [1, 1] and limits == [3 * 2**30]
    monkeypatch.setattr(engine, "_call", real)
    assert abs(serving.decode_png(out) - serving.decode_png(engine.run([req])[0])).max() <= 1
    held["bytes"], calls[:] = 0, []  # nothing to drop: the request alone is too large

    def too_large(reqs):
        calls.append(len(reqs))
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(engine, "_call", too_large)
    (out,) = engine.run_each([req])
    assert isinstance(out, RequestError) and out.status == 507 and calls == [1]
