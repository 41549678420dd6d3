"""The op contract: one file per op, each holding the op's reference (its math and its signature), the arguments it
writes and, for ops that return a tensor, its fake. Backends implement these ops with the same parameters:

    torch    this package: the references themselves (the oracle in tests, the baseline in benchmarks, the fallback
             on any device)
    triton   fdlora.kernels.triton.ops, each op registered as `fdlora::<name>` from its spec (torch.compile traces
             into the kernels)
    cuda     fdlora.kernels.cuda.ops, the C++ extension's implementations

A backend that leaves an op out says why in its module's `NOT_IMPLEMENTED` ({op: reason}); the registry then routes
that op's layers to a backend that has it (tests/kernels/test_op_contract.py checks every backend against OPS).
lora_train holds the trainable layers' forward and backward formulas (registered by fdlora.kernels.train_ops).
"""

from . import lora_conv_delta as _conv_delta
from . import lora_delta as _delta
from . import lora_delta_rows as _delta_rows
from . import lora_expand_add as _expand_add
from . import lora_linear as _linear
from . import lora_merge as _merge
from . import lora_shrink as _shrink
from .spec import OpSpec

OPS: dict[str, OpSpec] = {m.SPEC.name: m.SPEC for m in (_shrink, _expand_add, _delta, _delta_rows, _conv_delta,
                                                        _linear, _merge)}

lora_shrink = _shrink.lora_shrink
lora_expand_add = _expand_add.lora_expand_add
lora_delta = _delta.lora_delta
lora_delta_rows = _delta_rows.lora_delta_rows
lora_conv_delta = _conv_delta.lora_conv_delta
lora_linear = _linear.lora_linear
lora_merge = _merge.lora_merge
new_stamp = _merge.new_stamp

__all__ = ["OPS", "OpSpec", "lora_conv_delta", "lora_delta", "lora_delta_rows", "lora_expand_add", "lora_linear",
           "lora_merge", "lora_shrink", "new_stamp"]
