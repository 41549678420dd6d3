# Measures: host memory of `bench_serve --soak` on the CPU, the tiny pipeline's images enlarged to 1024².
# At 36ad128 (2-CPU host, 16 clients, 1 step, 900 requests): RSS +6.2 MB first idle reading to last (heap in use +4.2).
"""Whether a serving process's host memory climbs over a long run when nothing GPU-side is in it: `bench_serve --soak`
over the tiny SDXL pipeline, each image upscaled to 1024² and overlaid with one fixed noise pattern before its PNG is
encoded (so a call's host buffers have a full-size call's size, and an image in a batch still equals its reference
within 1/255). What a GPU soak adds beyond this is GPU-side (CUDA libraries, the driver). Arguments go to
bench_serve, e.g.

    python benchmarks/probes/probe_cpu_soak.py --model tiny --soak --steps 1 --budget-s 1500 --max-requests 900 \\
        --no-ray --http fastapi --out /tmp/cpu_soak.json
"""

import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serve  # noqa: E402

from fdlora.serve import engine  # noqa: E402

SIZE = 1024
NOISE = np.random.default_rng(0).integers(0, 64, size=(SIZE, SIZE, 3), dtype=np.uint8)
_png = engine.png


def full_size_png(image) -> bytes:
    a = np.asarray(image.convert("RGB"), dtype=np.uint8)
    f = SIZE // a.shape[0]
    big = np.kron(a, np.ones((f, f, 1), dtype=np.uint8)).astype(np.uint16) * 3 // 4 + NOISE
    return _png(Image.fromarray(big.astype(np.uint8)))


engine.png = full_size_png  # engine.encode looks png up at call time

if __name__ == "__main__":  # the clients' process is spawned and imports this module again
    sys.exit(bench_serve.main(sys.argv[1:]))
