"""The class of stage 3 parameters, so that touching one while it is partitioned fails loudly, by name.

While a unit is sharded its parameters are views of a zero-sized storage. Any operation that would read or
write their values then raises an error naming the parameter and the fix, instead of computing on an empty
tensor; metadata (shape, dtype, ``.grad``, hooks…) stays readable. An owner may instead handle the operation
(``zero_core.Init`` gathers the parameter for in-place initialisation). Once gathered, operations run as for
any ``nn.Parameter``.
"""

from __future__ import annotations

import torch
from torch import nn

from . import registry

# Descriptors readable (and writable) on a partitioned parameter: they do not touch its values.
_METADATA_ATTRIBUTES = frozenset(
    "shape dtype device requires_grad grad _grad grad_fn is_leaf ndim layout names output_nr _version _base "
    "is_cuda is_cpu is_meta is_sparse is_quantized is_mkldnn is_nested itemsize nbytes _backward_hooks "
    "_post_accumulate_grad_hooks __dict__".split()
)
_METADATA_METHODS = frozenset(
    "size dim numel nelement element_size stride storage_offset is_contiguous is_floating_point is_complex "
    "requires_grad_ register_hook register_post_accumulate_grad_hook untyped_storage data_ptr get_device "
    "__hash__ retain_grad is_shared __setstate__".split()
)


def is_released(tensor: torch.Tensor) -> bool:
    """A partitioned parameter whose values are not gathered on this rank now."""
    if not isinstance(tensor, PartitionedParameter):
        return False
    with torch._C.DisableTorchFunctionSubclass():  # these metadata reads must not re-enter the guard
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def _is_metadata(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        return attribute in _METADATA_ATTRIBUTES or (attribute == "data" and name == "__set__")
    return name in _METADATA_METHODS


def _first_released(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            found = _first_released(value, {})
            if found is not None:
                return found
        elif is_released(value):
            return value
    return None


def describe(param: torch.Tensor) -> str:
    owner = registry.owner_of(param)
    name = owner.describe(param) if owner is not None else "<unregistered>"
    with torch._C.DisableTorchFunctionSubclass():
        return f"'{name}' (shape {tuple(param.shape)})"


class PartitionedParameter(nn.Parameter):
    """An ``nn.Parameter`` partitioned by ZeRO stage 3 (the user's object, its class switched in place)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # compiled code runs between the eager hooks, on gathered parameters
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        released = _first_released(args, kwargs)
        if released is not None and not _is_metadata(func):
            owner = registry.owner_of(released)
            if owner is not None and getattr(owner, "handles_released", lambda f: False)(func):
                return owner.run_on_released(func, args, kwargs)
            name = getattr(func, "__name__", str(func))
            if name in ("__get__", "__set__"):
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            raise RuntimeError(
                f"parameter {describe(released)} is partitioned by ZeRO stage 3 and not gathered on this rank, so "
                f"'{name}' cannot read or write it here. Use it inside its module's forward, or wrap the code in "
                "`with zero_core.GatheredParameters([param]):` (add modifier_rank=0 to keep changes), or read it "
                "with zero_core.safe_get_full_fp32_param(param)."
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:
        if is_released(self):
            with torch._C.DisableTorchFunctionSubclass():
                return f"PartitionedParameter({describe(self)}, dtype={self.dtype}, partitioned)"
        with torch._C.DisableTorchFunctionSubclass():
            return "Partitioned" + torch.Tensor.__repr__(self)


def mark_partitioned(param: nn.Parameter) -> None:
    """Switch the class of the user's parameter in place, keeping its identity (optimizers, ties, hooks)."""
    if not isinstance(param, PartitionedParameter):
        param.__class__ = PartitionedParameter


def unmark_partitioned(param: nn.Parameter) -> None:
    if isinstance(param, PartitionedParameter):
        param.__class__ = nn.Parameter
