"""Stage 3: parameters partitioned across ranks, gathered just before a module runs and released after.

Units (param_unit.py) are a block's (block_units.py) or else a module's own parameters per optimizer group and
dtype, built at setup by unit_setup.py. This file holds what the hooks do: hooks on the user's modules (in place,
no wrapper) gather a module's units before its forward and, through backward_hooks.py, before its backward; they
release them after each. Gradients are reduce-scattered unit by unit as soon as a unit's last
gradient is accumulated. Prefetch follows the execution trace that every rank agreed on (execution_trace.py).
docs/stage3.md explains what is gathered when and every knob.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional

import torch
from torch import nn

from zero_core.buffer_pool import BufferPool
from zero_core.comm.communicator import Communicator
from zero_core.config import ZeroConfig
from zero_core.fragments import Fragment
from zero_core.contracts import update_landed, update_pending
from zero_core.planning import PARTITIONED_IN_FLIGHT
from zero_core.reduction import BackwardSession, ReductionQueue
from zero_core.stage3.backward_hooks import PreBackward, after_input_grads, attach
from zero_core.stage3.coalesced import CoalescedReduce
from zero_core.stage3.divergence import ReduceOrder, leaf_hint
from zero_core.stage3.execution_trace import ExecutionTrace
from zero_core.stage3.generation_keeping import GenerationKeeping
from zero_core.stage3.gradients import GradientReduction
from zero_core.stage3.param_unit import ParamUnit, UnitState, gather_together
from zero_core.stage3.partitioned_param import set_gather_on_read_flag
from zero_core.stage3.phase import Phase, checked
from zero_core.stage3.policy import Stage3Policy
from zero_core.stage3.prefetch import Prefetcher
from zero_core.stage3.state import BackwardState, UnitUse
from zero_core.stage3.unit_setup import UnitSetup


class PartitionedParamsRuntime(UnitSetup, GradientReduction):
    """Owns the units, the module hooks, gathering and releasing for stage 3, and all of stage 3's state: the
    typed records of state.py (``backward``: this backward's; ``use``: which gathered units are in use) and
    three objects with their own verbs, composed here: ``prefetch`` (prefetch.py: the trace cursors, what to
    gather ahead, what to keep), ``reduce_order`` (divergence.py: the agreed order of reduce-scatters) and
    ``generation`` (generation_keeping.py: what a generation session keeps). Only this class changes them. Two
    parts of it are written against the same state, each with a Protocol saying what it needs: the units and
    hooks built at setup (unit_setup.py) and the gradient side (gradients.py: gradient hooks, reduce buckets,
    the end-of-backward flush). Other code drives the runtime through the ``zero_core.contracts.Runtime``
    verbs."""

    MAX_IN_FLIGHT = PARTITIONED_IN_FLIGHT  # reduction buckets in flight while the next one fills (each holds a bucket's buffer)
    param_swap = None  # offload_param nvme (zero_core/offload/params.py): the swap file of unit shards
    param_elements_in_cpu = 0  # offload_param: shard elements moved to host memory so far

    def __init__(self, module, trainable_by_group, names, config: ZeroConfig, comm: Communicator) -> None:
        self.module = module
        self.config = config
        self.policy = Stage3Policy.from_config(config)  # what the hooks read, frozen at setup
        self.comm = comm
        self.names = names
        self.use = UnitUse()  # gathered units in use: open forwards, units held to the end of the backward
        self.generation = GenerationKeeping()  # what a generation session keeps (generation_keeping.py)
        self._start_unit_tables(module)  # empty unit tables; the leaves, tiles and blocks (unit_setup.py)
        self.live_elements = 0  # gathered elements now, and the most ever (max_live_parameters is checked on it)
        self.peak_live_elements = 0
        self._build_units(trainable_by_group)
        self.parts = [u for u in self.units if u.trainable]
        device = self.units[0].device if self.units else torch.device("cpu")
        self.pool = BufferPool(device, self._bucket_numel())
        module_names = self._plan_root_group()  # the hooked modules; the root's first if it gathers a group
        self.trace = ExecutionTrace(module_names, comm)
        self.prefetch = Prefetcher(self.trace, self.policy, comm, self._units_for, self._tiles)  # prefetch.py
        self.comm.check = True  # verify collectives while the first trace is recorded
        # no_sync, waiting gradients and the end-of-backward flush (zero_core/reduction.py, shared with stage 2)
        self.session = BackwardSession(self._finish_backward)
        self._inflight: ReductionQueue[tuple[CoalescedReduce, torch.Tensor]] = ReductionQueue(
            self._complete_reduction, self.MAX_IN_FLIGHT, self.policy.overlap_comm)
        self.phase = Phase.IDLE  # phase.py
        self._resume_phase = Phase.IDLE  # the phase a backward returns to
        self._root_depth = 0  # the model's forward calls now open (a read inside one gathers: gather_on_read)
        # Once every rank agreed on the trace, gradients are reduce-scattered in one order fixed by it, whatever
        # modules a rank skipped ([Note: one reduce order], divergence.py); none while recording.
        self.reduce_order = ReduceOrder()
        self.backward = BackwardState(cursor=len(self.trace.order) - 1)  # this backward's record (state.py)
        self._register_hooks(module_names)
        # A trace deviation on any rank is agreed at the step barrier, so all ranks re-record together.
        comm.guard.on_step(lambda: self.trace.deviated, self._agree_on_deviation)

    def managed_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    def describe(self, param) -> str:
        return self.names.get(param, "<unknown>")

    # -- the units a module's hooks gather (unit_setup.py builds the tables) -----------------------------
    def _units_for(self, mod: nn.Module) -> list[ParamUnit]:
        units = self._unit_cache.get(mod)
        if units is None:
            units = self._own.get(mod, []) + self._externals.get(mod, [])
            if mod is self.module and self.root_group:
                group = [u for m in self.root_group.members for u in self._units_for(m)]
                units = list(dict.fromkeys(units + group))
                self.root_group.units = set(group)
            self._unit_cache[mod] = units
        return units

    # -- phases (phase.py) ---------------------------------------------------------------------------------
    def _to(self, phase: Phase) -> None:
        self.phase = checked(self.phase, phase)

    def _begin_backward_phase(self) -> None:
        """A backward starts (a module's backward, a gradient, or a joined-rank step): it returns to this phase."""
        if self.phase is not Phase.BACKWARD:
            self._resume_phase = self.phase
            self._to(Phase.BACKWARD)

    def _root_pre_forward(self, module, args) -> None:
        self._root_depth += 1
        phase = self.phase
        if phase is Phase.BACKWARD:
            return  # recomputation under activation checkpointing
        if phase is Phase.STEPPED:
            self._end_trace_step()
        self._to(Phase.FORWARD)
        self.trace.start_forward()

    def _root_post_forward(self, module, args, output) -> None:
        self._root_depth -= 1
        if self.phase is not Phase.BACKWARD and not torch.is_grad_enabled() and self.generation.budget is None:
            self.release_all()  # no backward follows: nothing needs to stay gathered

    def _pre_forward(self, mod, _hook_module, args, kwargs):
        if self.generation.keep_all and not torch.is_grad_enabled():
            return args, kwargs  # generation with the whole model gathered: nothing to gather, count or trace
        units = self._units_for(mod)
        if self.phase is Phase.BACKWARD:
            # Recomputation under activation checkpointing: it may stop early, inside a module, so its forward
            # hook never runs; nothing is counted here and backward releases what it gathered.
            self._fetch(units, None, backward=False, phase="backward")
            self._note_group_gathered(mod)
            return args, kwargs
        position = self.trace.visit(mod)
        try:
            for skipped in self.trace.take_skipped():
                self._gather_skipped_forward(skipped)  # modules this rank skipped: [Note: skipped modules]
            self._fetch(units, position, backward=False)
        except RuntimeError as error:
            if "collective mismatch" not in str(error):
                raise
            raise type(error)(f"{error} {leaf_hint(self.module, mod)}") from error
        self._note_group_gathered(mod)
        self.backward.touched.update(units)
        use = self.use
        use.positions[mod].append(position)
        active = use.active
        for unit in units:
            active[unit] += 1
        if torch.is_grad_enabled():
            if after_input_grads(functools.partial(self._post_backward, mod, position), (args, kwargs)) and mod in self._blocks:
                self.backward.open_blocks[mod] += 1
        return args, kwargs

    def _post_forward(self, mod, _hook_module, args, output):
        if self.generation.keep_all and not torch.is_grad_enabled():
            return output  # generation with the whole model gathered (see _pre_forward)
        if self.phase is Phase.BACKWARD:
            return output  # recomputation under activation checkpointing: backward releases these
        units = self._units_for(mod)
        use = self.use
        active = use.active
        for unit in units:
            if active[unit] > 0:  # an optimizer step inside this forward (manual optimization) reset the counts
                active[unit] -= 1
        positions = use.positions[mod]
        position = positions.pop() if positions else None
        returned = () if type(output) is torch.Tensor else self._returned_units(output)  # a plain tensor: none
        grad_enabled = torch.is_grad_enabled()
        wrapped = 0
        if grad_enabled:
            output, wrapped = attach(PreBackward, functools.partial(self._pre_backward, mod), output)
        is_root, is_tile = mod is self.module, mod in self._tiles
        for unit in units:
            if unit in returned or (grad_enabled and wrapped == 0 and unit.active_count()):
                use.held.add(unit)  # still needed outside this module: keep until the step's backward ends
            elif active[unit] > 0 or (is_root and self.prefetch.root_keeps(grad_enabled, unit, self.live_elements)):
                continue  # used by an enclosing forward still open; or the root's, whose backward comes next
            elif self.generation.budget is not None and self.generation.keeps(unit, self.live_elements):
                continue  # generation: the next decoding step runs the same modules
            elif is_tile or not self.prefetch.reused_soon(position, unit, self.live_elements, grad_enabled):
                self._release(unit)
        return output

    def _returned_units(self, output) -> set:
        leaves = output if isinstance(output, (tuple, list)) else [output]
        return {self.unit_of[leaf] for leaf in leaves if isinstance(leaf, nn.Parameter) and leaf in self.unit_of}

    def _pre_backward(self, mod) -> None:
        self._enter_backward()
        self._fetch(self._units_for(mod), self._backward_position(mod), backward=True)
        self._note_group_gathered(mod)

    def _note_group_gathered(self, mod) -> None:
        if mod is self.module and self.root_group:
            self.root_group.gathered = True  # the root's units include the group's: the gates stand down

    def _backward_position(self, mod) -> Optional[int]:
        if not self.trace.following:
            return None
        order = self.trace.order
        if mod is self.module:
            # The root's backward comes first (its output is the loss), not last as its trace position says:
            # prefetch from the end of the trace, and leave the cursor for the modules that follow.
            return len(order)
        state = self.backward
        while state.cursor >= 0 and order[state.cursor] is not mod:
            if state.cursor in state.skipped_positions:
                self._gather_skipped_backward(state.cursor)
            state.cursor -= 1
        if state.cursor < 0:
            return None
        state.cursor -= 1
        return state.cursor + 1

    def _post_backward(self, mod, position: Optional[int] = None) -> None:
        is_tile = mod in self._tiles
        active, held = self.use.active, self.use.held
        for unit in self._units_for(mod):
            if active[unit] == 0 and unit not in held and (
                    is_tile or not self.prefetch.reused_soon(position, unit, self.live_elements, in_backward=True)):
                self._release(unit)
        open_blocks = self.backward.open_blocks
        if mod in self._blocks and open_blocks[mod] > 0:
            open_blocks[mod] -= 1
            if open_blocks[mod] == 0:
                self._block_backward_done(mod)

    # -- modules this rank skipped, and a joined rank's step ([Note: skipped modules], divergence.py) ----------
    def _gather_skipped_forward(self, position: int) -> None:
        """What another rank's hooks do for the module at ``position`` of the trace: gather its units, prefetch
        from there, then release what is not reused soon."""
        module = self.trace.order[position]
        self.backward.skipped_positions.add(position)
        units = self._units_for(module)
        self._fetch(units, position, backward=False)
        active, held = self.use.active, self.use.held
        for unit in units:
            if active[unit] > 0 or unit in held or self.prefetch.reused_soon(position, unit, self.live_elements):
                continue
            # a generation session keeps it as on the ranks that ran the module
            if self.generation.budget is None or not self.generation.keeps(unit, self.live_elements):
                self._release(unit)

    def _gather_skipped_backward(self, position: int) -> None:
        """The backward of a module this rank skipped: gather its units and prefetch as the others do, release;
        its units' reduce-scatter (zeros) goes once the reduce order reaches them."""
        units = self._units_for(self.trace.order[position])
        self._fetch(units, position, backward=True)
        active, held = self.use.active, self.use.held
        for unit in units:
            if active[unit] == 0 and unit not in held:
                self._release(unit)
        self.backward.skipped_units.update(units)
        if self.reduce_order.units is not None:
            self.reduce_order.launch_ready(self.backward, self._reduce)

    def joined_pass(self) -> None:
        """``engine.join()``: this rank ran out of batches. Issue the forward and backward collectives the ranks
        with data issue this step, as a rank that skipped every module of the agreed trace would, contributing
        zero gradients ([Note: skipped modules])."""
        if self.trace.state.value != "valid":
            raise RuntimeError(
                "engine.join(): this rank ran out of batches before stage 3 agreed on its execution trace (the "
                "first step); every rank needs at least one full step before it can join the others' steps"
            )
        self._root_pre_forward(self.module, ())
        order = self.trace.order
        # A hooked root (its own units, or the root group: root_group.py) is at position 0 and open through the
        # forward; after it, its units stay for the backward or go as its post-forward decides; its backward
        # comes first (a prefetch from the end of the trace), before the modules' in reverse order.
        root = self._units_for(self.module) if order and order[0] is self.module else []
        active = self.use.active
        for unit in root:
            active[unit] += 1
        for position in range(len(order)):
            self._gather_skipped_forward(position)
        self.trace.position = len(order)
        for unit in root:
            active[unit] -= 1
            if not (self.prefetch.root_keeps(True, unit, self.live_elements)
                    or self.prefetch.reused_soon(0, unit, self.live_elements, True)):
                self._release(unit)
        self._begin_backward_phase()
        if root:
            self._fetch(root, len(order), backward=True)
            self.backward.skipped_units.update(root)
        for position in reversed(range(1 if root else 0, len(order))):
            self._gather_skipped_backward(position)
        self.reduce_order.launch_ready(self.backward, self._reduce)
        state = self.backward
        for unit in self.reduce_order.remaining(state):
            if unit not in state.reduced and unit.active_count():
                self._reduce(unit)  # units no trace position holds: reduced last, as at the end of a backward
        self._flush_bucket()  # the last, partly filled reduction bucket, as _finish_backward sends it
        self._complete_inflight()
        self.use.active.clear()
        self.release_all()
        self._end_backward()
        self.session.unsynced_grads = False

    # -- gather / release ---------------------------------------------------------------------------------
    def _fetch(self, units: list[ParamUnit], position: Optional[int], backward: bool,
               phase: Optional[str] = None) -> None:
        """Gather a module's ``units`` and, following the trace from ``position``, the next prefetch batch, in one
        collective; return once ``units`` are gathered. ``phase`` (default: from ``backward``) is what the gather
        serves, for ZeRO++'s paths (hpZ serves backward gathers from the in-node copy)."""
        batch = list(dict.fromkeys(u for u in units if u.state is UnitState.SHARDED))
        if position is not None and self.trace.following:
            ahead = self.prefetch.next_batch(position, backward, set(batch), self.live_elements,
                                             self.generation.budget)
            # An overlapped offloaded step may still be writing a unit ahead: its own gather waits for it, so
            # that this module's work is not held up behind the units after it. Alone, a rank prefetches what
            # has landed; with others, only units with no update pending on a thread (the same units on every
            # rank, so that the ranks' gathers stay the same collectives). The cursor moves past the units left out.
            alone = self.comm.topology.world_size == 1
            batch += [unit for unit in ahead if (update_landed(unit) if alone else not update_pending(unit))]
        if self.param_swap is not None:  # offload_param nvme: read these shards, then the trace's next, ahead
            following = position is not None and self.trace.following
            self.param_swap.look_ahead(batch, self.trace.order if following else None, position, backward,
                                       self._units_for)
        self._start_gather(batch, phase or ("backward" if backward else "forward"))
        for unit in units:
            unit.wait()

    def _note_live(self, delta: int) -> None:
        self.live_elements += delta
        self.peak_live_elements = max(self.peak_live_elements, self.live_elements)

    def _gather(self, unit: ParamUnit, async_op: bool = False, phase: Optional[str] = None) -> None:
        if unit.state is UnitState.SHARDED:
            self._note_live(unit.numel)
        unit.gather(async_op=async_op, phase=phase)

    def _start_gather(self, units: list[ParamUnit], phase: str) -> None:
        """One all-gather for all these sharded units (coalesced.py; ZeRO++ paths gather per unit)."""
        if units:
            for unit in units:
                self._note_live(unit.numel)
            gather_together(units, self.comm, phase)

    def _release(self, unit: ParamUnit) -> None:
        generation = self.generation
        if generation.keep_all:
            return  # a generation session holds the whole model until it ends (generation.py)
        if generation.unguarded and not unit.persistent:
            generation.guard(unit)  # released memory: the guard watches its parameters again
        if unit.state is not UnitState.SHARDED and not unit.persistent:
            unit.release()
            self._note_live(-unit.numel)
            if unit in self.root_group.units:
                self.root_group.gathered = False  # its members' own hooks gather again (root_group.py)

    def release_all(self) -> None:
        """Release every gathered, non-persistent unit (``engine.empty_partition_cache()``)."""
        self.use.held.clear()
        active = self.use.active
        for unit in self.units:
            if active[unit] == 0:
                self._release(unit)

    # -- generation sessions (generation_keeping.py) ------------------------------------------------------------
    def begin_generation(self, budget: int) -> bool:
        """Until ``end_generation``: no-grad forwards keep units gathered while ``budget`` elements allow; True
        when the whole model is gathered now, so that forwards issue no collective."""
        return self.generation.begin(budget, self.units, self.live_elements, self._start_gather)

    def end_generation(self) -> None:
        """Leave generation: release what it kept (memory back to the training level)."""
        if self.generation.end():
            self.release_all()
            self.generation.guard_all()

    # -- parameters read outside their own module's forward ----------------------------------------------------
    def gathers_on_read(self) -> bool:
        """Whether a read of a partitioned parameter gathers it now: inside the model's forward (a patched
        forward reading ``self.lm_head.weight`` directly, as TRL's fused LM head does) or a backward."""
        return self._root_depth > 0 or self.phase is Phase.BACKWARD

    def gather_on_read(self, params) -> None:
        """Gather the units of ``params``, read where no hook gathered them (every rank runs the same forward, so
        every rank reads them too). With a backward to come they stay gathered until it ends, as a module's
        returned parameter does (autograd may have saved them); otherwise the end of the model's forward
        releases them. Registering them (register_external_parameter) lets prefetch gather them earlier."""
        units = list(dict.fromkeys(self.unit_of[p] for p in params if p in self.unit_of))
        for unit in units:
            self._gather(unit)
            set_gather_on_read_flag(unit.params, True)  # compiled reads keep calling in: [Note: compiled reads]
        self.backward.touched.update(units)
        if torch.is_grad_enabled():
            self.use.held.update(units)

    # -- the engine's calls --------------------------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        self.session.sync = sync

    def reduce_gradients(self, parts: list[ParamUnit]) -> None:
        """Reduce what ``parts`` (one optimizer's units, or all) still hold in ``param.grad``."""
        if self.session.unsynced_grads:
            self._finish_backward(only=set(parts))

    def update_order(self, parts: list[ParamUnit]) -> list[ParamUnit]:
        """Persistent units first (``after_step`` gathers them at once), then the units in the order the last
        forward gathered them (the trace), then the rest in model order."""
        wanted = set(parts)
        ordered = [unit for unit in parts if unit.persistent]
        seen = set(ordered)
        for module in self.trace.order:
            for unit in self._units_for(module):
                if unit in wanted and unit not in seen:
                    ordered.append(unit)
                    seen.add(unit)
        return ordered + [unit for unit in parts if unit not in seen]

    def after_step(self, parts: list[ParamUnit]) -> None:
        """Updated masters of ``parts`` go back into the 16-bit shards; persistent units are gathered again, and
        any other gathered copy is dropped (stale, or no longer needed)."""
        stale = []
        for unit in parts:
            unit.write_back_masters()
            if unit.persistent or (self.generation.keep_all and unit.state is not UnitState.SHARDED):
                unit.state = UnitState.SHARDED  # its full copy is stale: gather the new values
                stale.append(unit)  # (a generation session that holds the whole model keeps holding it)
        gather_together(stale, self.comm)  # all issued at once (one collective where they coalesce)
        for unit in stale:
            unit.wait()
        self.use.active.clear()
        self.release_all()
        if self.phase is Phase.BACKWARD and self._resume_phase is not Phase.IDLE:
            self._resume_phase = Phase.STEPPED  # a step inside a backward: the backward ends in STEPPED
        elif self.phase in (Phase.FORWARD, Phase.STEPPED):
            self._to(Phase.STEPPED)  # the trace's step ends at the next root forward
        else:
            self._end_trace_step()  # the model is driven through its submodules: the step is the trace's unit
            self.trace.start_forward()

    def _agree_on_deviation(self, deviated: list) -> None:
        self.trace.deviated = any(deviated)

    def _end_trace_step(self) -> None:
        self.trace.end_step()
        self.comm.check = self.comm.always_check or self.trace.state.value == "recording"
        if self.trace.state.value != "valid":
            self.reduce_order.forget()
        else:
            self.reduce_order.follow(self.trace.order, self._units_for, self.parts)
        self.backward.cursor = len(self.trace.order) - 1

    def zero_grads(self, parts: list[ParamUnit]) -> None:
        for unit in parts:
            unit.zero_grads()

    def quiesce(self, communicate: bool) -> None:
        """Teardown (engine.close): finish every collective still in flight (prefetched gathers, overlapped
        reduce-scatters) and free what they gathered. ``communicate=False`` (the process group is gone): drop
        the handles instead of waiting."""
        if communicate:
            self._flush_bucket()
            self._complete_inflight()
        else:
            self._inflight.drop()
            self.backward.bucket = None
        for unit in self.units:
            if not communicate:
                unit.drop_pending()
            self._release(unit)
        self.use.held.clear()
        self.use.active.clear()

    def replicated_state(self) -> dict[str, torch.Tensor]:
        """Buffers, plus frozen parameters gathered into whole copies (they are partitioned in stage 3): all of
        them at once; :meth:`iter_replicated` holds one unit at a time."""
        frozen = {name: param.detach().clone() for name, param in self.iter_full_params(frozen_only=True)}
        return {**frozen, **dict(self.module.named_buffers())}

    def replicated_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Frozen parameters' whole shapes (a released parameter keeps its shape) and buffers', no collective."""
        frozen = [(n, p) for unit in self.units if not unit.trainable for n, p in zip(unit.names, unit.params)]
        return {name: (t.shape, t.dtype) for name, t in [*frozen, *self.module.named_buffers()]}

    def iter_replicated(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Frozen parameters, gathered one unit at a time (a collective), then buffers."""
        yield from self.iter_full_params(frozen_only=True)
        yield from self.module.named_buffers()

    def iter_full_params(self, frozen_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter whole, one unit gathered at a time (copy what you keep before the next item)."""
        for unit in self.units:
            if frozen_only and unit.trainable:
                continue
            was_sharded = unit.state is UnitState.SHARDED
            self._gather(unit)
            for name, param in zip(unit.names, unit.params):
                yield name, param
            if was_sharded:
                self._release(unit)

    def gather_params(self, params, editing: bool = False) -> list[ParamUnit]:
        """Gather the units holding ``params`` (GatheredParameters); returns those that were sharded. (An edit's
        changes are told from the shards themselves: ParamUnit.write_full_into_shard.)"""
        units = list(dict.fromkeys(self.unit_of[p] for p in params if p in self.unit_of))
        opened = [u for u in units if u.state is UnitState.SHARDED]
        for unit in units:
            self._gather(unit)
        return opened

    def commit_params(self, params, opened: list[ParamUnit], modified: bool) -> None:
        """After GatheredParameters: keep in-place changes (every rank already holds them), release."""
        units = list(dict.fromkeys(self.unit_of[p] for p in params if p in self.unit_of))
        for unit in units:
            if modified:
                unit.write_full_into_shard()
        for unit in opened:
            self._release(unit)

    def rewritten_fragments(self, params) -> list[Fragment]:
        """Every fragment of the units holding ``params``: commit_params reads the whole unit's masters back from
        its shards."""
        units = dict.fromkeys(self.unit_of[p] for p in params if p in self.unit_of)
        return [fragment for unit in units for fragment in unit.fragments()]

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        opened = self.gather_params([param])
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        self.commit_params([param], opened, modified=True)

    def param_shards(self) -> list[torch.Tensor]:
        return [t for u in self.units for t in u.stored()] + [u.full for u in self.units]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return self.pool.tensors()

    def grad_tensors(self) -> list[torch.Tensor]:
        """What holds gradient memory now (accounting: a released shard counts nothing and stays released)."""
        return [u.grad_storage() for u in self.parts]

    # -- what differs by stage, asked by the engine instead of the stage number (contracts.Runtime) ----------
    @staticmethod
    def prepare_module(module: nn.Module, config: ZeroConfig) -> None:
        """Before the runtime is built: only the buffers in the training dtype (each unit is cast as it is
        partitioned: a whole-model cast would touch partitioned parameters); the leaf modules marked."""
        from zero_core.optim.mixed_precision import cast_buffers
        from zero_core.stage3.leaf_modules import apply_leaf_config

        if config.param_dtype != torch.float32:
            cast_buffers(module, config.param_dtype)
        leaves = config.leaf_module
        apply_leaf_config(module, leaves.classes, leaves.names, leaves.name_suffixes)

    def averages_whole_grads(self) -> bool:
        """Gradients are reduce-scattered into each rank's shard."""
        return False

    def serve_generation(self, owner) -> None:
        """Hugging Face ``generate()`` runs in sessions: kept gathers, ranks run until all are done."""
        from zero_core.stage3.generation import generate_in_sessions

        generate_in_sessions(self.module, owner)

    def take_grad_notes(self, notes) -> bool:
        """The engine hooks the parameters itself to learn which got a gradient."""
        return False
