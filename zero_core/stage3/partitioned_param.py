"""The class of stage 3 parameters (and of their views), so that touching freed memory fails loudly, by name.

While a unit is sharded its parameters are views of a zero-sized storage. Any operation that would read or
write their values then raises an error naming the parameter and the fix, instead of computing on an empty
tensor; metadata (shape, dtype, ``.grad``, hooks…) stays readable. An owner may instead handle the operation
(``zero_core.Init`` gathers the parameter for the operation). Once gathered, operations run as for any
``nn.Parameter``.

A view or alias of a partitioned parameter (``param[0]``, ``param.t()``, ``param.data``, ``param.detach()``…)
shares its storage, so it would point at freed memory once the parameter is released. Such results become
``PartitionedView``s bound to their parameter: while the storage is gathered they are ordinary tensors; once it
is released they behave like the released parameter (the same error, or the owner's handling); a view whose
parameter has since moved to other storage (re-partitioned by ``setup``) raises. ``numpy()`` of a partitioned
parameter or view gives a read-only copy, since an array sharing the storage would outlive it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zero_core import registry

_Disable = torch._C.DisableTorchFunctionSubclass

# Descriptors readable (and writable) on a partitioned parameter: they do not touch its values.
_METADATA_ATTRIBUTES = frozenset(
    "shape dtype device requires_grad grad _grad grad_fn is_leaf ndim layout names output_nr _version _base "
    "is_cuda is_cpu is_meta is_sparse is_quantized is_mkldnn is_nested itemsize nbytes _backward_hooks "
    "_post_accumulate_grad_hooks __dict__".split()
)
_METADATA_METHODS = frozenset(
    "size dim numel nelement element_size stride storage_offset is_contiguous is_floating_point is_complex "
    "requires_grad_ register_hook register_post_accumulate_grad_hook untyped_storage data_ptr get_device "
    "__hash__ retain_grad is_shared __setstate__ _has_compatible_shallow_copy_type".split()
)
# Results that would share the storage outside any tensor, so no PartitionedView could guard them.
_ARRAY_EXPORTS = frozenset({"numpy", "__array__"})
_NO_EXPORT = frozenset({"__dlpack__", "__dlpack_device__"})


def tensors_in(args, kwargs) -> list[torch.Tensor]:
    """Every tensor among the arguments, one level into lists and tuples (torch.cat, out=...)."""
    found = []
    for values in (args, kwargs.values() if kwargs else ()):
        for value in values:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def base_of(tensor) -> Optional[nn.Parameter]:
    """The partitioned parameter ``tensor`` is (or is a view of); None for any other tensor."""
    if isinstance(tensor, PartitionedParameter):
        return tensor
    if isinstance(tensor, PartitionedView):
        return tensor.__dict__.get("_partitioned_base")
    return None


def _storage_key(tensor: torch.Tensor) -> Optional[int]:
    with _Disable():
        if tensor.layout != torch.strided:
            return None
        return tensor.untyped_storage()._cdata


def is_released(tensor) -> bool:
    """A partitioned parameter (or view of one) whose values are not gathered on this rank now."""
    if not isinstance(tensor, (PartitionedParameter, PartitionedView)):
        return False
    with _Disable():  # these metadata reads must not re-enter the guard
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def is_stale(tensor) -> bool:
    """A view whose parameter now lives in other storage (partitioned again by setup, or given new .data)."""
    base = base_of(tensor)
    return isinstance(tensor, PartitionedView) and base is not None and _storage_key(base) != _storage_key(tensor)


def _op_name(func) -> str:
    if isinstance(func, str):
        return func
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def describe(tensor: torch.Tensor) -> str:
    param = base_of(tensor)
    param = tensor if param is None else param
    owner = registry.owner_of(param)
    name = owner.describe(param) if owner is not None else "<unregistered>"
    with _Disable():
        return f"'{name}' (shape {tuple(param.shape)})"


def _released_error(tensor, func) -> RuntimeError:
    what = "parameter" if isinstance(tensor, PartitionedParameter) else "a view of parameter"
    return RuntimeError(
        f"{what} {describe(tensor)} is partitioned by ZeRO stage 3 and not gathered on this rank, so "
        f"'{_op_name(func)}' cannot read or write it here. Use it inside its module's forward, or wrap the code in "
        "`with zero_core.GatheredParameters([param]):` (add modifier_rank=0 to keep changes), or read it "
        "with zero_core.safe_get_full_fp32_param(param)."
    )


def _stale_error(tensor, func) -> RuntimeError:
    return RuntimeError(
        f"this view of parameter {describe(tensor)} was taken before the parameter was partitioned again "
        f"(zero_core.setup, or new .data), so it no longer refers to the parameter and '{_op_name(func)}' is "
        "refused. Take the view again from the parameter (inside GatheredParameters), or .clone() it when taken."
    )


def _scan(tensors):
    """One pass over the arguments: {storage: parameter} of ours, the first released one, the first stale one."""
    bases, released, stale = {}, None, None
    with _Disable():  # metadata reads that must not re-enter the guard
        for tensor in tensors:
            base = base_of(tensor)
            if base is None:
                continue
            storage = tensor.untyped_storage()
            if tensor is not base and base.untyped_storage()._cdata != storage._cdata:
                stale = stale if stale is not None else tensor
            elif released is None and storage.nbytes() == 0 and tensor.numel() > 0:
                released = tensor
            bases[storage._cdata] = base
    return bases, released, stale


def _bind_views(result, bases: dict):
    """Results sharing a partitioned parameter's storage become PartitionedViews of that parameter."""
    for item in result if isinstance(result, (tuple, list)) else (result,):
        if type(item) is torch.Tensor and item.layout == torch.strided:  # plain results only (not params, not ours)
            with _Disable():
                base = bases.get(item.untyped_storage()._cdata)
            if base is not None:
                item.__class__ = PartitionedView
                item._partitioned_base = base
    return result


def _handled_by_owner(released, func):
    owner = registry.owner_of(base_of(released))
    if owner is None or not owner.handles_released(func):
        raise _released_error(released, func)
    return owner


# What _dispatch does with a function, decided once per function (the guard runs on every operation).
_METADATA, _DATA_SET, _VALUES, _COMPUTE = "metadata", "data set", "values", "compute"
_KINDS: dict = {}
# The layers' own functions: they read parameters and return new tensors, never views of them. On gathered
# parameters (the case of every forward), only the "is it gathered" check is needed.
_COMPUTE_FUNCTIONS = frozenset(
    "linear bilinear layer_norm group_norm rms_norm batch_norm instance_norm embedding embedding_bag conv1d conv2d "
    "conv3d conv_transpose1d conv_transpose2d conv_transpose3d matmul mm bmm addmm baddbmm einsum prelu "
    "scaled_dot_product_attention".split())


def _kind(func) -> str:
    try:
        kind = _KINDS.get(func)
    except TypeError:  # an unhashable callable: classify it every time
        kind = None
    if kind is None:
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            attribute = getattr(getattr(func, "__self__", None), "__name__", "")
            if attribute == "data" and name == "__set__":
                kind = _DATA_SET
            else:
                kind = _METADATA if attribute in _METADATA_ATTRIBUTES else _VALUES
        elif name in _METADATA_METHODS:
            kind = _METADATA
        elif isinstance(func, torch._ops.OpOverload):
            # aten ops called directly: compiled graphs at run time. On gathered parameters their results (views
            # too) are the graph's temporaries, left unbound: aot_autograd's first-run alias check refuses
            # PartitionedView arguments.
            kind = _COMPUTE
        else:
            kind = _COMPUTE if name in _COMPUTE_FUNCTIONS else _VALUES
        try:
            _KINDS[func] = kind
        except TypeError:
            pass
    return kind


def _gathered_parameter(value) -> bool:
    """Not ours, or a partitioned parameter whose values are here (a view, or anything else, takes the full
    check). Call with the guard disabled."""
    if isinstance(value, PartitionedParameter):
        return value.untyped_storage().nbytes() > 0 or value.numel() == 0
    if isinstance(value, (list, tuple)):  # einsum's operands
        return all(_gathered_parameter(v) for v in value)
    return not isinstance(value, PartitionedView)


def _moves_nowhere(func, args, kwargs) -> bool:
    """``param.to(device, dtype)`` that would return ``param`` itself: same device, same dtype, no copy. A
    Trainer's ``model.to(device)`` of a model built partitioned on that device does this (nothing to read)."""
    if func is not torch.Tensor.to or not isinstance(args[0], PartitionedParameter) or (kwargs or {}).get("copy"):
        return False
    with _Disable():
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **(kwargs or {}))
        tensor = args[0]
        return ((device is None or _same_device(torch.device(device), tensor.device))
                and (dtype is None or dtype == tensor.dtype) and memory_format in (None, torch.preserve_format))


def _same_device(a: torch.device, b: torch.device) -> bool:
    """"cpu:0" is "cpu" (a Trainer's device on CPU); an index left out means the current one."""
    return a.type == b.type and (a.type == "cpu" or a.index is None or b.index is None or a.index == b.index)


def _loads_into(func, args, released) -> bool:
    """``param.copy_(tensor)`` without autograd into a whole parameter an Init partition still holds."""
    return (func is torch.Tensor.copy_ and released is args[0] and isinstance(released, PartitionedParameter)
            and len(args) > 1 and not isinstance(args[1], (PartitionedParameter, PartitionedView))
            and not (torch.is_grad_enabled() and released.requires_grad)
            and registry.pending_partition_of(released) is not None)


# [Note: compiled reads] Dynamo traces this guard into its graphs and runs them with torch functions disabled, so
# such a graph never reaches the guard at run time: a parameter no hook gathered before the graph (read directly by a patched forward, as
# TRL's fused LM head reads ``lm_head.weight``, in a graph after a break) would be read from freed memory. So each
# partitioned parameter carries a flag, set by its unit (param_unit.py): True while the parameter is released,
# and while it is gathered only for reads (the runtime's gather_on_read); False while a hook or prefetch holds
# it. Dynamo reads the flag while it traces this guard and guards on its value: where it is set, the trace
# breaks at the read and an eager call gathers first (or raises the error naming the parameter); where it is
# clear, the graph gets nothing and no break. A gather for a read leaves the flag set, so it is the same at
# every entry of the frame from step to step (no recompilation); a frame entered with the other value
# (a prefetch gathered the parameter this time) is compiled once more for it.
GATHER_ON_READ_FLAG = "_zero_gather_on_read"


def set_gather_on_read_flag(params, value: bool) -> None:
    for param in params:
        setattr(param, GATHER_ON_READ_FLAG, value)


def _gather_for_compiled_read(args, kwargs) -> None:
    """Traced by dynamo ([Note: compiled reads]): a call into eager code before a read of a released parameter."""
    for tensor in tensors_in(args, kwargs):
        if isinstance(tensor, PartitionedParameter) and getattr(tensor, GATHER_ON_READ_FLAG, False):
            _gather_before_compiled_read(tensor)


@torch.compiler.disable
def _gather_before_compiled_read(param) -> None:
    """Run eagerly: gather ``param`` for the compiled read that follows, as the eager guard would (inside the
    model's forward or a backward), or raise the guard's error naming it."""
    if not is_released(param):
        return
    owner = registry.owner_of(param)
    if owner is None or not owner.gather_for_read([param]):
        raise _released_error(param, "compiled code")


def _dispatch(func, args, kwargs):
    """The guard shared by partitioned parameters and their views."""
    if torch.compiler.is_compiling():  # compiled code runs between the eager hooks, on gathered parameters
        _gather_for_compiled_read(args, kwargs or {})
        with _Disable():
            return func(*args, **(kwargs or {}))
    if _moves_nowhere(func, args, kwargs):
        return args[0]
    kind = _kind(func)
    if kind is _DATA_SET and isinstance(args[0], PartitionedParameter):
        owner = registry.pending_partition_of(args[0])
        if owner is not None and owner.handles_released(func):
            return owner.assign_data(args[0], args[1])  # Init: keep the partition in step with the new values
    kwargs = kwargs or {}
    if kind is _COMPUTE:
        with _Disable():
            if all(_gathered_parameter(a) for a in args) and all(_gathered_parameter(a) for a in kwargs.values()):
                return func(*args, **kwargs)
    elif kind is not _VALUES:  # metadata, or new .data for a parameter
        with _Disable():
            return func(*args, **kwargs)
    name = getattr(func, "__name__", "")
    bases, released, stale = _scan(tensors_in(args, kwargs))
    if stale is not None:
        raise _stale_error(stale, func)
    if name in _NO_EXPORT:
        raise RuntimeError(
            f"'{name}' of parameter {describe(next(iter(bases.values())))} would share storage that ZeRO stage 3 "
            "frees while the tensor still exists: export a copy instead (`param.detach().clone()`)"
        )
    if _loads_into(func, args, released):  # model.load_state_dict after zero_core.Init, before setup
        return registry.pending_partition_of(released).copy_in(released, args[1])
    owner = _handled_by_owner(released, func) if released is not None else None
    if name in _ARRAY_EXPORTS:  # a read-only copy: reads work, writes fail loudly instead of being lost
        copy = func(torch.Tensor.clone(args[0]), *args[1:], **kwargs)
        copy.flags.writeable = False
        return copy
    if owner is not None:
        return owner.run_on_released(func, args, kwargs)
    with _Disable():
        result = func(*args, **kwargs)
    return _bind_views(result, bases)


def released_params(args, kwargs) -> list[nn.Parameter]:
    """The partitioned parameters behind the released tensors among the arguments (for an owner that gathers)."""
    return list({id(p): p for p in (base_of(t) for t in tensors_in(args, kwargs) if is_released(t))}.values())


def dispatch_gathered(func, args, kwargs):
    """Run ``func`` once its owner gathered what it reads: the guard again (views bound, a still-released or
    stale argument refused), never the owner's handling a second time."""
    if any(is_released(t) for t in tensors_in(args, kwargs or {})):
        _, released, _ = _scan(tensors_in(args, kwargs or {}))
        raise _released_error(released, func)
    return _dispatch(func, args, kwargs)


def _format(tensor: torch.Tensor, spec: str) -> str:
    """``format(p, spec)``: the repr while released (or without a spec), else the values formatted."""
    return repr(tensor) if is_released(tensor) or not spec else format(torch.Tensor.clone(tensor), spec)


class PartitionedParameter(nn.Parameter):
    """An ``nn.Parameter`` partitioned by ZeRO stage 3 (the user's object, its class switched in place)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)

    def __repr__(self) -> str:
        if is_released(self):
            with _Disable():
                return f"PartitionedParameter({describe(self)}, dtype={self.dtype}, partitioned)"
        with _Disable():
            return torch.Tensor.__repr__(self)

    def __format__(self, spec: str) -> str:
        return _format(self, spec)

    def __deepcopy__(self, memo):
        try:
            return super().__deepcopy__(memo)
        except RuntimeError as error:
            if not is_released(self):
                raise
            # torch's AveragedModel (and Lightning's WeightAveraging) start with a deepcopy of the model.
            raise RuntimeError(
                f"{error} Copying a stage 3 model (copy.deepcopy: torch's AveragedModel, an EMA or teacher copy) "
                "would hold every parameter whole on every rank. For a moving average of the weights use the "
                "engine's sharded one: zero_optimization.weights_ema_decay and engine.ema_weights() "
                "(docs/core-api.md)") from None


class PartitionedView(torch.Tensor):
    """A view or alias of a partitioned parameter (see the module docstring); created by ``_bind_views`` only."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs)

    def __repr__(self) -> str:
        if is_stale(self) or is_released(self):
            state = "stale" if is_stale(self) else "partitioned"
            with _Disable():
                return f"PartitionedView(of {describe(self)}, shape {tuple(self.shape)}, {state})"
        with _Disable():
            return torch.Tensor.__repr__(self)

    def __format__(self, spec: str) -> str:
        return _format(self, spec)

    def __reduce_ex__(self, proto):
        """Pickle (torch.save) as a plain tensor: values only, never this class."""
        if is_released(self) or is_stale(self):
            plain = torch.Tensor.clone(self)  # gathered by the owner, or the clear error
        else:
            with _Disable():
                plain = self.as_subclass(torch.Tensor)
        return plain.__reduce_ex__(proto)


def unguarded() -> _Disable:
    """A context for the engine's own metadata reads on many parameters (``requires_grad``, ``.grad``): they
    skip the guard, which only has to watch the user's code."""
    return _Disable()


def mark_partitioned(param: nn.Parameter) -> None:
    """Switch the class of the user's parameter in place, keeping its identity (optimizers, ties, hooks)."""
    if not isinstance(param, PartitionedParameter):
        param.__class__ = PartitionedParameter


def unmark_partitioned(param: nn.Parameter) -> None:
    if isinstance(param, PartitionedParameter):
        param.__class__ = nn.Parameter
