"""The core install, simulated: with this folder on PYTHONPATH, every optional dependency of fd-lora is
unimportable in the process and its children (a meta-path finder ahead of every other), so a test run
sees exactly what `pip install fd-lora` (no extras) gives, without a second multi-GB torch install.

Which packages are optional comes from fdlora.extras.EXTRA_OF's keys (copied here: sitecustomize runs
before fdlora can be imported) plus the heavy things they pull in. scripts/test.sh runs the pure-torch
tests this way; tests/test_core_install.py checks that the list matches pyproject.toml.
"""

import importlib.abc
import sys

BLOCKED = frozenset({"diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "torchao", "gguf", "gradio",
                     "gradio_client", "ray", "fastapi", "starlette", "PIL", "tokenizers", "sentencepiece"})


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in fd-lora's core install)", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
