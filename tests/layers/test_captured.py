"""Captured steps (fdlora.layers.fastpath.captured): a module's forward replayed from CUDA graphs keyed by input signature.

On CPU the capture mechanism is a stand-in with a real graph's semantics where they matter: replays read the static
input buffers and write the static outputs in place, and a replay is refused when fd-lora's call mode (the host
branch every layer took) differs from the one captured. The GPU tests capture real CUDA graphs and compare with
eager calls on the same weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import fdlora
from fdlora.errors import FdLoraError
from fdlora.hub.adapter import LoraAdapter, ModuleLora
from fdlora.layers.fastpath import captured


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x, scale=1.0, extra=None):
        h = torch.relu(self.a(x)) * scale
        if extra is not None:
            h = h + extra["shift"]
        return {"out": self.c(self.b(h)), "aux": (h.sum(),)}


def adapter(seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    net = Net()
    return LoraAdapter({p: ModuleLora(torch.randn(4, m.in_features, generator=g) * 0.3,
                                      torch.randn(m.out_features, 4, generator=g) * 0.3)
                        for p, m in net.named_modules() if isinstance(m, nn.Linear)})


class StandIn:
    """Capture = two warm-ups and a recorded call; replay = the recorded call again over the same static buffers,
    its outputs copied into the captured ones. A replay whose fd-lora mode differs from the captured one fails: a
    real graph would replay the other mode's launches."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @staticmethod
    def capturing(t) -> bool:
        return False

    def capture(self, run):
        run()
        run()
        out = run()
        return (run, out, captured._mode_key(self.module)), out

    def replay(self, graph) -> None:
        run, out, mode = graph
        assert captured._mode_key(self.module) == mode, "replayed a graph captured in another fd-lora mode"
        for dst, src in zip(pytree.tree_leaves(out), pytree.tree_leaves(run())):
            dst.copy_(src)


@pytest.fixture
def net():
    torch.manual_seed(0)
    m = Net().eval()
    fdlora.add_adapter(m, adapter(1), "a")
    fdlora.add_adapter(m, adapter(2), "b")
    fdlora.set_adapters(m, ["a"], [1.0])
    return m


def eager(m, *args, **kwargs):
    runner = captured.steps_of(m)
    return (runner.eager if runner else m)(*args, **kwargs)


def same(got, want) -> None:
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_replays_read_new_inputs_and_new_shapes_capture_once(net):
    runner = fdlora.capture_steps(net, mechanism=StandIn(net))
    x1, x2, x3 = torch.randn(3, 8), torch.randn(3, 8), torch.randn(5, 8)
    same(net(x1), eager(net, x1))
    same(net(x2), eager(net, x2))  # same signature: the inputs are copied into the captured buffers
    assert runner.captures == 1
    same(net(x3), eager(net, x3))
    kw = dict(scale=0.5, extra={"shift": torch.ones(16)})
    same(net(x1, **kw), eager(net, x1, **kw))
    assert runner.captures == 3  # new shape, then new non-tensor arguments and structure
    same(net(x1), eager(net, x1))
    assert runner.captures == 3 and runner.replays == 5


@torch.no_grad()
def test_switches_and_slider_moves_apply_on_replay_without_recapture(net):
    runner = fdlora.capture_steps(net, mechanism=StandIn(net))
    x = torch.randn(4, 8)
    net(x)
    outs = []
    for names, ws in ((["a"], [0.3]), (["a", "b"], [0.7, -0.4]), (["b"], [1.0]), (["a"], [0.3])):
        fdlora.set_adapters(net, names, ws)
        y = net(x)
        same(y, eager(net, x))
        outs.append(y["out"])
    assert runner.captures == 1
    assert (outs[0] - outs[1]).abs().max() > 1e-2  # the switches change the output
    same(outs[0], outs[3])


@torch.no_grad()
def test_per_sample_calls_capture_their_own_mode(net):
    runner = fdlora.capture_steps(net, mechanism=StandIn(net))
    x = torch.randn(2, 3, 8)
    net(x)
    with fdlora.per_sample(net, ["a", "b"]):
        y = net(x)
        same(y, eager(net, x))
    with fdlora.per_sample(net, ["b", None]):  # same layout: the group weights are rewritten in place
        same(net(x), eager(net, x))
    assert runner.captures == 2
    same(net(x), eager(net, x))  # blend mode again: its first graph
    assert runner.captures == 2


@torch.no_grad()
def test_outputs_are_clones_unless_asked(net):
    fdlora.capture_steps(net, mechanism=StandIn(net))
    x = torch.randn(2, 8)
    y1 = net(x)["out"]
    keep = y1.clone()
    net(torch.randn(2, 8))
    same(y1, keep)  # the next replay did not overwrite it
    fdlora.release_steps(net)
    fdlora.capture_steps(net, clone_outputs=False, mechanism=StandIn(net))
    y1 = net(x)["out"]
    y2 = net(torch.randn(2, 8))["out"]
    assert y1 is y2  # the graph's static output


def test_autograd_calls_run_eagerly_and_release_restores(net):
    fdlora.add_adapter(net, adapter(3), "c")
    runner = fdlora.capture_steps(net, mechanism=StandIn(net))
    assert fdlora.handle(net).state.static
    x = torch.randn(2, 8, requires_grad=True)
    net(x)["out"].sum().backward()  # grad enabled: eager, differentiable
    assert x.grad is not None and runner.captures == 0
    with pytest.raises(FdLoraError, match="already captured"):
        fdlora.capture_steps(net, mechanism=StandIn(net))
    fdlora.release_steps(net)
    assert "forward" not in net.__dict__ and not fdlora.handle(net).state.static
    fdlora.release_steps(net)  # twice is harmless


@torch.no_grad()
def test_a_forward_that_cannot_be_captured_runs_eagerly_with_one_warning(net, caplog):
    class Refusing(StandIn):
        def capture(self, run):
            run()
            raise captured.Uncapturable("RuntimeError: operation not permitted when stream is capturing")

    runner = fdlora.capture_steps(net, mechanism=Refusing(net))
    x = torch.randn(3, 8)
    with caplog.at_level("WARNING", logger="fdlora"):
        for _ in range(3):
            same(net(x), eager(net, x))
    assert runner.captures == 0 and runner.replays == 0
    assert sum("cannot be captured" in r.message for r in caplog.records) == 1


@torch.no_grad()
def test_max_graphs_keeps_the_most_recent(net):
    runner = fdlora.capture_steps(net, max_graphs=2, mechanism=StandIn(net))
    for n in (1, 2, 3, 1):
        net(torch.randn(n, 8))
    assert runner.captures == 4 and len(runner.graphs) == 2  # 1 was dropped when 3 came, captured again


@torch.no_grad()
def test_a_diffusers_pipeline_replays_its_unet_steps(tmp_path):
    """The calling convention of a real pipeline (timestep tensors, keyword dicts, BaseOutput) through the runner:
    a whole SD1.5 call with CFG equals the eager call, one graph for all steps, and a slider move between calls
    applies without a new capture."""
    pytest.importorskip("diffusers")
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    pipe.set_progress_bar_config(disable=True)
    (tmp_path / "l1").mkdir()
    for name, data in tiny.random_lora_files(pipe, seed=1).items():
        (tmp_path / "l1" / name).write_bytes(data)
    pipe.load_fd_lora(str(tmp_path / "l1"), adapter_name="l1")
    kw = dict(prompt=["a cat", "a dog"], num_inference_steps=3, height=32, width=32, output_type="pt")

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0)).images

    want = {}
    for w in (1.0, 0.4):
        pipe.set_adapters(["l1"], [w])
        want[w] = run()
    runner = fdlora.capture_steps(pipe.unet, mechanism=StandIn(pipe.unet))
    try:
        for w in (1.0, 0.4):
            pipe.set_adapters(["l1"], [w])
            torch.testing.assert_close(run(), want[w], rtol=1e-5, atol=1e-5)
    finally:
        fdlora.release_steps(pipe.unet)
    assert runner.captures == 1 and runner.replays == 6
    assert (want[1.0] - want[0.4]).abs().max() > 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error")
def test_cpu_module_gets_one_clear_error_and_stays_as_it_was(net):
    with pytest.raises(FdLoraError, match="need a CUDA device"):
        fdlora.capture_steps(net)
    assert "forward" not in net.__dict__ and not fdlora.handle(net).state.static


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@GPU
@torch.no_grad()
def test_cuda_graphs_equal_eager_and_follow_switches():
    torch.manual_seed(0)
    net = Net().cuda().eval()
    fdlora.add_adapter(net, adapter(1), "a")
    fdlora.add_adapter(net, adapter(2), "b")
    fdlora.set_adapters(net, ["a"], [1.0])
    runner = fdlora.capture_steps(net)
    x = torch.randn(64, 8, device="cuda")
    for names, ws in ((["a"], [1.0]), (["a", "b"], [0.7, -0.4]), (["b"], [0.25])):
        fdlora.set_adapters(net, names, ws)
        same(net(x), eager(net, x))
    with fdlora.per_sample(net, ["a", "b"]):
        x3 = torch.randn(2, 32, 8, device="cuda")
        same(net(x3), eager(net, x3))
    assert runner.captures == 2 and runner.replays == 4
    fdlora.release_steps(net)


@pytest.mark.gpu
@GPU
@torch.no_grad()
def test_pipeline_steps_as_cuda_graphs_equal_eager(tmp_path):
    pytest.importorskip("diffusers")
    from fdlora.fixtures import tiny_pipeline as tiny

    pipe = tiny.sd15()
    for seed in (1, 2):
        for name, data in tiny.random_lora_files(pipe, seed=seed).items():
            (tmp_path / f"l{seed}").mkdir(exist_ok=True)
            (tmp_path / f"l{seed}" / name).write_bytes(data)
    pipe = pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    pipe.load_fd_lora(str(tmp_path / "l1"), adapter_name="l1")
    pipe.load_fd_lora(str(tmp_path / "l2"), adapter_name="l2")
    kw = dict(prompt=["a cat", "a dog"], num_inference_steps=3, height=64, width=64, output_type="pt")

    def run():
        return pipe(**kw, generator=torch.Generator("cuda").manual_seed(0)).images

    results = {}
    for weights in ([1.0, 0.0], [0.3, -0.6]):
        pipe.set_adapters(["l1", "l2"], weights)
        pipe.enable_fd_lora_cuda_graphs()
        got = run()
        runner = captured.steps_of(pipe.unet)
        pipe.disable_fd_lora_cuda_graphs()
        results[tuple(weights)] = (got, run(), runner.captures, runner.replays)
    for got, want, captures, replays in results.values():
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        assert captures == 1 and replays == 3  # CFG batch of one shape: one graph, replayed at every step
    a, b = results.values()
    assert (a[0] - b[0]).abs().max() > 1e-2
