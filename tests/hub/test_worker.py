"""The reader process (fdlora.hub.worker): a load read and converted there equals the same load in-process.

Oracle: `load_adapters(..., in_process=True)` on the same file: every module's tensors (bit for bit, dtype and
shape), every other module field, and the report. Failures: the load's own error comes back as itself; a reader
that dies mid-read is a clear FdLoraError and the next load starts a new one; nothing is left in the blob dir.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch
from safetensors.torch import save_file
from support.loras import diffusers_files, make_lora, peft_files

from fdlora import errors
from fdlora.hub import load_adapters, worker
from fdlora.hub.cache import span_of


def bf16(g, *shape):
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A LyCORIS file mixing LoHa, LoRA with a DoRA scale and a full diff with its bias (bf16), and a diffusers
    file with two components (fp32, fp16)."""
    d = tmp_path_factory.mktemp("reader")
    g = torch.Generator().manual_seed(0)
    mixed = {"lycoris_fc1.hada_w1_a": bf16(g, 12, 4), "lycoris_fc1.hada_w1_b": bf16(g, 4, 10),
             "lycoris_fc1.hada_w2_a": bf16(g, 12, 4), "lycoris_fc1.hada_w2_b": bf16(g, 4, 10),
             "lycoris_fc1.alpha": torch.tensor(2.0), "lycoris_fc2.lora_down.weight": bf16(g, 3, 12),
             "lycoris_fc2.lora_up.weight": bf16(g, 7, 3), "lycoris_fc2.alpha": torch.tensor(1.5),
             "lycoris_fc2.dora_scale": bf16(g, 7, 1), "lycoris_fc3.diff": bf16(g, 5, 7),
             "lycoris_fc3.diff_b": bf16(g, 5)}
    save_file(mixed, str(d / "mixed.safetensors"))
    unet = make_lora({"down.0.to_q": (24, 40), "down.0.proj": (40, 24)}, rank=5, seed=1)
    te = make_lora({"layers.0.q_proj": (16, 16)}, rank=3, seed=2, dtype=torch.float16)
    for name, data in diffusers_files({"unet": unet, "text_encoder": te}).items():
        (d / name).write_bytes(data)
    peft = d / "peft"
    peft.mkdir()
    for name, data in peft_files(make_lora({"layers.0.q_proj": (16, 24), "layers.0.o_proj": (24, 16)}, rank=4,
                                           seed=3, dtype=torch.bfloat16)).items():
        (peft / name).write_bytes(data)
    return {"mixed": str(d / "mixed.safetensors"), "diffusers": str(d / "pytorch_lora_weights.safetensors"),
            "peft": str(peft)}


def without_seconds(report):
    return dataclasses.replace(report, seconds={})


@pytest.mark.parametrize("which", ["mixed", "diffusers"])
def test_reader_process_equals_in_process(files, which):
    here, rep_here = load_adapters(files[which], cache=None, name="a")
    there, rep_there = load_adapters(files[which], cache=None, name="a", in_process=False)
    assert without_seconds(rep_there) == without_seconds(rep_here)
    assert rep_there.groups == rep_here.groups
    assert here.keys() == there.keys()
    for comp in here:
        a, b = here[comp], there[comp]
        assert (a.use_rslora, a.name, a.provenance) == (b.use_rslora, b.name, b.provenance)
        assert a.modules.keys() == b.modules.keys()
        for path, m in a.modules.items():
            n = b.modules[path]
            for f in worker.TENSOR_FIELDS:
                x, y = getattr(m, f), getattr(n, f)
                assert (x is None) == (y is None), (path, f)
                if x is not None:
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (path, f)
            assert {k: v for k, v in vars(m).items() if k not in worker.TENSOR_FIELDS} == \
                   {k: v for k, v in vars(n).items() if k not in worker.TENSOR_FIELDS}, path
    tensors = [t for a in there.values() for m in a.modules.values()
               for t in (getattr(m, f) for f in worker.TENSOR_FIELDS) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer: one device transfer later
    for a in there.values():  # each component's span (given, not searched) holds all its bytes
        start, lo, hi = span_of(a)
        assert start == tensors[0].untyped_storage().data_ptr()
        assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for m in a.modules.values()
                   for t in (getattr(m, f) for f in worker.TENSOR_FIELDS) if t is not None)
    assert not glob.glob(os.path.join(worker._blob_dir(), f"fdlora-read-{os.getpid()}-*"))


def test_any_result_comes_back_with_its_loose_tensors(files):
    """A result that is not adapters (a Transformers prefetch's read: LoraConfig, PEFT's state dict, provenance)
    comes back equal, its tensors in one buffer, in the dict's own order."""
    from fdlora.pipelines.transformers.read import read_peft

    config, tensors, prov = read_peft(files["peft"])
    config2, tensors2, prov2 = worker.run(read_peft, files["peft"], page_locked=False)
    assert (config2.to_dict(), prov2) == (config.to_dict(), prov)
    assert list(tensors2) == list(tensors)
    assert all(t.dtype == tensors[k].dtype and torch.equal(t, tensors[k]) for k, t in tensors2.items())
    assert len({t.untyped_storage().data_ptr() for t in tensors2.values()}) == 1


def test_the_loads_own_error_comes_back_as_itself(files, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(open(files["diffusers"], "rb").read()[:-100])
    with pytest.raises(errors.UnsafeFileError) as here:
        load_adapters(str(cut), cache=None)
    with pytest.raises(errors.UnsafeFileError) as there:
        load_adapters(str(cut), cache=None, in_process=False)
    assert str(there.value) == str(here.value)
    assert not glob.glob(os.path.join(worker._blob_dir(), f"fdlora-read-{os.getpid()}-*"))


class _Exit:
    """A request whose unpickling ends the reader process (a crash in the middle of a read)."""

    def __reduce__(self):
        return os._exit, (7,)


def test_a_reader_that_dies_is_an_error_and_the_next_load_starts_another(files):
    load_adapters(files["diffusers"], cache=None, in_process=False)  # a reader is running and idle
    w = worker._take()
    with pytest.raises(errors.FdLoraError, match="reader process ended while reading .exit code 7.*Load again"):
        w.call({"boom": _Exit()})
    w.close()
    adapters, _ = load_adapters(files["diffusers"], cache=None, in_process=False)
    assert set(adapters) == {"unet", "text_encoder"}
    for w in list(worker._idle):  # an idle reader killed from outside is skipped, not used
        w.proc.kill()
        w.proc.wait()
    adapters, _ = load_adapters(files["diffusers"], cache=None, in_process=False)
    assert set(adapters) == {"unet", "text_encoder"}
    assert all(w.proc.poll() is None for w in worker._idle)
