"""AdapterBank: preallocated per-layer buffers for every loaded adapter (one slot each).

Layout (shared with every kernel backend, see fdlora.kernels.ops):

    A      [S, R, K]  (conv: [S, R, C_in, kh, kw])  slot s in rows 0..r_s, zeros after
    B      [N, S, R]  so B.view(N, S*R) expands all slots as one rank-S*R adapter
    ranks  [S] int32  live rank per slot (0 = empty), lets kernels skip the padding
    bias   [S, N]     lora_B bias (PEFT lora_bias=True), allocated on first use
    magnitude [S, N]  DoRA magnitude per slot (fp32), allocated on first use; `dora_eps[s]` None = not DoRA

R is a multiple of 16 (tensor-core tile). Loading writes a slot in place and deleting zeroes it;
nothing here reallocates except `resize`, which callers must not use on a compiled model.

Banks made inside `arena()` (FdLoraHandle.wrap makes its layers there) are views into a few large
zeroed buffers instead of four allocations each: wrapping the 722 layers of an SDXL UNet made ~2900
allocations, the largest part of a cold first load's host time in profiles (CPU, fresh processes on a
shared 2-core box, SDXL structure at 1/8 width: 1.4-6.8 s in 2893 torch.zeros against 0.7-1.2 s in 34;
on CUDA each was an allocator call and a memset launch).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
from torch import nn

from fdlora.hub.adapter import ModuleLora
from fdlora.layers.state import lasting

RANK_ALIGN = 16
ARENA_ALIGN = 256  # bytes between views: every dtype's alignment, and the 16-byte alignment kernels specialise on
ARENA_MIN, ARENA_MAX = 1 << 20, 64 << 20  # chunk bytes: doubling from 1 MiB (tiny models waste little) to 64 MiB
_local = threading.local()


class _Arena:
    """Zeroed memory handed out as aligned views, one growing list of chunks per (device, dtype)."""

    def __init__(self) -> None:
        self.chunks: dict[tuple, list] = {}  # (device, dtype) -> [chunk, used bytes, bytes allocated so far]

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        device = torch.device(device if device is not None else "cpu")
        n = 1
        for d in shape:
            n *= d
        nbytes = -(-n * dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN
        key = (device, dtype)
        got = self.chunks.get(key)
        if got is None or got[1] + nbytes > got[0].numel():
            total = 0 if got is None else got[2]
            size = max(nbytes, min(ARENA_MAX, max(ARENA_MIN, total)))
            with lasting():
                chunk = torch.zeros(size // dtype.itemsize, dtype=dtype, device=device)
            got = self.chunks[key] = [chunk, 0, total + size]
        chunk, used = got[0], got[1]
        got[1] += nbytes
        return chunk[used // dtype.itemsize:used // dtype.itemsize + n].view(shape)


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """Banks made inside (in this thread) share a few zeroed buffers (see the module docstring)."""
    outer = getattr(_local, "arena", None)
    if outer is None:
        _local.arena = _Arena()
    try:
        yield
    finally:
        if outer is None:
            _local.arena = None


def _zeros(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    a = getattr(_local, "arena", None)
    if a is not None:
        return a.zeros(shape, dtype, device)
    with lasting():
        return torch.zeros(*shape, dtype=dtype, device=device)


def padded_rank(r: int) -> int:
    return max(RANK_ALIGN, -(-r // RANK_ALIGN) * RANK_ALIGN)


def bank_bytes(slots: int, rank: int, a_numel: int, out_features: int, dtype: torch.dtype) -> int:
    """Bytes of a bank of `slots` slots at rank capacity `rank` (A, B and the ranks; not a lora bias or DoRA's
    magnitudes), for a layer whose A rows hold `a_numel` elements."""
    return slots * padded_rank(rank) * (a_numel + out_features) * dtype.itemsize + slots * 4


class AdapterBank(nn.Module):
    def __init__(
        self,
        slots: int,
        rank: int,
        out_features: int,
        a_shape: tuple[int, ...],  # per-rank-row shape of A: (K,) or (C_in, kh, kw)
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        R = padded_rank(rank)
        self.register_buffer("A", _zeros(slots, R, *a_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("B", _zeros(out_features, slots, R, dtype=dtype, device=device), persistent=False)
        self.register_buffer("ranks", _zeros(slots, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("bias", None, persistent=False)  # [S, N], allocated on first use
        self.register_buffer("magnitude", None, persistent=False)  # [S, N] fp32 DoRA m, allocated on first use
        self.dora_eps: list[float | None] = [None] * slots  # per slot: the DoRA norm's eps, None = not DoRA
        # bumped on the device with every write: the device-side merged-weight cache stamps it (layers.merged)
        self.register_buffer("dversion", _zeros(1, dtype=torch.int32, device=device), persistent=False)
        self.used: list[bool] = [False] * slots  # host mirror of ranks > 0
        self.host_ranks: list[int] = [0] * slots
        self.version = 0  # bumped on every write: merged-weight caches key on it
        self.slot_version: list[int] = [0] * slots  # per slot, bumped with its writes: a blend's copy keys on its own

    def __getstate__(self) -> dict:
        """Copies and pickles hold their own buffers: a view into an arena chunk would carry the whole chunk
        (pickle writes a view's entire storage, once per view)."""
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_buffers"] = {k: v.clone() if v is not None and v._base is not None else v
                             for k, v in self._buffers.items()}
        return state

    @property
    def slots(self) -> int:
        return self.A.shape[0]

    @property
    def rank_capacity(self) -> int:
        return self.A.shape[1]

    def nbytes_at(self, slots: int, rank: int) -> int:
        """Bytes this bank would hold at `slots` slots and rank capacity `rank`."""
        a_numel = math.prod(self.A.shape[2:])
        extra = 0 if self.bias is None else slots * self.B.shape[0] * self.B.element_size()
        extra += 0 if self.magnitude is None else slots * self.B.shape[0] * 4
        return bank_bytes(slots, rank, a_numel, self.B.shape[0], self.A.dtype) + extra

    def extent(self) -> tuple[int, int]:
        """(slots up to the last used one, padded max live rank): the part of the bank that is not zero."""
        S = max((s + 1 for s, u in enumerate(self.used) if u), default=0)
        return S, padded_rank(max(self.host_ranks, default=1))

    def write(self, slot: int, m: ModuleLora) -> None:
        r = m.rank
        self.A[slot, :r].copy_(m.A)
        self.A[slot, r:].zero_()
        self.B[:, slot, :r].copy_(m.B.reshape(m.B.shape[0], r))
        self.B[:, slot, r:].zero_()
        self.ranks[slot] = r
        if m.bias is not None:
            if self.bias is None:
                self.bias = _zeros(self.slots, self.B.shape[0], dtype=self.B.dtype, device=self.B.device)
            self.bias[slot].copy_(m.bias)
        elif self.bias is not None:
            self.bias[slot].zero_()
        self._write_magnitude(slot, m)
        self.mark(slot, r)

    def _write_magnitude(self, slot: int, m: ModuleLora | None) -> None:
        """Slot `slot`'s DoRA magnitude (fdlora.layers.modules.dora), or none."""
        if m is not None and m.magnitude is not None:
            if self.magnitude is None:
                self.magnitude = _zeros(self.slots, self.B.shape[0], dtype=torch.float32, device=self.B.device)
            self.magnitude[slot].copy_(m.magnitude)
            self.dora_eps[slot] = float(m.dora_eps)
        else:
            if self.magnitude is not None:
                self.magnitude[slot].zero_()
            self.dora_eps[slot] = None
            if self.magnitude is not None and all(e is None for e in self.dora_eps):
                self.magnitude = None  # no DoRA slot left: the layer takes the regular paths again

    def mark(self, slot: int, rank: int, device: bool = True) -> None:
        """Bookkeeping after slot `slot` was written with `rank` (0: cleared): host mirrors, both versions (the
        device one unless `device` is False: write_many bumps those in one grouped launch)."""
        d = self.__dict__
        d["used"][slot] = rank > 0
        d["host_ranks"][slot] = rank
        d["version"] += 1  # (not through nn.Module.__setattr__: loads mark ~1000 banks)
        sv = d.get("slot_version")
        if sv is None:  # (a bank pickled before it had one)
            sv = d["slot_version"] = [0] * len(self.used)
        sv[slot] += 1
        if device:
            self._buffers["dversion"].add_(1)

    def live_versions(self, live: tuple[int, ...]) -> tuple[int, ...]:
        """The versions of slots `live` (the slots a blend weighs): what a blend's merged copy of this bank reads."""
        sv = self.__dict__.get("slot_version")
        if sv is None:  # a bank pickled before it had per-slot versions: the whole bank's
            return (self.version,)
        return tuple(sv[s] if s < len(sv) else -1 for s in live)

    def addresses(self) -> tuple:
        """(A slot 0, A slot stride, B slot 0, B slot stride, N, B row stride, ranks slot 0, ranks slot stride,
        dtype, device): addresses in bytes (row stride in elements) for the bulk writer (fdlora.layers.storage.bulk)."""
        buffers = self._buffers
        A, B, ranks = buffers["A"], buffers["B"], buffers["ranks"]
        # keyed on all three addresses: offload hooks move the buffers one at a time, and a move back may give A its
        # old address while B gets a new one
        key = (A.data_ptr(), B.data_ptr(), ranks.data_ptr())
        got = self.__dict__.get("_addresses")
        if got is None or got[0] != key:
            isz = A.element_size()
            got = self.__dict__["_addresses"] = (key, (A.data_ptr(), A.stride(0) * isz, B.data_ptr(), B.stride(1) * isz,
                                                       B.shape[0], B.stride(0), ranks.data_ptr(), ranks.element_size(),
                                                       A.dtype, A.device))
        return got[1]

    @staticmethod
    def write_many(writes: list[tuple[AdapterBank, int, ModuleLora]]) -> None:
        """`bank.write(slot, m)` for many banks at once, in a few grouped launches instead of ~7 per module.

        Invariant used: a slot's rows past `host_ranks[slot]` are already zero, so only a rank that shrank
        needs zeroing. Banks with a LoRA bias take the one-by-one path.
        """
        copies: dict[torch.device, tuple[list, list]] = {}
        zeros: dict[torch.device, list] = {}
        ranks: dict[torch.device, tuple[list, list]] = {}
        marked = []
        for bank, slot, m in writes:
            if (m.bias is not None or bank.bias is not None or m.magnitude is not None or bank.magnitude is not None
                    or type(bank).write is not AdapterBank.write):  # other layouts (moe_experts) write alone
                bank.write(slot, m)
                continue
            r, prev, dev = m.rank, bank.host_ranks[slot], bank.A.device
            dst, src = copies.setdefault(dev, ([], []))
            dst += [bank.A[slot, :r], bank.B[:, slot, :r]]
            src += [m.A, m.B.reshape(m.B.shape[0], r)]
            if prev > r:
                zeros.setdefault(dev, []).extend([bank.A[slot, r:prev], bank.B[:, slot, r:prev]])
            rd, rv = ranks.setdefault(dev, ([], []))
            rd.append(bank.ranks[slot:slot + 1])
            rv.append(r)
            bank.mark(slot, r, device=False)
            marked.append(bank)
        for dst, src in copies.values():
            torch._foreach_copy_(dst, src)
        for zs in zeros.values():
            torch._foreach_zero_(zs)
        for dev, (rd, rv) in ranks.items():
            torch._foreach_copy_(rd, torch.tensor(rv, dtype=torch.int32).to(dev).split(1))
        AdapterBank.bump(marked)

    @staticmethod
    def bump(banks: list[AdapterBank]) -> None:
        """The device versions of many banks marked with device=False, one grouped launch per device."""
        versions: dict[torch.device, dict[int, torch.Tensor]] = {}
        for bank in banks:
            v = bank._buffers["dversion"]
            versions.setdefault(v.device, {})[id(v)] = v  # a bank written twice counts once
        for vs in versions.values():
            torch._foreach_add_(list(vs.values()), 1)

    @staticmethod
    def clear_many(banks: list[AdapterBank], slot: int) -> None:
        """`bank.clear(slot)` for many banks, in a few grouped launches per device and dtype instead of ~6 per bank
        (a delete or an eviction clears a slot of every layer: 722 on an SDXL UNet, between two serving steps).
        Banks with a LoRA bias or DoRA magnitudes, and other layouts, clear one by one."""
        zeros: dict[tuple, list[torch.Tensor]] = {}
        marked = []
        for bank in banks:
            if (type(bank).clear is not AdapterBank.clear or type(bank).write is not AdapterBank.write
                    or bank.bias is not None or bank.magnitude is not None):
                bank.clear(slot)
                continue
            A, B, ranks = bank.A, bank.B, bank.ranks
            zeros.setdefault((A.device, A.dtype), []).extend((A[slot], B[:, slot]))
            zeros.setdefault((ranks.device, ranks.dtype), []).append(ranks[slot:slot + 1])
            bank._write_magnitude(slot, None)
            bank.mark(slot, 0, device=False)
            marked.append(bank)
        for ts in zeros.values():
            torch._foreach_zero_(ts)
        AdapterBank.bump(marked)

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[:, slot].zero_()
        self.ranks[slot] = 0
        if self.bias is not None:
            self.bias[slot].zero_()
        self._write_magnitude(slot, None)
        self.mark(slot, 0)

    def resize(self, slots: int, rank: int) -> None:
        """Reallocate to `slots` slots and rank capacity `rank`, keeping every loaded slot (not while compiled or
        captured). Slots may go down to the last used one and the rank to the largest live one, to give memory back.
        Atomic: a failed allocation (torch.OutOfMemoryError) leaves the bank as it was."""
        R, S0, R0 = padded_rank(rank), self.slots, self.rank_capacity
        if any(self.used[slots:]) or R < max(self.host_ranks, default=0):
            raise ValueError(f"resize to {slots} slots x rank {R} would drop loaded adapters ({S0} slots, live ranks "
                             f"{self.host_ranks}).")
        keep, S1 = min(R, R0), min(slots, S0)
        with lasting():  # every buffer made before any is replaced: a failed allocation leaves the bank as it was
            A = self.A.new_zeros(slots, R, *self.A.shape[2:])
            B = self.B.new_zeros(self.B.shape[0], slots, R)
            ranks = self.ranks.new_zeros(slots)
            bias = None if self.bias is None else self.bias.new_zeros(slots, self.bias.shape[1])
            mag = None if self.magnitude is None else self.magnitude.new_zeros(slots, self.magnitude.shape[1])
            A[:S1, :keep] = self.A[:S1, :keep]
            B[:, :S1, :keep] = self.B[:, :S1, :keep]
            ranks[:S1] = self.ranks[:S1]
            if bias is not None:
                bias[:S1] = self.bias[:S1]
            if mag is not None:
                mag[:S1] = self.magnitude[:S1]
        self.A, self.B, self.ranks = A, B, ranks
        self.__dict__.pop("_addresses", None)
        if bias is not None:
            self.bias = bias
        if mag is not None:
            self.magnitude = mag
        grown = [0] * (slots - S0)
        self.dora_eps = self.dora_eps[:slots] + [None] * (slots - S0)
        self.used = self.used[:slots] + [False] * (slots - S0)
        self.host_ranks = self.host_ranks[:slots] + grown
        self.slot_version = [v + 1 for v in self.slot_version[:slots]] + grown
        self.version += 1
        self.dversion.add_(1)
