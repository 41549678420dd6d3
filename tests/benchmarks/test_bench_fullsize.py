"""benchmarks/bench_fullsize.py --smoke: every case of every model runs, verifies and lands in one merged JSON.

The headline benchmark runs on a GPU only at the lead's hand; this runs its code paths (PEFT adapters, conversion,
oracles, per-prompt / slider / no-cache / compiled cases, JSON merging) on toy models on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_fullsize.py"
CASES = {
    "sdxl": ["peft_cache_1", "peft_cache_blend4", "cache_1", "cache_blend4", "per_prompt_2", "per_prompt_cfg",
             "slider_every_step", "nocache_1", "per_prompt_2_nocopy", "per_prompt_cfg_nocopy"],
    "flux": ["peft_cache_1", "peft_cache_blend4", "cache_1", "cache_blend4", "per_prompt_2", "per_prompt_2_cache50",
             "slider_every_step", "nocache_1", "per_prompt_2_nocopy", "compiled_regional_1", "compiled_regional_slider",
             "compile_time_x"],
    "llama": ["peft_decode32_mixed4", "decode32_mixed4", "generate16_mixed4", "prefill2048_1", "decode32_nocache_1",
              "decode32_mixed4_nocopy", "generate16_mixed4_nocopy", "prefill2048_nocopy"],
}
ENV = ["device", "backend", "torch", "triton", "diffusers", "peft", "transformers", "git_sha"]
ROW = ["model", "case", "ms", "base_ms", "x_base", "target", "peak_gib", "cache_gib", "checked", "notes", "backend",
       "dispatch"]
UNTARGETED = {"per_prompt_2_cache50"}  # rows that explain a target's bound (captured_* rows need a GPU)


def smoke(out: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rounds", "1", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"bench_fullsize {args} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}" \
                                 f"\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("fullsize") / "fullsize.json"
    logs = "".join(smoke(out, "--model", m) for m in CASES)
    return out, logs


def test_every_case_of_every_model_is_checked_and_merged(merged):
    out, logs = merged
    data = json.loads(out.read_text())
    assert set(ENV) <= set(data)
    rows = {(c["model"], c["case"]): c for c in data["cases"]}
    assert len(rows) == len(data["cases"]), "a (model, case) appears twice"
    assert set(rows) == {(m, c) for m, cs in CASES.items() for c in cs}
    for (model, case), row in rows.items():
        assert list(row) == ROW, (model, case)
        assert row["ms"] > 0 and row["base_ms"] > 0 and row["x_base"] > 0, (model, case, row)
        if not case.startswith("peft_"):  # every fd-lora row says which path its layers took ({path [backend]: n})
            assert row["dispatch"] and all(n > 0 for n in row["dispatch"].values()), (model, case, row["dispatch"])
        if case.startswith("peft_"):
            assert row["target"] is None
        elif case in UNTARGETED:
            assert row["target"] is None and 0 <= row["checked"] < 1e-4, (model, case, row)
        else:
            assert row["target"] >= 1.0 and 0 <= row["checked"] < 1e-4, (model, case, row)
    assert "WRONG" not in logs
    notes = rows[("flux", "compiled_regional_1")]["notes"]
    assert "after 5 switches/slider moves: 0 graphs" in notes, notes
    notes = rows[("flux", "compiled_regional_slider")]["notes"]
    assert "recompiles: 0 graphs, 0 guard failures" in notes, notes


def test_a_rerun_replaces_only_its_own_cases(merged):
    out, _ = merged
    before = json.loads(out.read_text())["cases"]
    smoke(out, "--model", "llama", "--cases", "prefill2048_1")
    after = json.loads(out.read_text())["cases"]
    assert len(after) == len(before)
    assert {(c["model"], c["case"]) for c in after} == {(c["model"], c["case"]) for c in before}


def test_fresh_runs_write_each_case_when_its_runs_end(tmp_path, monkeypatch):
    """Each case's row is in --out as soon as its fresh-process runs end: a timeout (SIGTERM: SystemExit 124) in a
    later case keeps it, the median run's row with every run's x."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_fullsize as bf

    xs = iter([1.3, 1.1, 1.2])

    def run(cmd, **kwargs):
        case, out = cmd[cmd.index("--cases") + 1], Path(cmd[cmd.index("--out") + 1])
        if case == "per_prompt_cfg_nocopy":
            raise SystemExit(124)
        x = next(xs)
        out.write_text(json.dumps({"device": "fake", "cases": [{"model": "sdxl", "case": case, "x_base": x}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bf.subprocess, "run", run)
    out = tmp_path / "fullsize.json"
    args = bf.argparse.Namespace(model="sdxl", cases="per_prompt_2_nocopy,per_prompt_cfg_nocopy", runs=3, rounds=None,
                                 out=out)
    with pytest.raises(SystemExit):
        bf.fresh(args)
    data = json.loads(out.read_text())
    assert data["method"].startswith("each case alone in a fresh process, 3 runs")
    (row,) = data["cases"]
    assert (row["case"], row["x_base"], row["runs_x_base"]) == ("per_prompt_2_nocopy", 1.2, [1.3, 1.1, 1.2])
