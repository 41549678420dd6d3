"""Bulk bank writes: one adapter's modules from its staged device copy into every bank in one launch.

The fast path of adapter loads (fdlora.hub.pool): the adapter is packed in one host buffer, copied to
the device in one transfer (fdlora.hub.cache.stage), and written into the banks by the bank_scatter
kernel from a table of addresses (fdlora.kernels.triton.bank_scatter), so a 1000-module adapter is
one H2D copy, one small table upload and one launch instead of ~7 launches and a few views per module.
Modules the kernel does not cover (a LoRA bias, a rank that shrank in a reused slot) and devices
without the Triton kernel take `AdapterBank.write_many` over views of the staged copy.
"""

from __future__ import annotations

import array

import torch

from .. import env
from ..hub.adapter import ModuleLora
from ..hub.cache import Staged
from .bank import AdapterBank
from .state import to_device


def _scatter():
    try:
        from ..kernels.triton import bank_scatter
    except Exception:  # triton missing or broken: the torch path does the same writes
        return None
    return bank_scatter


def write_staged(writes: list[tuple[AdapterBank, int, ModuleLora]], staged: Staged) -> None:
    """`bank.write(slot, m)` for every (bank, slot, m), where m's host tensors are packed in `staged`."""
    dev = staged.flat.device
    kernel = _scatter() if dev.type == "cuda" or (dev.type == "cpu" and env.triton_interpret()) else None
    tables: dict[tuple, list[int]] = {}  # (source dtype, bank dtype) -> the kernel's table, 9 numbers a row
    rest, marked = [], []
    base = staged.flat.data_ptr() - staged.start  # host address -> device address
    for bank, slot, m in writes:  # ~700 modules per SDXL load, between two steps: plain reads, one table per dtype
        A, B = m.A, m.B
        if kernel is not None and type(bank) is AdapterBank and m.bias is None and m.magnitude is None:
            # (another layout, fdlora.layers.experts, a LoRA bias or DoRA, which bank.write keeps: the torch path)
            a0, a_step, b0, b_step, n, b_row, k0, k_step, dtype, bank_dev = bank.addresses()
            buffers, r = bank._buffers, A.shape[0]
            if (bank_dev == dev and buffers["bias"] is None and buffers["magnitude"] is None
                    and bank.host_ranks[slot] <= r and B.dtype == A.dtype):  # (a shrinking rank needs zeroing)
                rows = tables.get((A.dtype, dtype))
                if rows is None:
                    rows = tables[(A.dtype, dtype)] = []
                rows += (A.data_ptr() + base, a0 + slot * a_step, A.numel(), B.data_ptr() + base, b0 + slot * b_step,
                         n, r, b_row, k0 + slot * k_step)
                bank.mark(slot, r, device=False)
                marked.append(bank)
                continue
        rest.append((bank, slot, m.replace(staged.view(A), staged.view(B), staged.view(m.bias))))
    for (src, dst), rows in tables.items():  # (a page-locked copy: from pageable memory the host would wait for
        table = torch.frombuffer(array.array("q", rows), dtype=torch.int64).view(-1, 9)  # the GPU to drain first)
        kernel.scatter(to_device(table, dev), src, dst)
    AdapterBank.bump(marked)
    if rest:
        AdapterBank.write_many(rest)
