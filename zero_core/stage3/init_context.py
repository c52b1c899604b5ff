"""``zero_core.Init``: build a model already partitioned across ranks (DeepSpeed's ``zero.Init``).

While the context is open, each submodule's own parameters are partitioned as soon as the submodule is attached
to its parent (its ``__init__`` has finished by then), and the remaining ones when the context closes. So no
rank holds more than one module's parameters whole while a model is built. Each parameter starts from rank 0's
values (one broadcast), whatever each rank's random seed.

Initialisation code that runs after a submodule was partitioned — ``self.apply(self._init_weights)``,
``nn.init.normal_(self.emb.weight)`` — still works (``override_module_apply``): an operation on a partitioned
parameter gathers it, runs, and a change is broadcast from rank 0 and partitioned again. Views work too
(``self.emb.weight[pad].zero_()``, ``weight.data.normal_()``): a view stays bound to its parameter, and each
operation on it gathers the parameter again (partitioned_param.PartitionedView), so a view never points at
freed memory and at most one operation's parameters are whole at a time.
``zero_core.setup(model, optimizer, {"stage": 3})`` then takes the partitions over, one module at a time.

Pretrained weights go straight into the shards: ``zero_core.load_pretrained`` (and ``from_pretrained`` of a
Hugging Face model while the context is open, zero_core/pretrained/) has each rank read only its own elements of
each tensor and hands them to :meth:`Init.adopt_shard` or writes them into :meth:`Init.shard_of`, so no rank
ever holds a whole model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from zero_core import registry
from zero_core.arg_checks import check_dtype, check_init_module, check_process_group
from zero_core.comm.communicator import Communicator
from zero_core.config import ZeroConfig
from zero_core.layout import Range, compute_layout
from zero_core.stage3.partitioned_param import base_of, mark_partitioned, tensors_in, unmark_partitioned
from zero_core.comm.topology import Topology
from zero_core.pretrained import resize_embeddings, transformers_hook


@dataclass
class _InitShard:
    label: str
    full: torch.Tensor  # padded whole value; zero-sized storage while partitioned
    shard: torch.Tensor


class Init:
    """Partition parameters at construction time. Every rank must build the same model inside it."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group=None, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype: Optional[torch.dtype] = None,
                 rank0_reads: bool = False) -> None:
        check_init_module(module)
        check_process_group(data_parallel_group, "zero_core.Init", "data_parallel_group")
        check_dtype(dtype, "zero_core.Init")
        self.enabled = enabled
        # Pretrained weights: rank 0 reads each tensor and broadcasts it, instead of every rank reading its own
        # slices (for file systems where many readers are slow; Accelerate's cpu_ram_efficient_loading).
        self.rank0_reads = rank0_reads
        self.group = data_parallel_group
        self.config = ZeroConfig.coerce(config if config is not None else config_dict_or_path,
                                        "zero_core.Init: config" if config is not None else
                                        "zero_core.Init: config_dict_or_path")
        self.dtype = dtype
        self._shards = WeakIdKeyDictionary()
        self._pending: dict[int, nn.Module] = {}
        self._handles = []
        self._open = False
        self.comm: Optional[Communicator] = None
        self.peak_gathered_elements = 0
        self._gathered_elements = 0
        self._module = module
        self._transformers_hook = None

    # -- the context ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self.comm = Communicator(Topology.from_process_group(self.group))
        self._handles = [
            register_module_module_registration_hook(self._on_submodule),
            register_module_parameter_registration_hook(self._on_parameter),
        ]
        self._open = True
        self._transformers_hook = transformers_hook.install(self)
        resize_embeddings.install_if_loaded()  # stays: a script resizes after the context, before setup
        if self._module is not None:
            self._partition_tree(self._module)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        transformers_hook.uninstall(self._transformers_hook)
        for module in list(self._pending.values()):
            self._partition_own(module)
        self._pending.clear()
        self._open = False

    @contextlib.contextmanager
    def reopened(self) -> Iterator["Init"]:
        """The context open again for code that runs after it and changes partitioned parameters' values or
        shapes (``resize_token_embeddings``, pretrained/resize_embeddings.py); as is while it is open."""
        if self._open or not self.enabled:
            yield self
            return
        with self:
            yield self

    def _on_parameter(self, module: nn.Module, name: str, param) -> None:
        if param is not None and param not in self._shards:
            self._pending[id(module)] = module

    def _on_submodule(self, parent: nn.Module, name: str, child) -> None:
        if child is not None:
            self._pending[id(parent)] = parent
            self._partition_tree(child)

    def _partition_tree(self, module: nn.Module) -> None:
        for sub in module.modules():
            self._partition_own(sub)

    def _partition_own(self, module: nn.Module) -> None:
        for name, param in module.named_parameters(recurse=False):
            if param not in self._shards and not param.is_meta:
                self._partition(param, f"{type(module).__name__}.{name}")
        self._pending.pop(id(module), None)

    # -- one parameter -------------------------------------------------------------------------------------
    def _partition(self, param: nn.Parameter, label: str) -> None:
        world, rank = self.comm.topology.world_size, self.comm.topology.rank
        layout = compute_layout([param.numel()], world, param.numel())
        dtype = self.dtype or param.dtype
        full = torch.zeros(layout.total, dtype=dtype, device=param.device)
        full[: param.numel()].copy_(param.detach().reshape(-1))
        self.comm.broadcast(full, src=0)
        size = layout.shard_numel
        shard = full[rank * size : (rank + 1) * size].clone()
        param.data = full[: param.numel()].view(param.shape)
        full.untyped_storage().resize_(0)
        self._shards[param] = _InitShard(label, full, shard)
        mark_partitioned(param)
        registry.register_pending([param], self)

    # -- pretrained weights, straight into the shards (zero_core/pretrained/) -------------------------------
    def shard_range(self, numel: int) -> tuple[Range, int]:
        """This rank's elements of a parameter of ``numel`` elements, and its shard's padded size."""
        rank = self.comm.topology.rank
        size = self._shard_numel(numel)
        return Range(min(rank * size, numel), min((rank + 1) * size, numel)), size

    def _shard_numel(self, numel: int) -> int:
        """compute_layout([numel], world, numel).shard_numel (one parameter padded to a multiple of the world
        size), without building a layout: pretrained loading asks it for every parameter."""
        return -(-max(numel, 1) // self.comm.topology.world_size)

    def adopt_shard(self, shape: torch.Size, shard: torch.Tensor, requires_grad: bool, label: str) -> nn.Parameter:
        """A new partitioned parameter of ``shape`` whose only values on this rank are ``shard`` (padded to the
        shard size); nothing of it was ever whole here."""
        numel = shape.numel()
        total = self._shard_numel(numel) * self.comm.topology.world_size
        full = torch.empty(total, dtype=shard.dtype, device=shard.device)  # never touched: freed at once
        param = nn.Parameter(full[:numel].view(shape), requires_grad=requires_grad)
        full.untyped_storage().resize_(0)
        self._shards[param] = _InitShard(label, full, shard)
        mark_partitioned(param)
        registry.register_pending([param], self)
        return param

    def shard_of(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of a partitioned parameter (padded), to be written in place: its first
        ``shard_range(numel).size`` elements are the parameter's elements of :meth:`shard_range`."""
        return self._shards[param].shard

    def _gather(self, param: nn.Parameter) -> bool:
        entry = self._shards[param]
        if entry.full.untyped_storage().nbytes() > 0:
            return False
        entry.full.untyped_storage().resize_(entry.full.numel() * entry.full.element_size())
        self.comm.all_gather(entry.full, entry.shard, label=entry.label)
        self._gathered_elements += entry.full.numel()
        self.peak_gathered_elements = max(self.peak_gathered_elements, self._gathered_elements)
        return True

    def _release(self, param: nn.Parameter, keep_changes: bool) -> None:
        entry = self._shards[param]
        if keep_changes:
            self.comm.broadcast(entry.full, src=0)  # ranks may have drawn different random numbers
            size = entry.shard.numel()
            rank = self.comm.topology.rank
            entry.shard.copy_(entry.full[rank * size : (rank + 1) * size])
        entry.full.untyped_storage().resize_(0)
        self._gathered_elements -= entry.full.numel()

    # -- the owner protocol (partitioned_param.py, GatheredParameters, stage 3 setup) -----------------------
    def describe(self, param) -> str:
        entry = self._shards.get(param)
        return entry.label if entry is not None else "<unknown>"

    def handles_released(self, func) -> bool:
        return self._open and self.config.override_module_apply

    def gather_for_read(self, params) -> bool:
        """Compiled code cannot keep a parameter gathered for one operation as ``run_on_released`` does: its read
        is the error that points to GatheredParameters."""
        return False

    def copy_in(self, param: nn.Parameter, source: torch.Tensor) -> nn.Parameter:
        """``param.copy_(source)`` after the context, before setup: what ``model.load_state_dict`` does. Rank 0's
        values are kept, as inside the context; one parameter is gathered at a time."""
        with torch.no_grad():
            self.run_on_released(torch.Tensor.copy_, (param, source), {})
        return param

    def run_on_released(self, func, args, kwargs):
        """Gather the partitioned parameters ``func`` touches (directly or through views), run it, release them;
        a change is kept (rank 0's values). A view it returns stays bound to its parameter
        (``PartitionedView``), so the next operation on the view gathers the parameter again: no view ever
        points at freed memory, and no more than the parameters of one operation are whole at a time."""
        touched = [t for t in tensors_in(args, kwargs) if base_of(t) is not None]
        params = list({id(p): p for p in map(base_of, touched) if p in self._shards}.values())
        with torch._C.DisableTorchFunctionSubclass():
            versions = [t._version for t in touched]
        opened = [p for p in params if self._gather(p)]
        try:
            result = func(*args, **kwargs)
        finally:
            with torch._C.DisableTorchFunctionSubclass():
                changed = any(t._version != v for t, v in zip(touched, versions))
            name = getattr(func, "__name__", "")
            changed = changed or (name.endswith("_") and not name.startswith("__"))  # also writes through .data
            for param in opened:
                self._release(param, keep_changes=changed)
        return result

    def assign_data(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """``param.data = value`` while the context is open: the partition takes rank 0's new values (a new shape
        or dtype is partitioned afresh), instead of the parameter silently leaving its partition."""
        entry = self._shards.get(param)
        if entry is None:
            with torch._C.DisableTorchFunctionSubclass():
                param.data = value
            return
        if value.shape == param.shape and value.dtype == entry.full.dtype:
            with torch.no_grad():
                self.run_on_released(torch.Tensor.copy_, (param, value.detach()), {})
            return
        if entry.full.untyped_storage().nbytes() > 0:
            raise RuntimeError(
                f"parameter '{entry.label}' gets .data of another shape or dtype while it is gathered "
                "(GatheredParameters under zero_core.Init): assign it outside the GatheredParameters block"
            )
        del self._shards[param]
        unmark_partitioned(param)
        param.data = value.detach().clone()
        self._partition(param, entry.label)

    def gather_params(self, params, editing: bool = False) -> list:
        return [p for p in params if p in self._shards and self._gather(p)]

    def commit_params(self, params, opened: list, modified: bool) -> None:
        for param in params:
            if param in self._shards and any(param is p for p in opened):
                self._release(param, keep_changes=modified)
            elif param in self._shards and modified:
                self._gather(param)
                self._release(param, keep_changes=True)

    def take_whole_value(self, param: nn.Parameter) -> torch.Tensor:
        """Hand the parameter to stage 3's setup: its whole value, and this context's storage is freed."""
        entry = self._shards.pop(param)
        entry.full.untyped_storage().resize_(entry.full.numel() * entry.full.element_size())
        self.comm.all_gather(entry.full, entry.shard, label=entry.label)
        value = entry.full[: param.numel()].view(param.shape)
        unmark_partitioned(param)
        return value
