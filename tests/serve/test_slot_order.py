"""The same request gives the same image whatever slots its adapters landed in (fdlora.serve.engine): a blend's
adapters are summed in one order (by name), not in the order a replica's load history left them in the slots."""

from __future__ import annotations

import pytest

from fdlora.config import validate
from fdlora.fixtures import tiny_pipeline as tiny
from fdlora.fixtures.localcache import populate
from fdlora.serve import ImageRequest
from fdlora.serve.engine import Engine


@pytest.fixture(scope="module")
def engine(pytestconfig):
    pipe = tiny.sd15()
    names = {}
    for i in range(3):
        populate(pytestconfig.fakehub.root, f"serve-slots/l{i}", tiny.random_lora_files(pipe, seed=60 + i))
        names[f"s{i}"] = f"serve-slots/l{i}"
    cfg = validate({"pipeline": "tiny-sd15", "device": "cpu", "steps": 2, "size": 64,
                    "adapters": [{"name": n, "source": r} for n, r in names.items()],
                    "serve": {"adapters_per_replica": 3, "max_steps": 4, "max_size": 128}})
    return Engine(cfg)


def slots(engine) -> dict[str, dict[str, int]]:
    return {c: dict(h.state.slots.by_name) for c, h in engine.pipe.fd_lora_handles().items()}


def loaded_in(engine, order: list[str]) -> dict[str, dict[str, int]]:
    """Forget every adapter, then load `order` one by one: each takes the lowest free slot."""
    for n in list(engine.known()):
        engine.release(n)
    engine.ensure(order)
    return slots(engine)


@pytest.mark.parametrize("order", [["s0", "s1", "s2"], ["s2", "s0", "s1"], ["s1", "s2", "s0"], ["s1", "s0", "s2"]],
                         ids=["by-name", "rotated", "rotated-twice", "pair-around-another"])
def test_a_blend_is_the_same_image_whatever_slots_its_adapters_hold(engine, order):
    """Each request runs after loading the adapters in `order` (slots taken lowest first); the images equal the
    by-name case's byte for byte. The pair's two adapters sit apart or swapped with an adapter of weight 0
    between them in some cases."""
    requests = {"blend": ImageRequest("a cat", {"s0": 0.6, "s1": -0.4, "s2": 0.7}, None, 5, 2, 64, 64),
                "pair": ImageRequest("a dog", {"s1": 0.5, "s2": 0.5}, None, 3, 2, 64, 64)}
    expected = engine.__dict__.setdefault("_by_name", {})
    for key, request in requests.items():
        unet = loaded_in(engine, order)["unet"]
        assert sorted(unet, key=unet.get) == order  # the loads put the adapters where this case wants them
        got = engine.run([request])[0]
        expected.setdefault(key, got)
        assert got == expected[key], f"{key}: the PNG differs from the one made with the adapters in name order"
