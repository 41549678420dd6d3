"""The HTTP request schema of `fdlora serve`, checked with the standard library only (no FastAPI models), so
every malformed request gets a 4xx whose body is one line, `{"error": "<reason>"}`, and never a 500.

    POST /v1/images   Content-Type: application/json
    {"prompt": "a cat",                  required, 1..MAX_PROMPT characters
     "negative_prompt": "blurry",        optional
     "adapters": {"pixel": 0.8},         optional; names from the config's allowlist, finite weights
     "seed": 0, "num_inference_steps": 20, "height": 512, "width": 512,
     "response_format": "png"}           "png" (image/png body) or "json" ({"image": base64 PNG, ...})

A Transformers model (`model:` config) is served at `POST /v1/generate` instead, greedy decoding:

    {"input_ids": [1, 15, 27],           required, 1..MAX_TOKENS token ids of the model's vocabulary
     "adapters": {"chat": 1.0},          as above
     "max_new_tokens": 16}               1..serve.max_steps
    -> {"output_ids": [...], "adapters": ..., "replica": ...}   (up to and including the first EOS)

A reason never echoes a caller's adapter name or anything about the server's files: an adapter outside the
allowlist gets the same refusal whatever it looks like (`../../etc/passwd`, an absolute path, a repo id).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import FdLoraError

MAX_BODY_BYTES = 64 * 1024
MAX_PROMPT = 2000
MAX_WEIGHT = 100.0
MAX_SEED = 2**63 - 1
MAX_TOKENS = 2048
TEXT_KEYS = ("input_ids", "adapters", "max_new_tokens")
KEYS = ("prompt", "negative_prompt", "adapters", "seed", "num_inference_steps", "height", "width", "response_format")
FORMATS = ("png", "json")


class RequestError(FdLoraError, ValueError):
    """A request the server refuses: `status` is the HTTP status (4xx), the message one line."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What a request may ask for; from the config's `serve:` section."""

    allowed: tuple[str, ...]  # adapter names the config names (the allowlist)
    max_adapters: int = 4  # per request: all of them must be resident at once
    max_steps: int = 50
    max_size: int = 1024
    default_steps: int = 20
    default_size: int = 512
    vocab: int | None = None  # models: token ids must be below it

    @classmethod
    def from_config(cls, cfg) -> Limits:
        s = cfg.serve or {}
        tiny = cfg.base.startswith("tiny-")
        max_steps, max_size = s.get("max_steps", 50), s.get("max_size", 1024)
        vocab = 256 if cfg.base == "tiny-llama" else None  # a Hub model's vocabulary is checked by its replica
        return cls(tuple(a.name for a in cfg.adapters), s.get("adapters_per_replica", 4), max_steps, max_size,
                   min(cfg.steps, max_steps), min(cfg.size or (64 if tiny else 512), max_size), vocab)


@dataclass(frozen=True)
class TextRequest:
    input_ids: tuple[int, ...]
    adapters: dict[str, float] = field(default_factory=dict)
    max_new_tokens: int = 16

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    primary = property(lambda self: ImageRequest.primary.fget(self))

    @property
    def shape(self) -> tuple[int, int]:
        """Requests that share one generate call: same prompt length (no padding) and new-token budget."""
        return (len(self.input_ids), self.max_new_tokens)


def parse_text(data: Any, limits: Limits) -> TextRequest:
    """A TextRequest from parsed JSON or a dict; RequestError(422) otherwise."""
    if not isinstance(data, dict):
        raise RequestError(422, f"request body must be a JSON object, got {type(data).__name__}")
    if any(k not in TEXT_KEYS for k in data):
        raise RequestError(422, f"unknown field (allowed: {', '.join(TEXT_KEYS)})")
    ids = data.get("input_ids")
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_TOKENS:
        raise RequestError(422, f"input_ids: required, a list of 1 to {MAX_TOKENS} token ids")
    hi = (limits.vocab or 2**31) - 1
    ids = tuple(_int("input_ids[]", t, 0, hi) for t in ids)
    adapters = _adapters(data.get("adapters", {}), limits)
    n = _int("max_new_tokens", data.get("max_new_tokens", min(16, limits.max_steps)), 1, limits.max_steps)
    return TextRequest(ids, adapters, n)


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    adapters: dict[str, float] = field(default_factory=dict)
    negative_prompt: str | None = None
    seed: int = 0
    num_inference_steps: int = 20
    height: int = 512
    width: int = 512
    response_format: str = "png"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def primary(self) -> str | None:
        """The adapter that routes the request (Ray Serve's multiplexed model id): the heaviest, then by name."""
        if not self.adapters:
            return None
        return min(self.adapters, key=lambda n: (-abs(self.adapters[n]), n))

    @property
    def shape(self) -> tuple[int, int, int]:
        """Requests that can share one pipeline call: same steps and size (adapters, seeds, prompts may differ)."""
        return (self.num_inference_steps, self.height, self.width)


def _one_line(s: str) -> str:
    return " ".join(str(s).split())[:300]


def parse_body(body: bytes, content_type: str | None, limits: Limits, parser=None) -> ImageRequest:
    """An ImageRequest (or what `parser` makes: parse_text) from raw HTTP bytes; RequestError (415 / 413 / 400 /
    422) otherwise."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise RequestError(415, "Content-Type must be application/json")
    if len(body) > MAX_BODY_BYTES:
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(400, "request body is not UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, "request body nests too deeply") from None
    except (ValueError, OverflowError) as e:
        raise RequestError(400, f"request body is not valid JSON ({_one_line(e)[:80]})") from None
    return (parser or parse)(data, limits)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse(data: Any, limits: Limits) -> ImageRequest:
    """An ImageRequest from parsed JSON (or a Python dict from the handle API); RequestError(422) otherwise."""
    if not isinstance(data, dict):
        raise RequestError(422, f"request body must be a JSON object, got {type(data).__name__}")
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise RequestError(422, f"unknown field (allowed: {', '.join(KEYS)})")
    if "prompt" not in data:
        raise RequestError(422, "prompt: required")
    prompt = _text("prompt", data["prompt"])
    neg = None if data.get("negative_prompt") is None else _text("negative_prompt", data["negative_prompt"])
    adapters = _adapters(data.get("adapters", {}), limits)
    seed = _int("seed", data.get("seed", 0), 0, MAX_SEED)
    steps = _int("num_inference_steps", data.get("num_inference_steps", limits.default_steps), 1, limits.max_steps)
    h = _int("height", data.get("height", limits.default_size), 8, limits.max_size)
    w = _int("width", data.get("width", limits.default_size), 8, limits.max_size)
    for name, v in (("height", h), ("width", w)):
        if v % 8:
            raise RequestError(422, f"{name}: must be a multiple of 8, got {v}")
    fmt = data.get("response_format", "png")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise RequestError(422, f"response_format: expected one of {', '.join(FORMATS)}")
    return ImageRequest(prompt, adapters, neg, seed, steps, h, w, fmt)


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise RequestError(422, f"{name}: expected a string, got {type(v).__name__}")
    if not v.strip() and name == "prompt":
        raise RequestError(422, "prompt: must not be empty")
    if len(v) > MAX_PROMPT:
        raise RequestError(422, f"{name}: longer than {MAX_PROMPT} characters")
    if "\x00" in v:
        raise RequestError(422, f"{name}: contains a NUL character")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # JSON allows "\ud800"; a tokenizer does not
        raise RequestError(422, f"{name}: not valid Unicode (a lone surrogate escape)") from None
    return v


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(422, f"{name}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise RequestError(422, f"{name}: expected an integer from {lo} to {hi}")
    return v


def _adapters(v: Any, limits: Limits) -> dict[str, float]:
    if not isinstance(v, dict):
        raise RequestError(422, 'adapters: expected an object {"name": weight}, got ' + type(v).__name__)
    if len(v) > limits.max_adapters:
        raise RequestError(422, f"adapters: at most {limits.max_adapters} per request")
    out = {}
    for name, w in v.items():
        if name not in limits.allowed:  # decided from the string alone; the name is not echoed
            offered = ", ".join(limits.allowed) or "none"
            raise RequestError(422, f"adapters: not an adapter this server offers; choose from: {offered}")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise RequestError(422, f"adapters.{name}: expected a number, got {type(w).__name__}")
        try:
            w = float(w)
        except OverflowError:
            w = math.inf
        if not math.isfinite(w) or abs(w) > MAX_WEIGHT:
            raise RequestError(422, f"adapters.{name}: expected a finite weight from -{MAX_WEIGHT:g} to "
                                    f"{MAX_WEIGHT:g}")
        out[name] = w
    return out


def error_body(reason: str) -> bytes:
    return (json.dumps({"error": _one_line(reason)}) + "\n").encode()
