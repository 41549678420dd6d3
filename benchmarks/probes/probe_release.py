# Measures: which objects keep a deleted fused model's CUDA memory alive (the referrer chains).
"""Which objects keep a deleted fused model's CUDA memory alive (tests/layers/test_release.py's scenario): after
`del model` with the collector off, list the live large CUDA tensors and, for each, the chain of referrers that
holds it (types and, for dicts, the keys that point at the next link)."""

from __future__ import annotations

import gc
import sys
import weakref

import torch

import fdlora
from fdlora.fixtures.release import merged_steps_model


def chain(obj, depth: int = 8, seen=None) -> list[str]:
    seen = seen if seen is not None else set()
    f = sys._getframe()
    while f is not None:  # this probe's own frames hold what they inspect
        seen.add(id(f))
        f = f.f_back
    out = []
    frontier = [(obj, 0, "")]
    while frontier and len(out) < 40:
        o, d, pre = frontier.pop()
        if d >= depth:
            continue
        for r in gc.get_referrers(o):
            if id(r) in seen or r is frontier or r is globals() or (isinstance(r, tuple) and r and r[0] is o
                                                                      and len(r) == 3 and isinstance(r[1], int)):
                continue
            seen.add(id(r))
            what = type(r).__qualname__
            leaf = False
            if isinstance(r, dict) and "__builtins__" in r:
                what, leaf = f"globals of {r.get('__name__')} keys={[k for k, v in r.items() if v is o][:3]}", True
            elif isinstance(r, dict):
                keys = [k for k, v in r.items() if v is o][:3]
                what += f" keys={keys}"
            elif isinstance(r, (list, tuple)):
                what += f" len={len(r)}"
            elif isinstance(r, type(sys._getframe())):
                what += f" {r.f_code.co_name} {r.f_code.co_filename}:{r.f_lineno}"
            out.append(f"{pre}{what}")
            if len(out) >= 60:
                break
            if not (leaf or isinstance(r, (type(sys), type(chain)))):
                frontier.append((r, d + 1, pre + "  "))
    return out


def main(captured: bool) -> None:
    dev = torch.device("cuda")
    torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    start = torch.cuda.memory_allocated(dev)
    model = merged_steps_model(dev, captured)
    print("paths:", fdlora.dispatch_counts(model))
    layer0, whole = weakref.ref(model[0]), weakref.ref(model)
    del model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(dev) - start
    print(f"captured={captured}: held {held / 2**20:.0f} MiB after del")
    if held > 16 << 20:
        for o in gc.get_objects():
            big = isinstance(o, torch.Tensor) and o.is_cuda and o.numel() * o.element_size() >= 32 << 20
            if big or isinstance(o, torch.cuda.CUDAGraph):
                print(f"live {type(o).__name__} {tuple(o.shape) if big else ''}; its referrers:")
                print("\n".join(chain(o, depth=6)))
    if whole() is not None:
        print("the model is alive; its referrers:")
        print("\n".join(chain(whole(), depth=7)))
    elif layer0() is not None:
        print("layer 0 is alive; its referrers:")
        print("\n".join(chain(layer0(), depth=7)))
    gc.enable()


if __name__ == "__main__":
    if "peft" in sys.argv:  # imported before the model exists, as in a test session
        import peft  # noqa: F401
    main("captured" in sys.argv)
