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
    for r in fd:  # where each run's time went on the replica: its calls and loads, counted during that run only
        e = r["engine"]
        assert e["calls"] >= e["batches"] >= 1 and e["pipeline_s"] > 0 and 1 <= e["images_per_call"] <= 8
        assert e["requests_per_batch"] == round(r["served"] / e["batches"], 2) >= e["images_per_call"]
        assert e["pipeline_s_per_image"] == round(e["pipeline_s"] / r["served"], 3) and 0 < e["busy_share"] <= 1.05
    assert all("engine" not in r for r in d["runs"] if r["server"] == "diffusers_peft")  # no counters to report
    assert d["idle"]["adapter_effect"]  # adapters change the image: a swap is visible
    assert max(d["baseline_idle"]["max_diff_to_fdlora"]) <= 2  # the baseline serves the same adapters
    assert d["baseline_idle"]["pid"] != d["pid"]  # in a process of its own, not the one the fd-lora server ran in
    f = d["faults"]
    oom = f["out_of_memory"]
    assert oom["batch_served"] == oom["batch_matches"] == 3 and oom["oversized_status"] == 507
    assert oom["batch_statuses"] == [200] * 3 and oom["batch_errors"] == []
    assert "out of device memory" in oom["oversized_error"] and oom["engine_oom_retries"] >= 1
    assert oom["leader_served"] and oom["ok"]  # the request that ran first, alone, was served and equal
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
    assert d["warm_up"]["batch_sizes"] == d["warm_up"]["group_sizes"] == list(range(1, 9))
    assert len(d["warm_up"]["rss_mb"]) == 3  # before, after the sizes, after the groups
    ceiling = d["base_ceiling"]
    assert ceiling["batch"] == 8 and ceiling["ips"] > 0 and s["base_batch_ips"] == ceiling["ips"]
    reload = d["load_profile"]  # an evicted adapter's way back, timed and profiled on the idle server
    assert len(reload["reload_s"]) == 3 and min(reload["reload_s"]) > 0
    assert any("load_fd_lora" in f["function"] for f in reload["top_cumulative"])


def test_soak_reads_memory_during_one_long_run_then_runs_the_faults(tmp_path):
    out = tmp_path / "soak.json"
    rc = bench_serve.main(["--model", "tiny", "--budget-s", "60", "--no-ray", "--http", "stdlib", "--soak",
                           "--steps", "1", "--max-requests", "40", "--max-batch", "4", "--out", str(out)])
    d = json.loads(out.read_text())
    soak, s = d["soak"], d["summary"]
    assert rc == 0 and s["faults_ok"] and s["mismatches"] == 0 and s["lost"] == 0
    assert d["config"]["steps"] == 1  # --steps: every request's, the references' too
    assert len(d["runs"]) == 1 and d["runs"][0]["clients"] == 16 and s["served"] == s["sent"] == soak["requests"] > 16
    times = [x["t_s"] for x in soak["samples"]]
    assert len(times) >= 2 and times == sorted(times) and times[-1] >= soak["wall_s"]  # read meanwhile, then after
    rss = [x["rss_mb"] for x in soak["samples"]]
    assert soak["rss_range_mb"] == [min(rss), max(rss)] and soak["rss_growth_mb"] == round(rss[-1] - rss[0], 1)
    first, last = soak["samples"][0], soak["samples"][-1]
    assert last["heap_in_use_mb"] > 0 and last["heap_free_mb"] >= 0 and last["py_blocks"] > 0
    assert soak["growth_by_part_mb"]["heap_in_use"] == round(last["heap_in_use_mb"] - first["heap_in_use_mb"], 1)
    assert 1 <= soak["call_kinds"][0] <= soak["call_kinds"][1]  # the warm-up's calls, then the run's new kinds


def test_warm_up_sends_every_batch_size_and_every_group_size_of_one_adapter_set(monkeypatch):
    import collections

    sent = []
    monkeypatch.setattr(bench_serve, "burst", lambda url, reqs, t: (sent.append(reqs), [(200, b"")] * len(reqs))[1])
    monkeypatch.setattr(bench_serve, "wait_idle", lambda: None)
    server = type("S", (), {"url": "", "memory": lambda self: {"rss": 2**30}})()
    pool = [{"adapters": {f"a{i}": 1.0}, "prompt": f"p{i}", "num_inference_steps": 20} for i in range(8)]
    w = bench_serve.warm_shapes(server, pool, 8, 1.0)
    assert sorted(len(b) for b in sent if len({r["prompt"] for r in b}) == len(b)) == list(range(2, 9))
    groups = {n for b in sent for n in collections.Counter(r["prompt"] for r in b).values()}
    assert groups == set(range(1, 9)) and all(r["num_inference_steps"] == 2 for b in sent for r in b)
    assert w["group_sizes"] == list(range(1, 9)) and w["rss_mb"] == [1024.0] * 3
    assert len({r["seed"] for b in sent for r in b}) == sum(map(len, sent))  # every image its own seed


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


def _serve_rounds(tmp_path, rounds: int, per_round: int, keep: list | None = None) -> tuple[list[int], int]:
    """A tiny-pipeline server, 8 adapters over 4 slots: references, one batch of every size, then `rounds`
    closed-loop runs of 16 clients, with Python's allocations traced; the traced bytes after each run, and the
    adapter loads during them. `keep` (a test's injected leak) receives every call's images."""
    import gc
    import tracemalloc

    from fdlora.config import validate

    pipe = bench_serve.make_pipeline("tiny", "cpu")
    paths = bench_serve.write_adapters(pipe, tmp_path, 8, 16)
    names = [f"a{i}" for i in range(8)]
    cfg = validate({"pipeline": "tiny-sdxl", "device": "cpu", "steps": 2, "size": 64,
                    "adapters": [{"name": n, "source": str(p)} for n, p in paths.items()],
                    "serve": {"adapters_per_replica": 4, "max_batch": 8, "batch_wait_s": 0.02, "max_steps": 2,
                              "max_size": 64}})
    pool = bench_serve.request_pool(names, 8, 64, 2, 0)
    server = serve_harness.LocalServer.fdlora(cfg, pipe, "stdlib")
    if keep is not None:
        call = server.engine._call
        server.engine._call = lambda reqs: keep.append(call(reqs)) or keep[-1]
    tracemalloc.start()
    try:
        refs, t_img = bench_serve.references(server, pool, 600)
        bench_serve.warm_shapes(server, pool, 8, t_img)
        traced, loads = [], server.stats()["loads"]
        for rnd in range(rounds):
            run = bench_serve.Load(server.url, pool, refs, per_round, 600, 120, rnd).closed(16)
            assert run["served"] == per_round and run["mismatches"] == 0 and run["lost"] == 0
            gc.collect()
            traced.append(tracemalloc.get_traced_memory()[0])
        return traced, server.stats()["loads"] - loads
    finally:
        tracemalloc.stop()
        server.close()


@pytest.mark.parametrize("leak", [False, True], ids=["as-built", "injected-leak"])
def test_python_memory_stays_flat_under_load_once_every_batch_shape_ran(tmp_path, leak):
    """Eight adapters over four slots, 16 clients, mixed single / blend requests: after one batch of every size, the
    Python objects the server process holds (engine, batcher, HTTP app, adapter loads from the RAM cache, and the
    load generator that decodes and compares every image) grow by at most 128 KB over 32 more requests while
    adapters keep being evicted and loaded again (about 10 KB measured). A server that kept each call's PNGs
    (injected: about 12 KB an image here) grows past that, as the check must see."""
    traced, loads = _serve_rounds(tmp_path, 3, 16, keep=[] if leak else None)
    assert loads >= 8  # evictions and reloads happened throughout
    grew = (max(traced[1:]) - traced[0]) / 2**10
    assert (grew > 128) if leak else (grew <= 128), [t // 2**10 for t in traced]


def test_the_batcher_holds_no_answer_once_it_is_handed_over():
    import gc
    import weakref

    class Answer:
        pass

    made: list[weakref.ref] = []

    def run_each(reqs):
        out = [Answer() for _ in reqs]
        made.extend(weakref.ref(a) for a in out)
        return out

    batcher = serve_harness.Batcher(run_each, max_batch=4, wait_s=0.05)
    try:
        futs = [batcher.submit(i) for i in range(3)]
        assert all(isinstance(f.result(timeout=10), Answer) for f in futs)
        del futs
        gc.collect()
        assert len(made) == 3 and all(r() is None for r in made)  # while the worker waits for the next request
    finally:
        batcher.close()


def test_the_load_runs_callers_read_the_pool_from_a_file_removed_at_the_end():
    pool, refs = [{"prompt": "p"}], [b"png"]
    with bench_serve.Clients() as clients:
        path = clients._shared(pool, refs)
        assert clients._shared(pool, refs) == path and clients._shared(pool, [b"other"]) != path  # written once
        assert bench_serve.pickle.loads(path.read_bytes()) == (pool, refs)
    assert not path.exists()
