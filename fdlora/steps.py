"""Work done in pieces: a generator that yields where its caller may stop and let other work run, and returns its
result (`drain` runs one to its end without stopping).

A prefetch's publication (fdlora.runtime.background) is such a generator: it holds the pipeline's lock only while a
piece runs, so a step waiting for the lock waits for one piece (~1-2 ms), not for the whole publication (~25 ms for
an SDXL LoRA on an H100 host, which delayed a serving step by a third). Pieces before `COMMIT` only read the model
(checks, write tables); the piece after it changes the model at once, under the lock, and cannot be cancelled.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

T = TypeVar("T")
Steps = Generator[Any, None, T]  # yields None (a place to stop) or COMMIT; returns the result
COMMIT = "commit"  # yielded once, right before the part that changes the model; no stop after it
EVERY = 64  # modules per piece where a load's checks and writes stop (~0.3 ms of Python on an H100 host)


def drain(steps: Steps[T]) -> T:
    """Run `steps` (started or not) to its end in one go; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
