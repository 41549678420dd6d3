"""Per-step LoRA strengths in a pipeline call: `pipe(..., fd_lora_schedule={"style": [0.0, 1.0]})`.

A schedule maps adapter names to a strength per denoising step: a number (constant), a sequence of keyframes
spread evenly over the steps and linearly interpolated between them ([1.0, 0.0] fades out), or a function
`(step, num_steps) -> strength`. The adapters it names are the active set for the call; before each step the
weights are one set_adapters (a table write; every cached layer re-merges in one launch at the next forward:
fdlora.layers.fastpath.remerge), so a keyframed strength costs what a slider moved every step costs and nothing more.
It rides on diffusers' own `callback_on_step_end` (a callback the caller passes still runs, after ours) and the
active set of before the call comes back after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fdlora.errors import FdLoraError

Strength = float | Sequence[float] | Callable[[int, int], float]


def strength_at(spec: Strength, step: int, steps: int) -> float:
    """The strength of `spec` at `step` of `steps` (0-based)."""
    if callable(spec):
        return float(spec(step, steps))
    if isinstance(spec, (int, float)):
        return float(spec)
    keys = [float(v) for v in spec]
    if not keys:
        raise FdLoraError("an fd_lora_schedule entry is an empty sequence; give at least one strength.")
    if len(keys) == 1 or steps <= 1:
        return keys[0]
    at = step / (steps - 1) * (len(keys) - 1)
    i = min(int(at), len(keys) - 2)
    return keys[i] + (keys[i + 1] - keys[i]) * (at - i)


def check(schedule: Mapping[str, Strength]) -> None:
    for name, spec in schedule.items():
        ok = callable(spec) or isinstance(spec, (int, float)) or (
            isinstance(spec, Sequence) and not isinstance(spec, str) and all(isinstance(v, (int, float)) for v in spec))
        if not isinstance(name, str) or not ok:
            raise FdLoraError(f"fd_lora_schedule[{name!r}] = {spec!r}: give an adapter name and a number, a list of "
                              "keyframe strengths, or a function (step, num_steps) -> strength.")


def step_callback(pipe: Any, schedule: Mapping[str, Strength], steps: int, user: Callable | None) -> Callable:
    """A `callback_on_step_end` that sets the strengths of the next step, then calls the caller's callback."""
    names = list(schedule)

    def callback(p, step: int, timestep, callback_kwargs: dict) -> dict:
        n = getattr(p, "num_timesteps", None) or steps
        if step + 1 < n:
            pipe.set_adapters(names, [strength_at(schedule[k], step + 1, n) for k in names])
        return user(p, step, timestep, callback_kwargs) if user is not None else callback_kwargs

    return callback
