"""benchmarks/bench_quantized.py --smoke: on a tiny Flux over torchao int8 / float8 and GGUF Q8_0 (CPU), every
fd-lora step equals the hook oracle on the same quantized base, the merge cache holds no dequantized copy, the rows
say which path their layers took (GGUF rows also under their old names), and the rows land in the JSON beside its
other keys (the full-size GPU run is the lead's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_quantized.py"


def test_smoke_checks_every_kind_and_keeps_the_files_other_rows(tmp_path):
    pytest.importorskip("torchao")
    pytest.importorskip("gguf")
    out = tmp_path / "breadth.json"
    out.write_text(json.dumps({"rows": [{"family": "flux"}]}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["rows"] == [{"family": "flux"}]
    q = data["quantized"]
    assert q["failures"] == []
    got = {(r["kind"], r["case"]) for r in q["rows"]}
    assert got == {(k, c) for k in ("torchao-int8", "torchao-float8", "gguf-Q8_0")
                   for c in ("base", "fdlora_1", "fdlora_blend4")}
    for r in q["rows"]:
        if r["case"] != "base":
            assert r["ok"] and r["dequantized_copies"] == 0 and r["rel_err"] < r["lora_effect"] / 2, r
        if r["case"] != "base":  # which path the layers took (fdlora.layers.quant.dequant)
            assert sum(r["merge_paths"].values()) > 0 and set(r["merge_paths"]) <= {
                "fused-dequant-merge", "torch-dequant-merge", "base+delta"}, r
            assert r["merge_path"] == (next(iter(r["merge_paths"])) if len(r["merge_paths"]) == 1 else "mixed"), r
            assert "torch-dequant-merge" in r["merge_paths"], r  # the tiny Flux's many-row layers merge (CPU: torch)
        if r["kind"].startswith("gguf") and r["case"] != "base":  # the GGUF rows' own fields (fdlora.layers.quant.gguf)
            assert sum(r["gguf_paths"].values()) > 0 and set(r["gguf_paths"]) <= {
                "fused-dequant-merge", "torch-dequant-merge", "base+delta"}, r
            assert r["gguf_path"] == (next(iter(r["gguf_paths"])) if len(r["gguf_paths"]) == 1 else "mixed"), r
    assert q["gguf_kernel"] == [] and q["torchao_kernel"] == []  # the kernels' own timings need CUDA
