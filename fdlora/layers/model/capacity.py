"""The banks' capacity: slots and rank grow, shrink back, or freeze for torch.compile / CUDA graphs.

The methods are FdLoraHandle's (fdlora.layers.model.handle), which mixes `Capacity` in. A resize is all or nothing:
out of device memory, the banks already resized go back and the error names the bytes needed.
"""

from __future__ import annotations

import math

import torch

from fdlora import env
from fdlora.errors import CapacityError, CompiledModelError, DeviceMemoryError
from fdlora.layers.modules.fused import spec_of
from fdlora.layers.storage.bank import bank_bytes, padded_rank


class Capacity:
    """FdLoraHandle's bank shapes: freeze / unfreeze, grow, shrink and the resize they share."""

    def freeze(self) -> None:
        """Promise static buffers (torch.compile, CUDA graphs): no host-side shortcuts, no reallocation. Blend-mode
        nn.Linear layers then use the merged-weight cache through fdlora::merged_linear, checked on the device.
        Banks still below `slot_limit` get their slots now (later loads find them; shapes never change after)."""
        frozen_rank = max(self.max_rank, self.__dict__.get("frozen_rank", 0))
        if not self.state.static and (self.state.slots.capacity < self.slot_limit or self.max_rank < frozen_rank):
            self._resize(max(self.slot_limit, self.state.slots.capacity), frozen_rank)
        self.state.static = True

    def unfreeze(self) -> None:
        """Undo `freeze` once no compiled graph or captured CUDA graph of this model is replayed any more:
        eager calls take host shortcuts again (skipping idle layers, the merged-weight cache's host key)."""
        self.state.static = False

    def grow(self, max_slots: int | None = None, max_rank: int | None = None) -> None:
        """Raise slot and/or rank capacity, keeping loaded adapters (not on a frozen model)."""
        self._reshapeable("grow the banks")
        S = max(max_slots or 0, self.state.slots.capacity)
        self.slot_limit = max(self.slot_limit, S)
        cap = env.max_rank_limit()
        if (max_rank or 0) > cap:
            raise CapacityError(f"cannot grow to rank {max_rank}: above the rank limit {cap}; raise it "
                                f"({env.MAX_RANK_VAR}={max_rank}) if you need adapters that large.")
        self._resize(S, max(padded_rank(max_rank or 1), self.max_rank))

    def _resize(self, S: int, R: int) -> None:
        """Every bank to S slots at rank capacity R, one bank at a time (each bank's old buffers go as its new ones
        come: the peak is one bank more, not all of them twice). Out of device memory, the banks already resized go
        back and DeviceMemoryError names what was needed."""
        self.state.epoch += 1
        S0, R0, done = self.state.slots.capacity, self.max_rank, []
        try:
            for layer in self.layers.values():
                layer.bank.resize(S, R)
                done.append(layer)
        except torch.OutOfMemoryError as e:
            for layer in done:
                layer.bank.resize(S0, R0)
            raise self._no_room(f"resizing the banks to {S} slots x rank {R}", list(self.layers), None, S, R,
                                now=(S0, R0)) from e
        self.state.table.resize(len(self.layers), S)
        self.state.slots.capacity = S
        self.max_rank = R
        for layer in self.layers.values():
            layer.rebind()
            layer.select_backend()
        self._write_weights()

    def _no_room(self, what: str, paths: list[str], modules: dict | None, S: int, R: int,
                 now: tuple[int, int] | None = None) -> DeviceMemoryError:
        """The error for banks that did not fit: the bytes they need (beyond what the banks hold now), what is free,
        and what to change."""
        need, device = 0, None
        for path in paths:
            layer = self.layers.get(path)
            if layer is not None:
                bank = layer.bank
                need += bank.nbytes_at(S, R) - (bank.nbytes_at(*now) if now else 0)
                device = device or bank.A.device
                continue
            spec = spec_of(modules[path]) if modules is not None and path in modules else None
            if spec is not None:
                base = modules[path]
                w = next(iter(base.parameters()), None)
                dtype = self.dtype or (w.dtype if w is not None and w.is_floating_point() else torch.float32)
                need += bank_bytes(S, R, math.prod(spec.a_shape), spec.out_features, dtype)
                device = device or (w.device if w is not None else None)
        free = ""
        if device is not None and device.type == "cuda":
            free = f", {torch.cuda.mem_get_info(device)[0] / 2**30:.2f} GiB free"
        at = f" on {device}" if device is not None else ""
        return DeviceMemoryError(
            f"out of device memory {what}: the adapter banks need {need / 2**30:.2f} GiB more{at}{free} ({S} slots "
            f"x rank {R} per layer, {len(paths)} layers). The model is as it was before this call. Load with fewer "
            f"slots or a lower rank capacity (load_fd_lora(..., max_slots=N, max_rank=R) or fdlora.inject(..., "
            "max_slots=N, max_rank=R) on a fresh model; each slot holds one adapter), delete adapters you no longer "
            "use, or free device memory (other models, torch.cuda.empty_cache()).")

    def _reshapeable(self, what: str) -> None:
        if self.state.static:
            raise CompiledModelError(
                f"cannot {what}: this model is frozen for torch.compile / CUDA graphs, and its buffers must keep "
                "their shapes. Prepare before compiling: inject with larger max_slots / max_rank, and wrap every "
                "module adapters may target (fdlora.inject targets, or pipe.load_fd_lora(..., targets=[...]))."
            )

    def shrink(self) -> bool:
        """Give rank capacity back once the adapters that needed it are gone: the banks go down to the largest
        loaded rank, never below the capacity asked for at injection (`base_rank`). Not on a frozen model
        (its buffers keep their shapes). True if the banks were reallocated. `delete_adapter` calls it."""
        if self.state.static:
            return False
        need = max([self.base_rank] + [padded_rank(r) for layer in self.layers.values()
                                       for r in layer.bank.host_ranks])
        if need >= self.max_rank:
            return False
        self._resize(self.state.slots.capacity, need)
        return True
