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
    tables: dict[tuple, list[list[int]]] = {}
    rest, marked = [], []
    base = staged.flat.data_ptr() - staged.start  # host address -> device address
    for bank, slot, m in writes:  # ~1000 modules per SDXL load: plain reads only (no nn.Module lookups)
        A, B = m.A, m.B
        if type(bank) is not AdapterBank:  # another layout (fdlora.layers.experts): its own write
            rest.append((bank, slot, m.replace(staged.view(A), staged.view(B), staged.view(m.bias))))
            continue
        r = A.shape[0]
        a0, a_step, b0, b_step, n, b_row, k0, k_step, dtype, bank_dev = bank.addresses()
        if (kernel is None or bank_dev != dev or m.bias is not None or bank._buffers["bias"] is not None
                or bank.host_ranks[slot] > r or B.dtype != A.dtype or m.magnitude is not None
                or bank._buffers["magnitude"] is not None):  # (DoRA: bank.write keeps the magnitude)
            rest.append((bank, slot, m.replace(staged.view(A), staged.view(B), staged.view(m.bias))))
            continue
        tables.setdefault((A.dtype, dtype), []).append([
            A.data_ptr() + base, a0 + slot * a_step, A.numel(),
            B.data_ptr() + base, b0 + slot * b_step, n, r, b_row, k0 + slot * k_step])
        bank.mark(slot, r, device=False)
        marked.append(bank)
    for (src, dst), rows in tables.items():  # (a page-locked copy: from pageable memory the host would wait for
        kernel.scatter(to_device(torch.tensor(rows, dtype=torch.int64), dev), src, dst)  # the GPU to drain first)
    AdapterBank.bump(marked)
    if rest:
        AdapterBank.write_many(rest)
