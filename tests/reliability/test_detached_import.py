"""fdlora.extras.detached_import: a library that keeps a frame of its own import (here a module that stores
sys._getframe() at import time) keeps none of the importing call's locals, so a model passed to that call is freed
by `del` alone (the collector off)."""

from __future__ import annotations

import gc
import importlib
import sys
import weakref

import pytest

from fdlora.extras import detached_import

SOURCE = "import sys\nKEPT = sys._getframe()\n"


@pytest.fixture
def keeper(tmp_path, monkeypatch):
    name = f"frame_keeper_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


class Model:
    pass


def use(model: Model, module: str, how) -> None:
    how(module)  # `model` is a local of this frame, as a user's model is of inject's


@pytest.mark.parametrize("detached", [True, False], ids=["detached", "plain-import (the leak it prevents)"])
def test_a_kept_import_frame_does_not_keep_the_callers_locals(keeper, detached):
    gc.collect()
    gc.disable()
    try:
        model = Model()
        ref = weakref.ref(model)
        use(model, keeper, detached_import if detached else importlib.import_module)
        del model
        assert (ref() is None) == detached
        assert sys.modules[keeper].KEPT is not None  # the library did keep its frame
    finally:
        gc.enable()


def test_errors_reach_the_caller(keeper):
    with pytest.raises(ModuleNotFoundError):
        detached_import("no_such_module_fdlora_test")
    assert detached_import(keeper) is sys.modules[keeper]
