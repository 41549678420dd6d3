"""fd-lora on diffusers pipelines (see `.pipeline`; its loading part in `.loading`): the mixin, the import hook
that attaches `pipe.load_fd_lora`, the LoRA family of a pipeline read from its diffusers mixin (`.family`), the
model-level loader (`.model`), the per-call `scale` hooks (`.scale`), per-family target tables,
`from_diffusers` and tiny pipelines for tests and demos."""

from fdlora.integrations.diffusers.convert import from_diffusers
from fdlora.integrations.diffusers.loading import DEFAULT_RANK, DEFAULT_SLOTS
from fdlora.integrations.diffusers.pipeline import FdLoraPipelineMixin, block_weight_fn, enable_fd_lora, load_fd_lora

__all__ = ["DEFAULT_RANK", "DEFAULT_SLOTS", "FdLoraPipelineMixin", "block_weight_fn", "enable_fd_lora",
           "from_diffusers", "load_fd_lora"]
