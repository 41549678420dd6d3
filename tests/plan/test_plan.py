"""fdlora plan on CPU: builtin/tiny models, config-only directories, JSON schema, errors, calibration, and the
replay of every in-scope committed H100 benchmark row (replay.py says which rows and why)."""

from __future__ import annotations

import json

import pytest

import fdlora.kernels.costmodel as C
from fdlora.apps.plan import main
from fdlora.errors import FdLoraError, ResolveError
from fdlora.plan import plan
from fdlora.plan.builtins import TINY_LLAMA, TINY_UNET

from . import replay

STRATS = {"merged", "dynamic", "cache", "grouped", "quantized"}


def test_dispatcher_and_planner_share_one_cost_model() -> None:
    D = pytest.importorskip("fdlora.kernels.triton.forward.lora_linear_dispatch")
    assert D.estimate is C.estimate and D.Problem is C.Problem and D.PEAK_TFLOPS == C.H100.peak_tflops


def test_replayed_h100_benchmarks_within_20_percent() -> None:
    rows = replay.layer_rows() + replay.step_rows()
    ratio = sorted(rows, key=lambda r: -abs(r[2] / r[1] - 1))
    ok = [r for r in rows if 0.8 <= r[2] / r[1] <= 1.2]
    print(f"{len(ok)}/{len(rows)} rows within 20%; worst:")
    for name, meas, pred in ratio[:10]:
        print(f"  {pred / meas:.2f}x  measured {meas:.1f} predicted {pred:.1f}  {name}")
    assert len(rows) > 400 and len(ok) >= 0.9 * len(rows)


H200 = replay.RESULTS.parent / "nvidia-h200" / "fullsize.json"
H200_ROWS = [("sdxl", "nocache_1", 2, 1), ("sdxl", "per_prompt_2_nocopy", 2, 2),
             ("sdxl", "per_prompt_cfg_nocopy", 4, 2), ("flux", "nocache_1", 1, 1),
             ("flux", "per_prompt_2_nocopy", 2, 2)]


@pytest.mark.parametrize("model,case,batch,blends", H200_ROWS, ids=[f"{m}-{c}" for m, c, _, _ in H200_ROWS])
def test_h200_no_copy_steps_within_10_percent(model, case, batch, blends) -> None:
    """The planner's dynamic step over its base step against the committed H200 rows (each case alone, no merged
    copy, CUDA extension built): one adapter, and per-prompt batches of two blends, whose per-call layers merge
    every blend in one launch (no host time per further blend: fdlora.plan.devices, host_percall_group_us)."""
    rows = {(r["model"], r["case"]): r for r in json.loads(H200.read_text())["cases"]}
    measured = rows[(model, case)]["x_base"]
    r = plan("flux-dev" if model == "flux" else model, gpu="h200", batch=batch, adapters_per_batch=blends)
    predicted = r.by_name("dynamic").step_ms / r.info["base_step_ms"]
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-sdxl", "tiny-flux"])
def test_tiny_builtins_plan(model) -> None:
    r = plan(model, gpu="cpu", adapters=3, adapters_per_batch=2)
    assert {s.name for s in r.strategies} == STRATS and r.info["lora_layers"] > 0
    assert r.recommended in STRATS and not r.by_name("merged").feasible  # 2 adapters per batch: no single merge
    assert "recommended" in r.table()


def test_full_size_llama_plans_with_tensor_parallelism() -> None:
    one, two = plan("llama-3-8b", tp=1), plan("llama-3-8b", tp=2)
    assert one.info["lora_layers"] == 224 and two.info["weights_gib"] < one.info["weights_gib"]


@pytest.mark.parametrize("kind", ["llm", "unet"])
def test_config_only_directory_plans_without_weights(tmp_path, kind) -> None:
    cfg = dict(TINY_LLAMA, architectures=["LlamaForCausalLM"]) if kind == "llm" else dict(
        TINY_UNET, _class_name="UNet2DConditionModel")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = plan(str(tmp_path), gpu="cpu")
    assert r.info["lora_layers"] > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_json_schema(capsys) -> None:
    assert main(["tiny-llama", "--gpu", "cpu", "--json", "--switch-every", "10"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"model", "gpu", "gpu_source", "workload", "info", "strategies", "recommended", "reason",
            "break_even"} <= d.keys()
    for s in d["strategies"]:
        assert {"name", "step_ms", "switch_ms", "extra_gib", "feasible", "per_step_ms"} <= s.keys()
    assert {"base_step_ms", "merge_ms", "load_ms", "bank_gib", "weights_gib", "activations_gib"} <= d["info"].keys()


@pytest.mark.parametrize("model", ["no-such-builtin", "a/b/c"])
def test_bad_model_is_one_clear_error(model, capsys) -> None:
    with pytest.raises(ResolveError, match="builtin"):
        plan(model)
    assert main([model]) == 2 and "Pass" in capsys.readouterr().err


def test_missing_config_names_the_fix(tmp_path) -> None:
    with pytest.raises(FdLoraError, match="config.json"):
        plan(str(tmp_path))


def test_calibrate_on_cpu_writes_constants_the_planner_prefers(tmp_path) -> None:
    from fdlora.plan import devices

    path = devices.calibrate("cpu", shapes=(32, 64), out=tmp_path / "cpu.json")
    data = json.loads(path.read_text())
    assert data["peak_tflops"] > 0 and data["hbm_gbs"] > 0
    assert devices.get("cpu", path).peak_tflops == data["peak_tflops"]


def test_calibrate_names_the_device_it_ran_on() -> None:
    """A calibration on an H200 must not overwrite the H100's constants: the file is named by the device's key."""
    from fdlora.plan import devices

    assert devices._known("NVIDIA H100 80GB HBM3") == "h100"
    assert devices._known("NVIDIA H200") == "h200"
    assert devices._known("NVIDIA A100-SXM4-80GB") == "a100"
    assert devices._known("NVIDIA GeForce RTX 4090") == "4090"
    assert devices._known("Tesla T4") == "gpu"
