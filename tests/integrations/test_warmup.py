"""fdlora.integrations.warmup: a no-op that says so on CPU, a clear error without fd-lora layers, and on CUDA the
kernels built with the model's state unchanged (GPU test: skipped here without CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fdlora
from fdlora import errors
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.integrations.warmup import warmup


def model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32), nn.Linear(32, 32)).to(device, dtype).eval()


def adapter(m: nn.Module, seed: int = 0) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoraAdapter({n: ModuleLora(torch.randn(8, l.in_features, generator=g), torch.randn(l.out_features, 8,
                                                                                               generator=g))
                        for n, l in m.named_children() if isinstance(l, nn.Linear)})


def test_cpu_warmup_is_a_no_op_that_says_so():
    m = model()
    assert "compiles no kernels" in str(warmup(m))  # before the first load too
    with pytest.raises(errors.FdLoraError, match="neither a pipeline nor a model"):
        warmup(object())
    fdlora.add_adapter(m, adapter(m), "a")
    x = torch.randn(3, 32)
    before = m(x)
    report = warmup(m)
    assert report.calls == 0 and "compiles no kernels" in str(report) and report.device == "cpu"
    assert torch.equal(m(x), before) and fdlora.active_adapters(m) == ["a"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_warmup_runs_every_shape_and_leaves_the_state_as_it_was():
    m = model("cuda", torch.float16)
    assert "bank writer" in str(warmup(m))  # before the first load
    a, b = adapter(m).to(torch.float16), adapter(m, 1).to(torch.float16)  # (both before the layers are wrapped)
    fdlora.add_adapter(m, a, "a")
    fdlora.add_adapter(m, b, "b", activate=False)
    fdlora.set_adapters(m, ["b"], [0.3])
    x = torch.randn(2, 5, 32, device="cuda", dtype=torch.float16)
    before = m(x)
    report = warmup(m, tokens=(1, 64))
    assert report.shapes == 3 and report.calls == 3 * 2 * 2 and report.seconds > 0
    assert fdlora.handle(m).state.active == {"b": 0.3}
    assert torch.equal(m(x), before)
