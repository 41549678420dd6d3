"""Every error fd-lora raises on purpose. Each message says what failed, why, and what to do."""

from __future__ import annotations


class FdLoraError(Exception):
    """Base class: catch this to handle any fd-lora error."""


class AdapterShapeError(FdLoraError, ValueError):
    """An adapter's tensors do not fit the module they target."""


class CapacityError(FdLoraError, ValueError):
    """A bank is full (slots) or too narrow (rank); the message names the setting to raise."""


class UnknownAdapterError(FdLoraError, KeyError):
    """An adapter name that is not loaded."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DuplicateAdapterError(FdLoraError, ValueError):
    """An adapter name that is already loaded."""


class AdapterNameError(FdLoraError, ValueError):
    """An adapter name fd-lora cannot use: not a non-empty string, or a reserved name such as "__base__"."""


class TargetError(FdLoraError, ValueError):
    """Targets that match no module, or modules fd-lora cannot wrap."""


class BackendUnavailableError(FdLoraError, RuntimeError):
    """The requested kernel backend cannot run this problem; the message lists every backend's reason."""


class NonFiniteError(FdLoraError, ValueError):
    """NaN or Inf in adapter weights while validation is on."""


class CompiledModelError(FdLoraError, RuntimeError):
    """An operation that would reshape buffers of a model that is compiled or captured."""


class FormatError(FdLoraError, ValueError):
    """A file or state dict whose format is unknown, unsupported or malformed."""


class UnsupportedFeatureError(FdLoraError, NotImplementedError):
    """A LoRA variant fd-lora does not implement yet (for example DoRA)."""


class ResolveError(FdLoraError, OSError):
    """A source that cannot be found or fetched: Hub repo, revision, file, local path, or an offline cache miss."""


class SaveError(FdLoraError, OSError):
    """An adapter that could not be written: the target is a file, read-only, on a full disk; names the path."""


class UnsafeFileError(FormatError):
    """A file fd-lora will not open as given: pickle without allow_pickle=True, or a corrupt/truncated safetensors."""


class UnusedKeysError(FormatError):
    """strict=True and the source has keys that were not used or were dropped; the message lists them and why."""


class DeviceMemoryError(FdLoraError, MemoryError):
    """Adapter banks that do not fit in device memory; names the bytes needed, the bytes free and the fix. The model
    is left as it was before the call."""


class ConfigError(FdLoraError, ValueError):
    """A config file that does not validate; the message names the key path, the bad value and what is allowed."""


class PartialLoadWarning(UserWarning):
    """A load that kept going without some of the source's LoRA keys (a missing A or B, keys no converter
    understood, modules the config's target_modules does not match). strict=True turns it into UnusedKeysError;
    `warnings.simplefilter("error", PartialLoadWarning)` too."""
