"""`fdlora serve CONFIG`: the config's `serve:` section, loopback by default, one-line errors, and a real start
(a local Ray cluster in the command's own process, no `ray start`) answering HTTP until Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fdlora.apps.cli import main
from fdlora.config import validate

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "serve.yaml"
    p.write_text(text)
    return p


def test_serve_defaults_to_loopback(tmp_path, capsys):
    cfg = validate({"pipeline": "tiny-sd15", "serve": None})
    assert cfg.serve["host"] == "127.0.0.1" and cfg.serve["port"] == 8000 and cfg.serve["address"] is None
    assert validate({"pipeline": "tiny-sd15"}).serve is None
    path = write(tmp_path, "pipeline: tiny-sd15\nadapters: [{name: a, source: org/a}]\n")
    assert main(["serve", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "on 127.0.0.1:8000" in out and "allowed adapters: a" in out
    assert main(["serve", str(path), "--check", "--host", "0.0.0.0", "--port", "9001"]) == 0
    assert "on 0.0.0.0:9001" in capsys.readouterr().out


@pytest.mark.parametrize("section, key", [
    ("{replicas: 0}", "serve.replicas"), ("{port: 70000}", "serve.port"), ("{host: 1}", "serve.host"),
    ("{max_batch: true}", "serve.max_batch"), ("{gpus: 2}", "serve.gpus"), ("[1, 2]", "serve"),
    ("{batch_wait_s: .nan}", "serve.batch_wait_s"), ("{address: ''}", "serve.address"),
], ids=["replicas-0", "port-range", "host-type", "bool-int", "unknown-key", "not-a-mapping", "nan", "empty"])
def test_bad_serve_sections_are_one_line_config_errors(tmp_path, capsys, section, key):
    path = write(tmp_path, f"pipeline: tiny-sd15\nserve: {section}\n")
    assert main(["serve", str(path), "--check"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f": {key}:" in err and "error:" in err, err


def test_a_model_config_is_served_at_generate(tmp_path, capsys):
    assert main(["serve", str(write(tmp_path, "model: tiny-llama\nserve: {max_steps: 8}\n")), "--check"]) == 0
    assert "tiny-llama" in capsys.readouterr().out


def test_fdlora_serve_starts_a_local_cluster_and_stops_on_ctrl_c(pytestconfig, tmp_path):
    pytest.importorskip("ray.serve")
    from support import serving

    from fdlora.fixtures import tiny_pipeline as tiny
    from fdlora.fixtures.localcache import populate

    populate(pytestconfig.fakehub.root, "serve-cli/lora", tiny.random_lora_files(tiny.sd15(), seed=7))
    port = serving.free_port()
    path = write(tmp_path, f"pipeline: tiny-sd15\ndevice: cpu\nsteps: 2\nsize: 64\n"
                           f"adapters: [{{name: pix, source: serve-cli/lora}}]\n"
                           f"serve: {{replicas: 1, port: {port}, max_steps: 4, max_size: 128}}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               RAY_DEDUP_LOGS="0")
    proc = subprocess.Popen([sys.executable, "-m", "fdlora", "serve", str(path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        end = time.time() + 240
        while not any(line.startswith("serving on ") for line in lines):
            assert proc.poll() is None and time.time() < end, "".join(lines)[-3000:]
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        serving.wait_ready(url, timeout=120)
        status, _, body = serving.post(url, b"", method="GET", path="/v1/adapters", content_type=None)
        assert status == 200 and [a["name"] for a in json.loads(body)["adapters"]] == ["pix"]
        req = {"prompt": "a cat", "adapters": {"pix": 1.0}, "seed": 2, "num_inference_steps": 2}
        status, headers, body = serving.post(url, json.dumps(req).encode())
        assert status == 200 and body[:4] == b"\x89PNG"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
