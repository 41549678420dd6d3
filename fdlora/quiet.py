"""Keep known third-party noise off stderr: `import fdlora` and the `fdlora` commands print only what fd-lora says.

Importing diffusers next to a CPU build of torchao, bitsandbytes or a torchvision-less transformers logs warnings that
say nothing about the user's work (a CUDA-only torchao library that cannot load on this machine, a torch deprecation
torchao triggers, bitsandbytes' hint about its CPU kernels, a fallback to PIL image processors). Each is matched by
the logger that emits it and a fragment of its message, so every other record of those loggers still shows.

A record passes anyway when `FDLORA_VERBOSE=1`, or when the user's logging asks for it: the emitting logger's
effective level set to INFO or lower (for example `logging.getLogger("torchao").setLevel(logging.INFO)`, or
`TORCH_LOGS` for torch's loggers).
"""

from __future__ import annotations

import logging
import os

VERBOSE_VAR = "FDLORA_VERBOSE"

# logger name -> message fragments dropped from it (a record is dropped when its message contains one of them)
KNOWN: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load", "Skipping import of cpp extensions"),  # CUDA-only _C*.so on a CPU torch
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),  # torchao's register_constant
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    # bitsandbytes' hint on CPUs with AVX512-BF16: its optional `kernels` package for 4-bit CPU matmuls
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "transformers.utils.import_utils": ("requires torchvision (not installed)",),
    # `fdlora plan` casts empty config-built models to see their dtypes; no module of them is kept in float32
    "diffusers.models.modeling_utils": ("should be kept in float32: []",),
}


def verbose() -> bool:
    """`FDLORA_VERBOSE=1`: third-party warnings reach stderr as their libraries log them."""
    return os.environ.get(VERBOSE_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class KnownNoise(logging.Filter):
    """Drops a record of one logger whose message contains one of the known fragments."""

    def __init__(self, logger: str, fragments: tuple[str, ...]):
        super().__init__()
        self.logger, self.fragments = logger, fragments

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or verbose():
            return True
        if logging.getLogger(record.name).getEffectiveLevel() <= logging.INFO:  # the user asked for this logger
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not any(f in message for f in self.fragments)


_FILTERS: dict[str, KnownNoise] = {}


def install() -> None:
    """Attach the filters to the known loggers (once; loggers exist by name before their libraries import)."""
    for name, fragments in KNOWN.items():
        if name not in _FILTERS:
            _FILTERS[name] = KnownNoise(name, fragments)
            logging.getLogger(name).addFilter(_FILTERS[name])


def uninstall() -> None:
    """Remove the filters (tests, or a caller that wants every record back without the environment variable)."""
    for name, f in _FILTERS.items():
        logging.getLogger(name).removeFilter(f)
    _FILTERS.clear()


install()
