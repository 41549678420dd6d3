"""≥ 200 seeded malformed HTTP requests against the live `fdlora serve` (tests/support/serving.py: a real local
Ray cluster): bad JSON, wrong types, huge numbers, unknown adapters, path-traversal names, oversized bodies,
wrong methods, paths and content types. Each must be a 4xx whose body is one line of JSON, `{"error": ...}`,
that never echoes an adapter name the server does not offer; the server answers a valid request the same
way afterwards. The same cases (x FDLORA_RELIABILITY_SCALE x 10) also go through the schema in-process.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from .conftest import scaled

pytest.importorskip("ray.serve")
from support import serving  # noqa: E402

from fdlora.serve.schema import MAX_BODY_BYTES, Limits, RequestError, parse_body  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
GOOD = {"prompt": "a cat", "adapters": {"a1": 0.7}, "seed": 1, "num_inference_steps": 2, "height": 64, "width": 64}
SECRET_NAMES = ["../../etc/passwd", "/etc/passwd", "..\\..\\windows\\win.ini", "a1/../a2", "~root/.ssh/id_rsa",
                "serve-tests/lora-1", "file:///etc/shadow", "a1\x00.safetensors", "%2e%2e%2fetc", "ＡＢＣ-lora",
                "x" * 5000, "a1 ", " a1", "A1", "a1\n", "$(rm -rf /)", "<script>alert(1)</script>"]


def _j(d) -> bytes:
    return json.dumps(d).encode()


def cases(rng: random.Random, n: int) -> list[tuple[str, dict]]:
    """(kind, request) pairs; request keys: method, path, content_type, body."""
    def req(body: bytes, method="POST", path="/v1/images", content_type="application/json"):
        return dict(method=method, path=path, content_type=content_type, body=body)

    def field(name, value):
        return req(_j({**GOOD, name: value}))

    makers = {
        "bad-json": lambda: req(rng.choice([
            b"", b"{", b"{\"prompt\": \"a cat\"", b"[1,2", b"nul", b"{'prompt': 'a'}", b"{\"prompt\": \"a\"} x",
            b"\xff\xfe\x00{", b"{\"prompt\": NaN}", b"{\"prompt\": \"a\", \"seed\": Infinity}", b"\x00" * 10,
            b"{\"prompt\": \"\\ud800\"" + b"}", ("[" * rng.randrange(2000, 20000)).encode(),
            b"{\"seed\": " + b"9" * rng.randrange(5000, 9000) + b"}", b"{\"prompt\":\"a\",}"])),
        "not-an-object": lambda: req(_j(rng.choice([[], [GOOD], "a cat", 1, None, True, 1.5]))),
        "wrong-type": lambda: field(*rng.choice([
            ("prompt", rng.choice([1, None, [], {}, True, 1.5, ["a", "b"]])),
            ("adapters", rng.choice([[], "a1", 1, None, ["a1"], True])),
            ("seed", rng.choice([1.5, "1", None, True, [], {}])),
            ("num_inference_steps", rng.choice([2.0, "2", None, False, [2]])),
            ("height", rng.choice([64.0, "64", None, True])), ("width", rng.choice([64.5, "x", []])),
            ("negative_prompt", rng.choice([1, [], {}, True])),
            ("response_format", rng.choice(["gif", 1, None, "PNG", ""]))])),
        "bad-weight": lambda: field("adapters", {"a1": rng.choice(["0.5", None, True, [], {}, 1e300, -1e300, 101,
                                                                     10**30])}),
        "huge-number": lambda: field(*rng.choice([
            ("seed", rng.choice([2**63, 2**64, 10**30, -1, -(2**70)])),
            ("num_inference_steps", rng.choice([0, -1, 5, 10**9, 2**63])),
            ("height", rng.choice([0, 7, 65, 4096, 10**12, -64])), ("width", rng.choice([1, 130, 2**40]))])),
        "empty-or-long-prompt": lambda: field("prompt", rng.choice(["", "   ", "a" * 2001, "a\x00b"])),
        "unknown-field": lambda: req(_j({**GOOD, rng.choice(["guidance_scale", "model", "source", "__class__",
                                                             "adapter", "path", "weight_name"]): "x"})),
        "unknown-adapter": lambda: field("adapters", {rng.choice(SECRET_NAMES): 1.0}),
        "too-many-adapters": lambda: field("adapters", {f"a{i}": 0.1 for i in range(serving.N_ADAPTERS)}),
        "missing-prompt": lambda: req(_j({k: v for k, v in GOOD.items() if k != "prompt"})),
        "oversized": lambda: req(_j({**GOOD, "prompt": "a" * rng.randrange(MAX_BODY_BYTES, 2 * MAX_BODY_BYTES)})),
        "wrong-method": lambda: req(b"" if rng.random() < 0.5 else _j(GOOD),
                                    method=rng.choice(["GET", "PUT", "DELETE", "PATCH"])),
        "wrong-path": lambda: req(_j(GOOD), path=rng.choice(["/v1/image", "/v1/images/x", "/v2/images", "/",
                                                             "/v1/adapters/../../etc/passwd", "/%2e%2e/etc/passwd",
                                                             "/v1/images/../../../x", "/admin"]),
                                  method=rng.choice(["POST", "GET"])),
        "post-adapters": lambda: req(_j(GOOD), path="/v1/adapters"),
        "content-type": lambda: req(_j(GOOD), content_type=rng.choice([
            None, "text/plain", "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
            "application/jsonx", "application/xml", "image/png", ""])),
    }
    kinds = sorted(makers)
    return [(k, makers[k]()) for k in (kinds[i % len(kinds)] for i in range(n))]


def check_refusal(kind: str, r: dict, status: int, body: bytes) -> None:
    assert 400 <= status < 500, f"{kind}: {status} {body[:200]!r} for {r['method']} {r['path']}"
    text = body.decode("utf-8")
    assert text.count("\n") <= 1 and text.strip(), f"{kind}: not one line: {text[:200]!r}"
    reason = json.loads(text)["error"]
    assert isinstance(reason, str) and reason and "\n" not in reason and "Traceback" not in reason
    if kind == "unknown-adapter":
        (name,) = json.loads(r["body"])["adapters"]
        assert (len(name) < 5 or name not in reason) and "passwd" not in reason and "serve-tests" not in reason, \
            reason


def test_malformed_http_requests_are_4xx_with_one_line(pytestconfig, figures):
    live = serving.live(str(pytestconfig.fakehub.root))
    n = max(scaled(224), 200)
    per_kind, statuses = Counter(), Counter()
    for kind, r in cases(random.Random(28), n):
        status, _, body = serving.post(live.url, r["body"], method=r["method"], path=r["path"],
                                       content_type=r["content_type"], timeout=60)
        check_refusal(kind, r, status, body)
        per_kind[kind] += 1
        statuses[status] += 1
    assert sum(per_kind.values()) >= 200
    ok, _, png = serving.post(live.url, _j(GOOD))  # still serving, and right
    assert ok == 200 and png[:4] == b"\x89PNG"
    figures["fuzzed_requests"] = (figures.get("fuzzed_requests") or 0) + n
    figures["per_kind"].update({f"http:{k}": v for k, v in per_kind.items()})
    figures["outcomes"].update({f"http:{s}": v for s, v in statuses.items()})
    print(f"\n{n} malformed requests through the live server: {dict(statuses)}")


def test_the_schema_refuses_the_same_cases_in_process():
    limits = Limits(tuple(f"a{i}" for i in range(serving.N_ADAPTERS)), max_adapters=serving.SLOTS, max_steps=4,
                    max_size=128, default_steps=2, default_size=64)
    n = 0
    for kind, r in cases(random.Random(2800), scaled(2000)):
        if r["method"] != "POST" or r["path"] != "/v1/images":
            continue  # routing is FastAPI's, checked live above
        with pytest.raises(RequestError) as e:
            parse_body(r["body"], r["content_type"], limits)
        assert 400 <= e.value.status < 500 and "\n" not in str(e.value), (kind, str(e.value))
        n += 1
    assert n >= 1000
    assert parse_body(_j(GOOD), "application/json; charset=utf-8", limits).adapters == {"a1": 0.7}


def test_the_text_schema_refuses_malformed_generate_requests():
    """POST /v1/generate (Transformers models): the same guarantees for its fields, in-process."""
    from fdlora.serve.schema import parse_text

    limits = Limits(("t0", "t1"), max_adapters=2, max_steps=8, vocab=256)
    rng = random.Random(2801)
    bad_values = {
        "input_ids": [None, "1 2", [], [1.5], [-1], [256], [True], [[1]], list(range(3000)), {"0": 1}, [2**70]],
        "max_new_tokens": [0, 9, -1, 1.0, "8", None, True, 10**30],
        "adapters": [[], "t0", {"t9": 1}, {"../t0": 1}, {"t0": "1"}, {"t0": float("inf")}, {"t0": 1, "t1": 1, "x": 1}],
    }
    n = 0
    for _ in range(scaled(300)):
        body = {"input_ids": [1, 2, 3]}
        key = rng.choice([*bad_values, "unknown"])
        if key == "unknown":
            body[rng.choice(["prompt", "temperature", "model"])] = 1
        else:
            body[key] = rng.choice(bad_values[key])
        with pytest.raises(RequestError) as e:
            parse_body(json.dumps(body).encode(), "application/json", limits, parse_text)
        assert 400 <= e.value.status < 500 and "\n" not in str(e.value)
        n += 1
    assert n >= 300
    assert parse_text({"input_ids": [1, 255], "adapters": {"t1": -0.5}}, limits).input_ids == (1, 255)
