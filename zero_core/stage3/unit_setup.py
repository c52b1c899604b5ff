"""Stage 3 at setup: the units built from the plan, which module gathers which, and the hooks registered.

``UnitSetup`` is a part of ``PartitionedParamsRuntime`` (runtime.py), written as a mixin over the runtime's
state, as ``GradientReduction`` is (gradients.py): what it needs of the runtime is ``UnitSetupHost``. It runs at
setup and when the units change afterwards (parameters that become trainable, an external parameter registered
late); the hooks it registers call the runtime's hook-time methods, which stay in runtime.py. Which modules are
hooked as one: a leaf module with everything below it (leaf_modules.py), a ``TiledLinear`` tile (tile_units.py),
a block of a ``ModuleList`` (block_units.py); the modules outside the blocks form the root group
(root_group.py).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from zero_core.buffer_pool import BufferPool
from zero_core.layout import FlatLayout
from zero_core.planning import ParamSpec, UnitPlan, plan_units, unit_layout
from zero_core.stage3 import param_sources
from zero_core.stage3.block_units import block_of, unit_owners
from zero_core.stage3.external_params import registered_externals
from zero_core.stage3.leaf_modules import leaf_of, z3_leaf_module
from zero_core.stage3.param_unit import ParamUnit
from zero_core.stage3.partitioned_param import mark_partitioned
from zero_core.stage3.root_group import Gate, RootGroup, plan_root_group
from zero_core.stage3.streams import SideStreams
from zero_core.stage3.tile_units import tile_of

if TYPE_CHECKING:
    from zero_core.comm.communicator import Communicator
    from zero_core.config import ZeroConfig
    from zero_core.reduction import BackwardSession
    from zero_core.stage3.divergence import ReduceOrder
    from zero_core.stage3.execution_trace import ExecutionTrace
    from zero_core.stage3.generation_keeping import GenerationKeeping
    from zero_core.stage3.policy import Stage3Policy


def eager(hook):
    """Keep a hook out of torch.compile's graphs (as FSDP2 does): gathers, releases and collectives run eagerly
    between compiled regions, so a compiled module or block trains exactly as the eager one."""
    return torch.compiler.disable(hook, recursive=True)


@runtime_checkable
class UnitSetupHost(Protocol):
    """What ``UnitSetup`` reads and calls on the runtime it is part of (besides the unit tables it fills)."""

    module: nn.Module
    config: "ZeroConfig"
    policy: "Stage3Policy"
    comm: "Communicator"
    names: dict
    parts: list[ParamUnit]
    pool: BufferPool
    trace: "ExecutionTrace"
    session: "BackwardSession"
    reduce_order: "ReduceOrder"
    generation: "GenerationKeeping"
    _units_for: Callable[[nn.Module], list[ParamUnit]]
    _gather: Callable[..., None]
    _note_live: Callable[[int], None]
    _bucket_numel: Callable[[], int]
    _hook_grads: Callable[[list[ParamUnit]], None]
    _root_pre_forward: Callable
    _root_post_forward: Callable
    _pre_forward: Callable
    _post_forward: Callable


class UnitSetup:
    """Builds and changes stage 3's unit tables: ``units`` (in index order), ``unit_of`` (parameter -> unit),
    ``_own`` / ``_externals`` (module -> the units its hooks gather: its own, and others' it uses) and
    ``_module_of`` (unit -> the module that owns it); registers the module hooks."""

    def _start_unit_tables(self, module: nn.Module) -> None:
        """The unit tables, empty; which module's hooks gather a module's parameters: the leaf module, tile or
        block enclosing it."""
        self.units: list[ParamUnit] = []
        self._own: dict[nn.Module, list[ParamUnit]] = defaultdict(list)
        self._externals: dict[nn.Module, list[ParamUnit]] = defaultdict(list)
        self.unit_of: dict[nn.Parameter, ParamUnit] = {}
        self._module_of: dict[ParamUnit, nn.Module] = {}
        self._unit_count = 0
        self._unit_cache: dict[nn.Module, list[ParamUnit]] = {}  # _units_for, cleared when units change
        self._inside_leaf = leaf_of(module)  # modules below a leaf module -> that leaf (leaf_modules.py)
        self._inside_tile = tile_of(module, self._inside_leaf)  # module -> its TiledLinear tile (tile_units.py)
        self._tiles = set(self._inside_tile.values())  # released after use, prefetched one ahead
        self._inside_block = block_of(module, self._inside_leaf, self._inside_tile)  # module -> its block
        self._blocks = set(self._inside_block.values())
        self._deferred: set[ParamUnit] = set()  # units inside leaves: reduced at the end of backward, in order
        self.root_group = RootGroup([])  # planned once the units exist (_plan_root_group)

    def _plan_root_group(self) -> dict[nn.Module, str]:
        """The modules outside the blocks, gathered by the root's hooks (root_group.py); the root then joins the
        trace. Returns the hooked modules' names, as the trace records them."""
        module = self.module
        module_names = {m: n for n, m in module.named_modules() if m in self._own or m in self._externals}
        self.root_group = plan_root_group(module, list(module_names), self._blocks, self._units_for,
                                          self.policy.max_live_parameters)
        if self.root_group:
            module_names = {module: "<root>", **module_names}
        return module_names

    def _build_units(self, trainable_by_group) -> None:
        """Partition the units planning.py plans (``self.plan``, the estimator counts the same plan), one owner
        at a time (a block, or a module outside blocks: block_units.unit_owners): an owner's meta parameters are
        materialised just before its units take them."""
        group_of = {p: i for i, params in enumerate(trainable_by_group) for p in params}
        device = next((p.device for p in self.module.parameters() if not p.is_meta), torch.device("cpu"))
        self.streams = SideStreams(device)  # CUDA: the gather and reduce streams (streams.py); none on the CPU
        owner_of = unit_owners(self.module)
        members: dict[str, list[tuple[str, nn.Module]]] = defaultdict(list)  # owner -> its modules, model order
        owned: dict[str, list[nn.Parameter]] = defaultdict(list)  # owner -> the parameters first registered there
        seen: set[nn.Parameter] = set()
        for module_name, mod in self.module.named_modules():
            owner = owner_of[module_name]
            members[owner].append((module_name, mod))
            params = [p for p in mod.parameters(recurse=False) if p not in seen]
            owned[owner] += params
            seen.update(params)
        specs = [(name, [ParamSpec(p.numel(), str(p.dtype), group_of.get(p), name) for p in params])
                 for name, params in owned.items()]
        self.plan = plan_units(specs, self.comm.topology.world_size, self.config, device)
        flat = [p for params in owned.values() for p in params]
        planned = defaultdict(list)
        for unit in self.plan.units:
            planned[unit.module].append(unit)
        for owner_name, modules in members.items():
            hooked = self._hooked(modules[0][1])  # inside a leaf: its units are gathered with the leaf
            for module_name, mod in modules:
                param_sources.materialize_meta(mod, module_name, device)
                for param in mod.parameters(recurse=False):
                    if param in self.unit_of:  # registered by an earlier owner (tied)
                        self._add_external(hooked, self.unit_of[param])
            for unit in planned[owner_name]:
                self._add_unit(owner_name, hooked, [flat[i] for i in unit.members], unit)
        for mod, params in registered_externals(self.module):
            for param in params:
                self._add_external(self._hooked(mod), self.unit_of[param])
        for buffer in self.module.buffers():
            self.comm.broadcast(buffer, src=0)  # every rank starts from rank 0's buffers, as with DDP

    def _add_unit(self, module_name, mod, params, plan: UnitPlan) -> None:
        broadcast = not all(param_sources.comes_from_init(p) for p in params)
        values = [param_sources.whole_value(p) for p in params]
        self._new_unit(module_name, mod, params, plan.group_index, values, plan.persistent, broadcast, plan.layout)

    def _new_unit(self, module_name, mod, params, group_index, values, persistent: bool, broadcast: bool,
                  layout: Optional[FlatLayout] = None):
        if layout is None:  # a unit split by add_trainable: laid out as planning.py lays out every unit
            layout = unit_layout([p.numel() for p in params], self.comm.topology.world_size, self.config,
                                 params[0].device)
        dtype = self.policy.param_dtype if params[0].is_floating_point() else params[0].dtype
        unit = ParamUnit(self._unit_count, module_name, params, [self.names[p] for p in params], group_index, layout,
                         self.comm, dtype)
        self._unit_count += 1
        unit.persistent = persistent
        unit.streams = self.streams
        unit.store_quantized = self._stores_quantized(unit)
        unit.shard_values(values, broadcast=broadcast,
                          master_dtype=None if self.config.masters_offloaded else torch.float32)
        for param in params:
            mark_partitioned(param)
            self.unit_of[param] = unit
        self.units.append(unit)
        self._own[mod].append(unit)
        self._units_changed()
        self._module_of[unit] = mod
        if z3_leaf_module(mod):
            self._deferred.add(unit)  # its children may run on some ranks only: no early, rank-dependent reduce
        if unit.persistent:
            self._note_live(unit.numel)
        return unit

    def _stores_quantized(self, unit: ParamUnit) -> bool:
        """zero_quantized_nontrainable_weights: frozen units the hooks gather keep 8-bit shards (not persistent
        ones, kept whole anyway, nor offloaded ones, whose 16-bit shards leave the accelerator)."""
        offload = self.config.offload_param
        return (self.config.zero_quantized_nontrainable_weights and not unit.trainable and not unit.persistent
                and unit.dtype.is_floating_point and (offload is None or offload.device == "none"))

    def add_trainable(self, by_group: dict[int, list[nn.Parameter]]) -> list[ParamUnit]:
        """Parameters that became trainable after setup (unfrozen, or in a group added later). They sit in frozen
        units: each such unit is gathered once and rebuilt as one unit per optimizer group (its still-frozen
        parameters keep a frozen unit), with masters and gradient hooks. A collective; returns the new
        trainable units."""
        group_of = {p: index for index, params in by_group.items() for p in params}
        new = []
        for unit in list(dict.fromkeys(self.unit_of[p] for p in group_of)):
            new += self._split_unit(unit, group_of)
        self.units.sort(key=lambda u: u.index)
        self.parts = [u for u in self.units if u.trainable]
        # the agreed reduce order names units: rebuild it over the new ones
        self.reduce_order.rebuild(self.trace.order, self._units_for, self.parts)
        if self._bucket_numel() > self.pool.largest:
            self.pool = BufferPool(self.pool.device, self._bucket_numel())
        trainable = [u for u in new if u.trainable]
        self._hook_grads(trainable)
        # A backward since the unfreezing left gradients in param.grad: the step reduces them.
        self.session.unsynced_grads = self.session.unsynced_grads or any(p.grad is not None for u in trainable for p in u.params)
        return trainable

    def _split_unit(self, unit: ParamUnit, group_of: dict) -> list[ParamUnit]:
        if unit.trainable:
            raise RuntimeError(f"unit of '{unit.module_name}' is trainable already (a bug: please report it)")
        mod = self._module_of[unit]
        self._gather(unit)
        values = {p: p.detach().clone() for p in unit.params}
        self.generation.guard(unit)
        unit.release(force=True)
        self._note_live(-unit.numel)
        self.units.remove(unit)
        self._own[mod].remove(unit)
        self._units_changed()
        keys = sorted({group_of.get(p, -1) for p in unit.params})
        pieces = []
        for key in keys:
            members = [p for p in unit.params if group_of.get(p, -1) == key]
            pieces.append(self._new_unit(unit.module_name, mod, members, key if key >= 0 else None,
                                         [values[p] for p in members], unit.persistent, broadcast=False))
        for externals in self._externals.values():  # modules that also use these parameters (ties)
            if unit in externals:
                externals.remove(unit)
                externals.extend(pieces)
        self._units_changed()
        return pieces

    def _hooked(self, mod: nn.Module) -> nn.Module:
        """The module whose hooks gather ``mod``'s parameters: the leaf module, tile or block enclosing it, or
        itself."""
        leaf = self._inside_leaf.get(mod)
        if leaf is not None:
            return leaf
        return self._inside_tile.get(mod) or self._inside_block.get(mod, mod)

    def _add_external(self, mod: nn.Module, unit: ParamUnit) -> None:
        if unit not in self._externals[mod] and unit not in self._own[mod]:
            self._externals[mod].append(unit)
            self._units_changed()

    def add_external_after_setup(self, mod: nn.Module, param: nn.Parameter) -> None:
        """register_external_parameter called after setup: gather ``param`` with ``mod`` from now on."""
        if param not in self.unit_of:
            return
        mod = self._hooked(mod)
        hooked = mod in self._own or mod in self._externals
        self._add_external(mod, self.unit_of[param])
        if not hooked:
            self.trace.module_names[mod] = type(mod).__name__
            self.trace.reset()
            self._hook_module(mod)

    def _units_changed(self) -> None:
        self._unit_cache.clear()
        self.root_group.gathered = False  # new or split units start sharded: the root's next hook gathers them

    # -- hooks ---------------------------------------------------------------------------------------------
    def _register_hooks(self, module_names) -> None:
        root = self.module
        root.register_forward_pre_hook(eager(self._root_pre_forward))
        root.register_forward_hook(eager(self._root_post_forward), always_call=True)  # closes _root_depth
        for mod in module_names:
            self._hook_module(mod, gated=mod in self.root_group.members)
        self._hook_grads(self.parts)

    def _hook_module(self, mod: nn.Module, gated: bool = False) -> None:
        """``gated``: a root group member, whose hooks do nothing while the group is gathered (root_group.py)."""
        pre = eager(functools.partial(self._pre_forward, mod))
        post = eager(functools.partial(self._post_forward, mod))
        if gated:
            pre, post = Gate(self.root_group, pre), Gate(self.root_group, post)
        mod.register_forward_pre_hook(pre, with_kwargs=True)
        mod.register_forward_hook(post)
