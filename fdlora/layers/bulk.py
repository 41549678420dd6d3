"""Bulk bank writes: one adapter's modules from its staged device copy into every bank in one launch.

The fast path of adapter loads (fdlora.hub.pool): the adapter is packed in one host buffer, copied to
the device in one transfer (fdlora.hub.cache.stage), and written into the banks by the bank_scatter
kernel from a table of addresses (fdlora.kernels.triton.bank_scatter), so a 1000-module adapter is
one H2D copy, one small table upload and one launch instead of ~7 launches and a few views per module.
Modules the kernel does not cover (a LoRA bias, a rank that shrank in a reused slot) and devices
without the Triton kernel take `AdapterBank.write_many` over views of the staged copy.
"""

from __future__ import annotations

import torch

from .. import env
from ..hub.adapter import ModuleLora
from ..hub.cache import Staged
from .bank import AdapterBank


def _scatter():
    try:
        from ..kernels.triton import bank_scatter
    except Exception:  # triton missing or broken: the torch path does the same writes
        return None
    return bank_scatter


def _kernel_can(bank: AdapterBank) -> bool:
    dev = bank.A.device.type
    return dev == "cuda" or (dev == "cpu" and env.triton_interpret())


def write_staged(writes: list[tuple[AdapterBank, int, ModuleLora]], staged: Staged) -> None:
    """`bank.write(slot, m)` for every (bank, slot, m), where m's host tensors are packed in `staged`."""
    kernel = _scatter()
    tables: dict[tuple, list[list[int]]] = {}
    rest = []
    base = staged.flat.data_ptr() - staged.start  # host address -> device address
    for bank, slot, m in writes:
        r = m.rank
        if (kernel is None or m.bias is not None or bank.bias is not None or bank.host_ranks[slot] > r
                or m.B.dtype != m.A.dtype
                or not _kernel_can(bank) or bank.A.device != staged.flat.device):
            rest.append((bank, slot, ModuleLora(staged.view(m.A), staged.view(m.B), m.alpha, staged.view(m.bias),
                                                finite=m.finite)))
            continue
        a0, a_step, b0, b_step, n, b_row, k0, k_step = bank.addresses()
        tables.setdefault((m.A.dtype, bank.A.dtype, bank.A.device), []).append([
            m.A.data_ptr() + base, a0 + slot * a_step, m.A.numel(),
            m.B.data_ptr() + base, b0 + slot * b_step, n, r, b_row, k0 + slot * k_step])
        bank.used[slot] = True
        bank.host_ranks[slot] = r
        bank.version += 1
    for (src, dst, dev), rows in tables.items():
        kernel.scatter(torch.tensor(rows, dtype=torch.int64).to(dev), src, dst)
    if rest:
        AdapterBank.write_many(rest)
