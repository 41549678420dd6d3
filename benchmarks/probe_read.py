"""Where the read phase of a hub-cache load goes (ad-hoc probe): header, pinned alloc, file read, views."""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fdlora.hub import safefile  # noqa: E402

g = torch.Generator().manual_seed(0)
sd = {}
widths = [(640, 640), (1280, 1280), (1280, 5120), (5120, 1280), (2048, 1280), (768, 768), (1280, 1280)]
for i in range(964):
    k, n = widths[i % len(widths)]
    sd[f"unet.m{i}.lora_A.weight"] = torch.randn(32, k, generator=g).half()
    sd[f"unet.m{i}.lora_B.weight"] = torch.randn(n, 32, generator=g).half()
path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
save_file(sd, path)
size = os.path.getsize(path)
print(f"{size / 1e6:.1f} MB, {len(sd)} tensors")


def t(f, n=5):
    out = []
    for _ in range(n):
        s = time.perf_counter()
        r = f()
        out.append((time.perf_counter() - s) * 1e3)
    return sorted(out)[n // 2], r


print("header ms", t(lambda: safefile._check_header(path))[0])
print("pinned alloc (cached) ms", t(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))[0])
buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
print("read_into pinned ms", t(lambda: safefile.read_into(path, buf))[0])
pageable = torch.empty(size, dtype=torch.uint8)
print("read_into pageable ms", t(lambda: safefile.read_into(path, pageable))[0])
print("read_weights(pin) ms", t(lambda: safefile.read_weights(path, pin=True))[0])
print("h2d pinned ms", t(lambda: (buf.to("cuda", non_blocking=True), torch.cuda.synchronize()))[0])
