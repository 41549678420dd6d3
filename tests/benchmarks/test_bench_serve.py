"""benchmarks/bench_serve.py's whole flow on CPU with the tiny SDXL pipeline, in-process engine behind both HTTP
front ends: nothing lost or mismatched, each fault counted as it happened, the JSON complete; and the image
comparison catches a swapped adapter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve  # noqa: E402
import serve_harness  # noqa: E402

FIELDS = ("device", "torch", "diffusers", "peft", "ray", "ray_reason", "http", "config", "idle", "runs", "faults",
          "warm_up", "memory", "server", "baseline_idle", "base_ceiling", "summary", "wall_s")


@pytest.mark.parametrize("http", ["fastapi"])
def test_whole_flow_tiny(http, tmp_path):
    out = tmp_path / "serve.json"
    rc = bench_serve.main(["--model", "tiny", "--budget-s", "600", "--no-ray", "--http", http, "--pool", "6",
                           "--max-requests", "6", "--out", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0 and all(k in d for k in FIELDS)
    assert d["ray"] is False and d["ray_reason"] and d["http"] == http and d["device"] == "cpu"
    s = d["summary"]
    assert s["mismatches"] == 0 and s["lost"] == 0 and s["failed"] == {} and s["server_restarts"] == 0
    assert s["served"] == s["sent"] > 0 and s["faults_ok"]
    fd = [r for r in d["runs"] if r["server"] == "fdlora" and r["sent"]]
    assert {r["mode"] for r in fd} == {"closed", "open"} and any(r["server"] == "diffusers_peft" for r in d["runs"])
    assert d["idle"]["adapter_effect"]  # adapters change the image: a swap is visible
    assert max(d["baseline_idle"]["max_diff_to_fdlora"]) <= 2  # the baseline serves the same adapters
    f = d["faults"]
    oom = f["out_of_memory"]
    assert oom["batch_served"] == oom["batch_matches"] == 3 and oom["oversized_status"] == 507
    assert "out of device memory" in oom["oversized_error"] and oom["engine_oom_retries"] >= 1
    dis = f["disconnect"]
    assert dis["others_served"] == dis["others_matches"] == 3 and dis["served_after"]
    assert dis["dropped_before_running"] >= 1  # the queued client's request never ran
    bad = f["corrupt_adapter"]
    assert bad["corrupt_failed"] == 2 and bad["corrupt_statuses"] == [500, 500] and bad["one_line"]
    assert bad["others_served"] == bad["others_matches"] == 2 and "failed to load" in bad["errors"][0]
    assert d["memory"]["rss_before_mb"] > 0 and d["server"]["failed_loads"] == 1
    mem = d["memory"]  # the adapter cache's part of the RSS is measured, and taken out of the growth a leak shows
    assert mem["adapter_cache_growth_mb"] >= 0 and mem["pinned_host_growth_mb"] is None  # no CUDA: no pinned blocks
    assert mem["rss_growth_outside_caches_mb"] == round(mem["rss_growth_mb"] - mem["adapter_cache_growth_mb"], 1)
    ceiling = d["base_ceiling"]
    assert ceiling["batch"] == 8 and ceiling["ips"] > 0 and s["base_batch_ips"] == ceiling["ips"]


def test_a_swapped_adapter_is_a_mismatch(tmp_path):
    a = bench_serve.args(["--model", "tiny"])
    pipe = bench_serve.make_pipeline("tiny", "cpu")
    paths = bench_serve.write_adapters(pipe, tmp_path, 3, 16)
    from fdlora.config import validate

    cfg = validate({"pipeline": "tiny-sdxl", "device": "cpu", "steps": 2, "size": 64,
                    "adapters": [{"name": n, "source": str(p)} for n, p in paths.items()],
                    "serve": {"adapters_per_replica": 2, "max_steps": 2, "max_size": 64}})
    server = serve_harness.LocalServer.fdlora(cfg, pipe, "stdlib")
    try:
        req = bench_serve.request_pool(list(paths), 1, 64, 2, a.seed)[0]
        swapped = {**req, "adapters": {"a1": req["adapters"]["a0"]}}
        (s0, ref), (s1, again), (s2, other) = (serve_harness.post(server.url, r, 60) for r in (req, req, swapped))
        assert s0 == s1 == s2 == 200
        assert serve_harness.compare(again, ref) and not serve_harness.compare(other, ref)
    finally:
        server.close()
