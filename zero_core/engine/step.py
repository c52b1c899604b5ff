"""The optimizer step of one optimizer: reduce what is pending, agree across ranks on overflow and on which
parameters got a gradient, clip, step the masters where they live, write the parameters back, and consume the
gradients. Also zero_grad, and the fp16 loss scale's bookkeeping, which both end in."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zero_core.engine.norms import global_norm, shard_norms
from zero_core.optim.loss_scaler import LossScaler


class OptimizerStep:
    """Steps and zeroes the optimizers of one engine.

    Partners: the runtime (reduces gradients, writes parameters back), the optimizer binding (which units each
    optimizer steps), the pending gradients, and the masters' backend (device or offload). ``add_unfrozen`` runs
    before gradients are reduced: parameters unfrozen since setup get master shards first."""

    def __init__(self, config, comm, runtime, binding, pending, masters, scaler: Optional[LossScaler],
                 add_unfrozen: Callable[[], None]) -> None:
        self.config = config
        self.comm = comm
        self.runtime = runtime
        self.binding = binding
        self.pending = pending
        self.masters = masters
        self.scaler = scaler
        self.add_unfrozen = add_unfrozen
        self.routes: list = []  # per optimizer: the plain loop's route of the user's own optimizer (plain_loop.py)
        self.weights_ema = None  # the sharded moving average of the masters, updated after each step (or None)
        self.skipped_steps = 0
        self.scaler_overflow: Optional[bool] = None  # a step's verdict waiting for the other optimizers

    @property
    def device(self) -> torch.device:
        units = self.runtime.parts
        return units[0].device if units else torch.device("cpu")

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    # -- before the step ------------------------------------------------------------------------------------
    def reduce(self, indices: list[int]) -> bool:
        """Reduce the gradients of optimizers ``indices`` not reduced yet; whether there were any."""
        self.add_unfrozen()
        of_optimizer = self.pending.of_optimizer
        indices = [k for k in indices if not of_optimizer[k].reduced]
        if not indices:
            return False
        self.runtime.reduce_gradients(self.binding.units(indices))
        for k in indices:
            of_optimizer[k].reduced = True
        return True

    def reduce_now(self, indices: list[int]) -> None:
        """``reduce_gradients``: reduce, and from then on check every further gradient before the step."""
        if self.reduce(indices):
            self.pending.arm()

    def norm_inputs(self, indices: list[int], norm_type: float) -> list:
        """What the norm of optimizers ``indices``' gradients is computed from: the shards, or the norms of those
        offload moved to the host (Part.grad_norm_inputs)."""
        return [s for unit in self.binding.units(indices) for s in unit.grad_norm_inputs(norm_type)]

    def clip(self, max_norm: float, norm_type: float, indices: list[int]) -> torch.Tensor:
        """Clip optimizers ``indices``' gradients by their global norm (applied at the step); returns the norm."""
        self.reduce_now(indices)
        norm = global_norm(self.comm, self.norm_inputs(indices, float(norm_type)), float(norm_type), self.device,
                           self.loss_scale)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for k in indices:
            self.pending.of_optimizer[k].clip_coef = coef
        return norm

    def agree(self, k: int) -> tuple[bool, list[list[bool]]]:
        """One small all-reduce (MAX) tells every rank whether any rank saw an fp16 overflow, and which of
        optimizer ``k``'s parameters got a gradient on some rank (per unit, in ``unit.params`` order)."""
        units = self.binding.units_of[k]
        count = sum(len(unit.params) for unit in units)
        used = self.pending.of_optimizer[k].used
        all_used = len(used) == count  # every parameter got a gradient here (used holds only this optimizer's)
        device = self.device
        if all_used:  # made where it is used: a host-to-device copy would wait for the device
            flags = torch.ones(count + 1, dtype=torch.uint8, device=device)
            flags[:1].zero_()  # a kernel; `flags[0] = 0` copies the scalar in from the host and waits (measured)
        else:
            flags = torch.zeros(count + 1, dtype=torch.uint8)
            if used:
                flag_slot = self.binding.flag_slot
                flags[torch.tensor([flag_slot[key] + 1 for key in used], dtype=torch.long)] = 1
            flags = flags.to(device)
        if self.scaler is not None:  # one max-norm kernel per dtype, no host sync: inf and nan propagate
            flags[0] = ~torch.isfinite(shard_norms(self.norm_inputs([k], math.inf), math.inf, device).max())
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, over="world")  # MiCS: a gradient on any replica counts
        if all_used and self.scaler is None:
            # Known without reading the result: the MAX of all ones is all ones, and nothing can overflow. Every
            # rank still joins the all-reduce (another may need it); reading it would stall the host until the
            # device has finished backward, and the step's kernels could no longer be queued behind it.
            return False, [[True] * len(unit.params) for unit in units]
        agreed = flags.tolist()  # 0 or 1 per parameter: the masks are read as truth values
        masks, start = [], 1
        for unit in units:
            masks.append(agreed[start : start + len(unit.params)])
            start += len(unit.params)
        return bool(agreed[0]), masks

    # -- the step -------------------------------------------------------------------------------------------
    def step(self, k: int) -> None:
        """Optimizer ``k``'s step (what its facade's ``step()`` runs)."""
        # Before any of the step's collectives: every rank issued the same ones since the last step (the
        # communicator's guard), so a divergence is an error here, not a hang or a wrong update.
        self.comm.guard.step_barrier()
        self.add_unfrozen()  # a parameter unfrozen since the last step may hold this step's only gradient
        pending = self.pending.of_optimizer[k]
        if not pending.saw_grad:
            self.zero([k])  # nothing to apply: every rank ran the same (empty) step
            return
        self.reduce([k])  # not armed: no backward can come before this step ends
        overflow, used = self.agree(k)
        if overflow:
            self.skipped_steps += 1
            self.record_overflow(True)
            self.zero([k])
            return
        if pending.clip_coef is None and self.config.gradient_clipping > 0:
            self.clip(self.config.gradient_clipping, 2.0, [k])
        units = self.binding.units_of[k]
        with self.routes[k].real_update():  # through any LR scheduler wrapper on it, so that it counts the step
            self.masters.step(self.binding.inner_optimizers[k], units, used, 1.0 / self.loss_scale,
                              pending.clip_coef)
        # each way of stepping sets the masters' .grad only around its own optimizer.step() and clears it there
        if self.weights_ema is not None:
            self.weights_ema.update([m for unit in units for m in unit.masters])
        self.comm.forget_secondary()  # hpZ: the in-node copies hold the old values
        self.runtime.after_step(units)
        self.record_overflow(False)
        self.finish(k)

    def finish(self, k: int) -> None:
        """Gradients are consumed, as DeepSpeed's step does; except when they are averaged whole like DDP's:
        then, like a torch optimizer, the step leaves them for ``zero_grad()``."""
        if not self.runtime.averages_whole_grads():
            self.zero([k])
            return
        self.pending.collect()
        self.pending.clear([k])
        self.pending.disarm_if_idle()
        self.update_scale()

    def zero(self, indices: list[int]) -> None:
        """Clear optimizers ``indices``' gradients (all of them: unmanaged parameters' ``.grad`` too)."""
        units = self.binding.units(indices)
        self.runtime.zero_grads(units)
        self.masters.forget_grads(units)
        if len(indices) == len(self.binding.inner_optimizers):
            for param in self.binding.unmanaged:
                param.grad = None
        self.pending.collect()
        self.pending.clear(indices)
        self.pending.disarm_if_idle()
        self.update_scale()

    # -- fp16 -----------------------------------------------------------------------------------------------
    def record_overflow(self, overflow: bool) -> None:
        """The fp16 scale changes only once no optimizer holds gradients made with the current scale, so that
        every step unscales by the scale its gradients were made with (as GradScaler.update once per iteration)."""
        if self.scaler is not None:
            self.scaler_overflow = bool(self.scaler_overflow) or overflow

    def update_scale(self) -> None:
        self.pending.collect()
        if self.scaler_overflow is not None and not self.pending.any_saw_grad():
            self.scaler.update(overflow=self.scaler_overflow)
            self.scaler_overflow = None
