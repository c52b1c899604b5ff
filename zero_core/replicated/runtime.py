"""Stages 1 and 2: every rank keeps whole parameters; master weights, optimizer state (and, in stage 2,
gradients) are sharded. The engine drives this runtime through the same methods as stage 3's.
"""

from __future__ import annotations

import functools
import weakref
from typing import Iterator, Optional

import torch
from torch import nn

from zero_core.buffer_pool import BufferPool
from zero_core.comm.communicator import Communicator
from zero_core.config import ZeroConfig
from zero_core.fragments import Fragment
from zero_core.optim.master_shards import take_changed_values
from zero_core.contracts import wait_for_update
from zero_core.grad_notes import GradNotes
from zero_core.replicated.flat_param_group import FlatParamGroup
from zero_core.replicated.grad_reducer import GradReducer
from zero_core.planning import FlatGroupPlan, ParamSpec, plan_flat_groups, plan_replicated


class ReplicatedParamsRuntime:
    """Flat parameter groups, the bucketed gradient reducer, and the all-gather after each step; a
    ``zero_core.contracts.Runtime``."""

    param_swap: Optional[object] = None  # parameters are never offloaded at stages 1-2
    units: tuple = ()  # no partitioned units: every rank keeps whole parameters
    grad_notes: Optional[GradNotes] = None  # the engine's record of gradients, fed by stage 2's hooks

    def __init__(
        self,
        module: nn.Module,
        trainable_by_group: list[list[nn.Parameter]],
        names: dict,
        config: ZeroConfig,
        comm: Communicator,
    ) -> None:
        self.module = module
        self.config = config
        # Stage 2 reduce-scatters gradients into each rank's shard as backward runs; stage 1 keeps whole
        # gradients until the step (or clipping) reduces them.
        self.partitions_grads = config.stage >= 2
        self.comm = comm
        self.names = names
        self.parts = self._build_groups(trainable_by_group, names)
        # None: offload_optimizer makes the fp32 masters in host memory from views of the flat buffers
        self._master_dtype = None if config.masters_offloaded else torch.float32
        self._broadcast_initial_state()
        for part in self.parts:
            part.build_masters(self._master_dtype)
        device = self.parts[0].device if self.parts else torch.device("cpu")
        self.pool = BufferPool(device, self._largest_bucket())
        self.reducer = self._make_reducer(sync=True)
        if self.partitions_grads:  # one Python call per forward (weakly: the module must not keep the runtime alive)
            hook = functools.partial(_before_forward, weakref.ref(self))
            self._forward_hook = module.register_forward_pre_hook(hook)

    def _largest_bucket(self) -> int:
        return max((b.range.size for g in self.parts for b in g.layout.buckets), default=1)

    def _make_reducer(self, sync: bool) -> GradReducer:
        reducer = GradReducer(
            self.parts,
            self.comm,
            self.pool,
            partition_grads=self.partitions_grads,
            overlap=self.config.resolved_overlap_comm,
            use_reduce_scatter=self.config.reduce_scatter,
            ignore_unused=self.config.ignore_unused_parameters,
            model_position={p: i for i, p in enumerate(self.module.parameters())},
        )
        reducer.session.sync = sync
        reducer.grad_notes = self.grad_notes
        return reducer

    def take_grad_notes(self, notes: GradNotes) -> bool:
        """Stage 2 hooks every trainable parameter anyway: its hook records the parameter in ``notes`` first,
        and the engine needs no hook of its own (True). Stage 1 has no per-parameter hook (False)."""
        if not self.partitions_grads:
            return False
        self.grad_notes = self.reducer.grad_notes = notes
        return True

    def _build_groups(self, trainable_by_group, names) -> list[FlatParamGroup]:
        """The flat groups planning.py plans (``self.plan``, the estimator counts the same plan)."""
        specs = [[ParamSpec(p.numel(), str(p.dtype), index) for p in trainable]
                 for index, trainable in enumerate(trainable_by_group)]
        device = next((p.device for trainable in trainable_by_group for p in trainable), None)
        self.plan = plan_replicated(specs, self.comm.topology.world_size, self.config, device)
        return [self._group_from(plan, trainable_by_group[plan.group_index]) for plan in self.plan.groups]

    def _groups_of(self, index: int, trainable: list[nn.Parameter]) -> list[FlatParamGroup]:
        """One flat group per dtype of optimizer group ``index``'s trainable parameters."""
        plans = plan_flat_groups(index, [str(p.dtype) for p in trainable], [p.numel() for p in trainable],
                                 self.comm.topology.world_size, self.config, trainable[0].device if trainable else None)
        return [self._group_from(plan, trainable) for plan in plans]

    def _group_from(self, plan: FlatGroupPlan, trainable: list[nn.Parameter]) -> FlatParamGroup:
        members = [trainable[i] for i in plan.members]
        return FlatParamGroup(members, [self.names[p] for p in members], plan.group_index, plan.layout,
                              self.comm.topology.rank, full_grads=not self.partitions_grads)

    def add_trainable(self, by_group: dict[int, list[nn.Parameter]]) -> list[FlatParamGroup]:
        """Parameters that became trainable after setup (unfrozen, or in a group added later): new flat groups
        with their masters, and a reducer covering every group. Their values are already the same on every
        rank (replicated like DDP's, and not stepped while frozen), so nothing is communicated."""
        new = [g for index, params in sorted(by_group.items()) for g in self._groups_of(index, params)]
        for group in new:
            group.build_masters(self._master_dtype)
        self.parts += new
        if self._largest_bucket() > self.pool.largest:
            self.pool = BufferPool(self.pool.device, self._largest_bucket())
        sync = self.reducer.session.sync
        self.reducer.close()
        self.reducer = self._make_reducer(sync)
        # A backward since the unfreezing left gradients in param.grad (or the old reducer's last bucket had
        # some waiting): the step reduces them.
        self.reducer.session.unsynced_grads = self.reducer.holds_unsynced()
        return new

    def managed_params(self) -> list[nn.Parameter]:
        return [p for g in self.parts for p in g.params]

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's weights and buffers, as DDP does."""
        for tensor in [g.flat for g in self.parts] + list(self.replicated_state().values()):
            self.comm.broadcast(tensor.data, src=0)

    # -- the engine's calls --------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        self.reducer.session.sync = sync

    def reduce_gradients(self, parts: list[FlatParamGroup]) -> None:
        """Reduce what ``parts`` (one optimizer's groups, or all) hold locally into their gradient shards."""
        if not self.partitions_grads:
            self.reducer.reduce_full_grads(set(parts))
        else:
            self.reducer.flush_unsynced(set(parts))
            self.reducer.reduce_last(set(parts))

    def joined_pass(self) -> None:
        """``engine.join()``: this rank ran out of batches. Issue the backward collectives the ranks with data
        issue this step, with zero gradients (stage 2's buckets; stage 1 reduces at the step, as every rank)."""
        self.reducer.joined_backward()

    def begin_generation(self, budget: int) -> bool:
        """Nothing to keep: stages 1 and 2 hold whole parameters, so forwards issue no collective (generation.py)."""
        return True

    def end_generation(self) -> None:
        """Nothing was kept (stages 1 and 2)."""

    def after_step(self, parts: list[FlatParamGroup]) -> None:
        """Every rank updated its shards of ``parts``; all-gather them so each rank holds whole parameters again
        (a group whose update an overlapped step is still writing is gathered once it landed, while the next
        group steps)."""
        works = []
        for group in parts:
            wait_for_update(group)
            group.write_back_masters()
            for bucket in group.layout.buckets:
                works += self._gather_bucket(group, bucket)
        for work in works:
            work.wait()

    def update_order(self, parts: list[FlatParamGroup]) -> list[FlatParamGroup]:
        """The order ``after_step`` gathers them in."""
        return list(parts)

    def _gather_bucket(self, group: FlatParamGroup, bucket) -> list:
        full = group.flat[bucket.range.as_slice()]
        if not self.config.allgather_partitions:
            pieces = [bucket.shard_range(r).shift(-bucket.range.start) for r in range(self.comm.topology.world_size)]
            return [self.comm.broadcast(full[p.as_slice()], src=r, async_op=True) for r, p in enumerate(pieces)]
        return [self.comm.all_gather_in_place(full, async_op=True)]  # this rank's slice of it is its shard

    def zero_grads(self, parts: list[FlatParamGroup]) -> None:
        if not self.partitions_grads:
            for group in parts:
                group.zero_grads()
            return
        cleared = self.reducer.cleared_on_zero  # the last bucket's parameters keep their slots as .grad
        for group in parts:
            group.zero_grads(cleared.get(group, group.params))
        self.reducer.zero_last_bucket(parts)

    def quiesce(self, communicate: bool) -> None:
        """Teardown (engine.close): finish the overlapped reduce-scatters still in flight, or, when the process
        group is gone (``communicate=False``), drop their handles."""
        self.reducer.quiesce(communicate)

    def replicated_state(self) -> dict[str, torch.Tensor]:
        """Buffers and parameters outside every optimizer group: identical on every rank, not sharded."""
        return dict(self.iter_replicated())

    def replicated_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {name: (t.shape, t.dtype) for name, t in self.iter_replicated()}

    def iter_replicated(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What :meth:`replicated_state` holds, one item at a time (no collective: all of it is whole here)."""
        managed = {id(p) for p in self.managed_params()}
        yield from ((n, p) for n, p in self.module.named_parameters() if id(p) not in managed)
        yield from self.module.named_buffers()

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()

    def gather_params(self, params, editing: bool = False) -> list:
        """Parameters are whole on every rank already; ``editing``: their values now, so that commit_params can
        tell what the edit changed (the model may lag its masters: the delayed update)."""
        return [(p, p.detach().clone()) for p in params if p in self.names] if editing else []

    def release_all(self) -> None:
        pass  # nothing is gathered at stages 1-2

    def gathers_on_read(self) -> bool:
        return False  # parameters are whole: no read ever needs a gather

    def gather_on_read(self, params) -> None:
        pass

    def add_external_after_setup(self, module: nn.Module, param: nn.Parameter) -> None:
        pass  # parameters are whole: a module using another's parameter needs no gather

    def commit_params(self, params, opened: list, modified: bool) -> None:
        """Parameters changed in place (and broadcast): copy them into their fp32 master fragments."""
        if not modified:
            return
        values = {self.names[p]: p.detach().reshape(-1) for p in params if p in self.names}
        before = {self.names[p]: copy.reshape(-1) for p, copy in opened}
        for part in self.parts:
            for fragment in part.fragments():
                if fragment.name in values:  # (the elements it changed: the rest keep their fp32 values)
                    where = fragment.param_range.as_slice()
                    old = before[fragment.name][where] if fragment.name in before else None
                    take_changed_values(fragment.master_values(), values[fragment.name][where], old)

    def rewritten_fragments(self, params) -> list[Fragment]:
        """The fragments of ``params`` (commit_params copies each changed parameter into its own)."""
        names = {self.names[p] for p in params if p in self.names}
        return [fragment for part in self.parts for fragment in part.fragments() if fragment.name in names]

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    def param_shards(self) -> list[torch.Tensor]:
        return []  # parameters are whole: module.parameters() already covers them

    def scratch_tensors(self) -> list[torch.Tensor]:
        return self.pool.tensors()

    def grad_tensors(self) -> list[torch.Tensor]:
        """What holds gradient memory now (accounting: released memory counts nothing and stays released)."""
        return [storage for g in self.parts for storage in g.grad_storages()]

    # -- what differs by stage, asked by the engine instead of the stage number (contracts.Runtime) ----------
    @staticmethod
    def prepare_module(module: nn.Module, config: ZeroConfig) -> None:
        """Before the runtime is built: the whole model in the training dtype (every rank keeps it whole)."""
        from zero_core.optim.mixed_precision import cast_module

        if config.param_dtype != torch.float32:
            cast_module(module, config.param_dtype)

    def averages_whole_grads(self) -> bool:
        """Stage 1 with ``reduce_scatter: false`` all-reduces whole gradients, exactly as DDP does."""
        return not self.partitions_grads and not self.config.reduce_scatter

    def serve_generation(self, owner) -> None:
        """Hugging Face ``generate()`` runs as written: every parameter is whole."""


def _before_forward(runtime_ref: weakref.ref, module: nn.Module, args) -> None:
    """Stage 2: a ``.grad`` of the last bucket cleared since the step (``model.zero_grad()``) is its slot again
    before this forward's backward (replicated/last_bucket.py). Not inside torch.compile, which would break its
    graph here: the reduction takes such a gradient into the slot anyway."""
    if torch.compiler.is_compiling():
        return
    runtime = runtime_ref()
    if runtime is not None:
        runtime.reducer.before_forward()
