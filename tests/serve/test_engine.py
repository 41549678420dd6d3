"""One replica's work without Ray (fdlora.serve.engine): mixed-adapter batches as per-prompt calls, split only by
shape and slot count, each image equal to its request run alone; release and reload; allowlist only."""

from __future__ import annotations

import pytest
from support import serving

from fdlora.config import validate
from fdlora.errors import ConfigError
from fdlora.fixtures import tiny_pipeline as tiny
from fdlora.fixtures.localcache import populate
from fdlora.serve import ImageRequest, RequestError
from fdlora.serve.engine import Engine


@pytest.fixture(scope="module")
def engine(pytestconfig):
    pipe = tiny.sd15()
    names = {}
    for i in range(3):
        populate(pytestconfig.fakehub.root, f"serve-engine/l{i}", tiny.random_lora_files(pipe, seed=40 + i))
        names[f"e{i}"] = f"serve-engine/l{i}"
    cfg = validate({"pipeline": "tiny-sd15", "device": "cpu", "steps": 2, "size": 64,
                    "adapters": [{"name": n, "source": r} for n, r in names.items()],
                    "serve": {"adapters_per_replica": 2, "max_steps": 4, "max_size": 128}})
    return Engine(cfg)


def R(adapters, seed=0, steps=2, size=64, prompt="a cat"):
    return ImageRequest(prompt, adapters, None, seed, steps, size, size)


def test_plan_groups_by_shape_and_splits_only_past_the_slots(engine, monkeypatch):
    reqs = [R({"e0": 1}), R({"e1": 1}), R({}, size=72), R({"e0": 0.5, "e1": 1}), R({"e2": 1}), R({"e2": 1}, steps=3)]
    monkeypatch.setattr(engine, "known", lambda: ["e0", "e1"])  # resident: the call naming both runs first
    assert engine.plan(reqs) == [[0, 1, 3], [2], [4], [5]]  # e0+e1 fill the 2 slots; e2 starts a new call
    monkeypatch.setattr(engine, "known", lambda: [])  # nothing resident: fewest loads first, e2 loaded once for two
    assert engine.plan(reqs) == [[2], [4], [5], [0, 1, 3]]


def test_plan_packs_first_fit_so_a_later_request_joins_an_earlier_call(engine, monkeypatch):
    monkeypatch.setattr(engine, "known", lambda: [])
    reqs = [R({"e0": 1}), R({"e1": 1, "e2": 1}), R({"e0": 0.5}), R({"e0": 1, "e1": 1, "e2": 1})]
    assert engine.plan(reqs) == [[0, 2], [1], [3]]  # two calls for three requests; three adapters go alone


def test_plan_caps_a_call_at_max_call_requests(engine, monkeypatch):
    monkeypatch.setattr(engine, "known", lambda: [])
    monkeypatch.setattr(engine, "max_call", 2)
    reqs = [R({"e0": 1}), R({"e0": 0.5}), R({"e1": 1}), R({"e0": 1}), R({})]
    assert engine.plan(reqs) == [[4], [0, 1], [2, 3]]  # the second e0 call: the first was full (no loads first)


def test_max_call_defaults_to_max_batch_and_is_validated():
    base = {"pipeline": "tiny-sd15", "serve": {"max_batch": 16}}
    assert validate(base).serve["max_call"] is None
    assert validate({**base, "serve": {"max_batch": 16, "max_call": 8}}).serve["max_call"] == 8
    with pytest.raises(ConfigError, match="max_call"):
        validate({**base, "serve": {"max_call": 0}})


def test_a_mixed_batch_equals_each_request_alone(engine):
    reqs = [R({"e0": 0.8}, seed=1), R({"e1": -0.6}, seed=2, prompt="a dog"), R({}, seed=3),
            R({"e0": 0.3, "e1": 0.9}, seed=4), R({"e2": 1.2}, seed=5), R({"e0": 0.8}, seed=1, size=72)]
    calls, mixed, batches = engine.calls, engine.mixed, engine.batches
    batch = engine.run(reqs)
    assert engine.calls - calls == 3  # [0..3], [4] (a third adapter past 2 slots), [5] (another size)
    assert engine.batches - batches == 1
    assert engine.mixed - mixed == 1  # e0, e1, none and a blend in one per-prompt call
    assert {(4, 4, 2), (1, 1, 1)} <= engine.kinds  # (images, adapter sets, adapters): the per-prompt call, the others
    alone = [engine.run([r])[0] for r in reqs]
    for b, a in zip(batch, alone):
        d = abs(serving.decode_png(b) - serving.decode_png(a))
        assert d.max() <= 1 and (d > 0).mean() < 0.01
    assert abs(serving.decode_png(batch[0]) - serving.decode_png(batch[2])).max() > 2  # adapters act


def test_release_then_reload_and_the_allowlist(engine):
    before = engine.run([R({"e1": 0.7}, seed=9)])[0]
    engine.release("e1")
    assert "e1" not in engine.known()
    assert engine.run([R({"e1": 0.7}, seed=9)])[0] == before  # loaded again from the cache, same image
    with pytest.raises(RequestError):
        engine.ensure(["../e1"])


def test_text_engine_batches_mixed_adapters_like_each_alone(pytestconfig):
    from fdlora.serve.engine import TextEngine, make_engine
    from fdlora.serve.schema import TextRequest, parse_text

    repos = serving.publish_text_adapters(pytestconfig.fakehub.root)
    cfg = validate({"model": "tiny-llama", "device": "cpu",
                    "adapters": [{"name": n, "source": r} for n, r in repos.items()],
                    "serve": {"adapters_per_replica": 4, "max_steps": 8}})
    eng = make_engine(cfg)
    assert isinstance(eng, TextEngine)
    prompt = (1, 17, 33, 90)
    reqs = [TextRequest(prompt, a, 6) for a in ({"t0": 1.0}, {}, {"t1": 0.7, "t2": 0.5}, {"t2": 1.0})]
    reqs.append(TextRequest((1, 5), {"t0": 1.0}, 6))  # another length: its own call
    calls = eng.calls
    batch = eng.run(reqs)
    assert eng.calls - calls == 2 and eng.mixed >= 1 and eng.oom_retries == 0  # the counters a replica's stats read
    alone = [eng.run([r])[0] for r in reqs]
    assert batch == alone
    assert batch[0] != batch[1] or batch[3] != batch[1]  # adapters change the tokens
    with pytest.raises(RequestError):
        eng.run([TextRequest((300,), {}, 2)])  # past the vocabulary: a 422, not an IndexError
    with pytest.raises(RequestError):
        parse_text({"input_ids": [1], "adapters": {"../t0": 1}}, eng.limits)


def test_blend_partners_stay_within_the_replica_slots(engine):
    """Adapters a blend names besides the routed one load outside Ray's LRU: at most adapters_per_replica of them
    stay (least recently used deleted), held ones stay whatever happens, and a dropped one reloads when needed."""
    for n in list(engine.known()):
        engine.release(n)
    engine.hold("e0")
    first = engine.run([R({"e1": 0.5, "e2": 0.5}, seed=3)])[0]
    assert set(engine.known()) == {"e0", "e1", "e2"}
    engine.run([R({"e0": 1.0}, seed=1)])
    assert set(engine.known()) == {"e0", "e1", "e2"}  # 2 partners fit the 2 slots
    engine.release("e0")
    engine.run([R({"e0": 0.5, "e1": 0.5}, seed=1)])  # e0 is a partner now: e2, the least recent, goes
    assert set(engine.known()) == {"e0", "e1"} and list(engine.partners) == ["e0", "e1"]
    loads = engine.loads
    assert engine.run([R({"e1": 0.5, "e2": 0.5}, seed=3)])[0] == first  # e2 back from the caches, same image
    assert engine.loads == loads + 1 and set(engine.known()) == {"e1", "e2"}


def test_plan_serves_every_request_once_within_the_slots_for_random_batches(engine, monkeypatch):
    import random

    rng = random.Random(7)
    for _ in range(200):
        known = rng.sample(["e0", "e1", "e2"], rng.randrange(3))
        monkeypatch.setattr(engine, "known", lambda known=known: known)
        reqs = [R({f"e{k}": 1 for k in rng.sample(range(3), rng.randrange(3))}, steps=rng.choice([2, 3]))
                for _ in range(rng.randrange(1, 9))]
        calls = engine.plan(reqs)
        assert sorted(i for c in calls for i in c) == list(range(len(reqs)))
        for c in calls:
            assert len({reqs[i].shape for i in c}) == 1
            assert len({n for i in c for n in reqs[i].adapters}) <= engine.slots or len(c) == 1


def test_a_calls_images_are_encoded_side_by_side_to_the_same_bytes(monkeypatch):
    """A call's PNGs are encoded concurrently (the next call waits for the slowest image, not the sum), each to the
    bytes the serial encoder gives: two encodings must be under way at once to pass the barrier."""
    import threading

    import numpy as np
    from PIL import Image

    from fdlora.serve import engine as eng

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(4)]
    serial = [eng.png(im) for im in images]
    monkeypatch.setattr(eng.os, "cpu_count", lambda: 4)
    eng._encoder.cache_clear()
    both = threading.Barrier(2, timeout=20)
    real = eng.png

    def png(image):
        both.wait()  # raises BrokenBarrierError if no second encoding starts meanwhile
        return real(image)

    monkeypatch.setattr(eng, "png", png)
    try:
        assert eng.encode(images) == serial
    finally:
        eng._encoder.cache_clear()
