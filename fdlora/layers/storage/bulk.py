"""Bulk bank writes: one adapter's modules from its staged device copy into every bank in one launch.

The fast path of adapter loads (fdlora.hub.pool): the adapter is packed in one host buffer, copied to
the device in one transfer (fdlora.hub.cache.stage), and written into the banks by the bank_scatter
kernel from a table of addresses (fdlora.kernels.triton.merge.bank_scatter), so a 1000-module adapter is
one H2D copy, one small table upload and one launch instead of ~7 launches and a few views per module.
Modules the kernel does not cover (a LoRA bias, a rank that shrank in a reused slot) and devices
without the Triton kernel take `AdapterBank.write_many` over views of the staged copy. `prepare` builds the tables
without touching a bank, in pieces (fdlora.steps), so a prefetch's publication builds them between serving
steps and launches them in its last piece (fdlora.runtime.background).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from fdlora import env
from fdlora.hub.adapter import ModuleLora
from fdlora.hub.cache import Staged
from fdlora.layers.state import to_device
from fdlora.layers.storage.bank import AdapterBank
from fdlora.steps import Steps, drain


def _scatter():
    try:
        from fdlora.kernels.triton.merge import bank_scatter
    except Exception:  # triton missing or broken: the torch path does the same writes
        return None
    return bank_scatter


@dataclass
class Prepared:
    """The writes of one adapter into its slot, ready to launch: the kernel's tables, the banks it marks (with the
    addresses each table row was made from, to tell a bank moved since) and the modules left to torch copies."""

    device: torch.device
    tables: dict[tuple, list[int]] = field(default_factory=dict)  # (src dtype, bank dtype) -> 9 numbers a row
    marks: list[tuple[AdapterBank, int, int]] = field(default_factory=list)  # (bank, slot, rank) the kernel writes
    where: list[int] = field(default_factory=list)  # each marked bank's A, B, ranks addresses when prepared
    rest: list[tuple[AdapterBank, int, ModuleLora]] = field(default_factory=list)

    def launch(self, check: bool = False) -> bool:
        """Write every bank; with `check`, first that every bank is where it was when prepared (an offload hook may
        have moved it since): False, and nothing written, if one is not."""
        if check and _where(m[0] for m in self.marks) != self.where:
            return False
        kernel = _scatter()
        for (src, dst), rows in self.tables.items():  # (a page-locked copy: from pageable memory the host would
            table = torch.frombuffer(array.array("q", rows), dtype=torch.int64).view(-1, 9)  # wait for the GPU first)
            kernel.scatter(to_device(table, self.device), src, dst)
        for bank, slot, r in self.marks:
            bank.mark(slot, r, device=False)
        AdapterBank.bump([m[0] for m in self.marks])
        if self.rest:
            AdapterBank.write_many(self.rest)
        return True


def _where(banks) -> list[int]:
    """The addresses of the buffers the bulk writer's table rows point into (A, B, ranks), bank after bank."""
    return [t.data_ptr() for b in banks for t in (b._buffers["A"], b._buffers["B"], b._buffers["ranks"])]


def write_staged(writes: list[tuple[AdapterBank, int, ModuleLora]], staged: Staged) -> None:
    """`bank.write(slot, m)` for every (bank, slot, m), where m's host tensors are packed in `staged`."""
    drain(prepare(writes, staged)).launch()


def prepare(writes: list[tuple[AdapterBank, int, ModuleLora]], staged: Staged, every: int = 0) -> Steps[Prepared]:
    """What `write_staged` writes, as a `Prepared` (the banks untouched); with `every`, stopping every that many
    modules (fdlora.steps)."""
    dev = staged.flat.device
    kernel = _scatter() if dev.type == "cuda" or (dev.type == "cpu" and env.triton_interpret()) else None
    out = Prepared(dev)
    tables = out.tables
    base = staged.flat.data_ptr() - staged.start  # host address -> device address
    for i, (bank, slot, m) in enumerate(writes):  # ~700 modules per SDXL load: plain reads, one table per dtype
        if every and i and not i % every:
            yield
        A, B = m.A, m.B
        if kernel is not None and type(bank) is AdapterBank and m.bias is None and m.magnitude is None:
            # (another layout, fdlora.layers.modules.moe_experts, a LoRA bias or DoRA, which bank.write keeps: the torch
            # path)
            a0, a_step, b0, b_step, n, b_row, k0, k_step, dtype, bank_dev = bank.addresses()
            buffers, r = bank._buffers, A.shape[0]
            if (bank_dev == dev and buffers["bias"] is None and buffers["magnitude"] is None
                    and bank.host_ranks[slot] <= r and B.dtype == A.dtype):  # (a shrinking rank needs zeroing)
                rows = tables.get((A.dtype, dtype))
                if rows is None:
                    rows = tables[(A.dtype, dtype)] = []
                rows += (A.data_ptr() + base, a0 + slot * a_step, A.numel(), B.data_ptr() + base, b0 + slot * b_step,
                         n, r, b_row, k0 + slot * k_step)
                out.marks.append((bank, slot, r))
                continue
        out.rest.append((bank, slot, m.replace(staged.view(A), staged.view(B), staged.view(m.bias))))
    out.where = _where(m[0] for m in out.marks)
    return out
