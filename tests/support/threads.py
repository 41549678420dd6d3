"""Run callables on threads and re-raise the first failure in the caller (tests/reliability's thread tests)."""

from __future__ import annotations

import threading


def run_threads(targets) -> None:
    """Each callable on its own thread; every thread joined (120 s each, a hang fails), then the first error raised."""
    errors: list[BaseException] = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guard(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]
