"""The core's written contracts: what each kind of object promises to the code that uses it.

The engine drives a *runtime* (where parameters and gradients live: ``ReplicatedParamsRuntime`` for stages 1-2,
``PartitionedParamsRuntime`` for stage 3), which owns *parts* (one flat group of parameters with this rank's
fp32 master shards: ``FlatParamGroup``, ``ParamUnit``). A parameter has an *owner* (zero_core/registry.py): the
engine it trains under, or before setup the ``zero_core.Init`` partition it was built in. Checkpoints read an
engine through :class:`CheckpointedEngine`. Callers use these types instead of probing with ``hasattr``;
tests/core/test_contracts.py checks that each implementation satisfies its protocol.
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Protocol, Sequence,
                    runtime_checkable)

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: these modules import this one's users
    from zero_core.comm.communicator import Communicator
    from zero_core.comm.topology import Topology
    from zero_core.config import ZeroConfig
    from zero_core.fragments import Fragment
    from zero_core.layout import FlatLayout
    from zero_core.optim.loss_scaler import LossScaler
    from zero_core.optim.master_shards import MasterShards
    from zero_core.optim.weights_ema import WeightsEMA


class UpdateHandle(Protocol):
    """A part's optimizer update still being written into its parameter shards (the offloaded step overlapped
    with the next forward, zero_core/offload/overlapped_step.py; the delayed update's copies into the model,
    delayed_update.py)."""

    # True where every rank has issued the update's copies at its step call, so that ``wait`` is a stream wait
    # only; False where a thread still makes it (its readiness differs between ranks)
    issued: bool

    def wait(self) -> None:
        """Return once the update is in the shards (on an accelerator: the current stream is ordered after it)."""

    def ready(self) -> bool:
        """Whether ``wait`` would return without waiting on the host."""


def wait_for_update(part: "Part") -> None:
    """Before reading ``part``'s parameter shards (a gather): its update in flight, if any, has landed."""
    handle = part.update_in_flight
    if handle is not None:
        part.update_in_flight = None
        handle.wait()


def update_pending(part: "Part") -> bool:
    """Whether reading ``part``'s shards could still wait on the host for its update on some rank (ranks that
    prefetch together leave such a part to its own gather, so that their gathers stay the same collectives)."""
    handle = part.update_in_flight
    return handle is not None and not handle.issued


def update_landed(part: "Part") -> bool:
    """Whether reading ``part``'s shards now would not wait on the host for an update in flight (prefetch leaves
    such a part to its own gather rather than hold up the forward for it)."""
    handle = part.update_in_flight
    return handle is None or handle.ready()


@runtime_checkable
class PieceSlices(Protocol):
    """An NVMe-swapped master piece bigger than a tile, read and written a slice at a time outside the step
    (zero_core/offload/piece_in_file.py): what a checkpoint streams instead of reading the piece whole."""

    def read(self, key: Optional[str], start: int, end: int) -> Iterator[torch.Tensor]:
        """Elements ``[start, end)`` of the master (``key`` None) or of its state ``key``, as flat slices, each
        valid until the next is asked for."""

    def claim(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A file region for new optimizer state ``key``; returns its (empty) tensor in memory."""

    def write(self, key: Optional[str], start: int, end: int,
              fill: Callable[[int, int, torch.Tensor], None]) -> None:
        """Elements ``[start, end)`` of the master (also into the model) or of state ``key``, made by ``fill``."""


@runtime_checkable
class Part(Protocol):
    """One flat group of parameters of one optimizer group and dtype, with this rank's shards."""

    params: list[nn.Parameter]
    names: list[str]
    group_index: Optional[int]  # the optimizer group (counted across optimizers); stage 3: None when frozen
    layout: "FlatLayout"
    rank: int
    dtype: torch.dtype
    device: torch.device
    master_shards: Optional["MasterShards"]
    update_in_flight: Optional[UpdateHandle]  # set by an overlapped step until the shards hold its update
    swap: Optional[Any]  # offload_param nvme: the swap file holding its parameter shards (stage 3), else None
    on_grad_reduced: Optional[Callable]  # offload: called with (part, bucket or None) after each reduction

    @property
    def masters(self) -> list[nn.Parameter]:
        """What the optimizer steps: one fp32 piece per parameter fragment this rank owns."""

    def fragments(self) -> list["Fragment"]: ...

    def grad_shards(self) -> list[torch.Tensor]: ...

    def grad_views(self) -> list[torch.Tensor]:
        """The gradient shards, except that one offload moved to the host stays there (views without memory)."""

    def grad_view(self, bucket: int) -> torch.Tensor:
        """One bucket's gradient shard as it is, restoring nothing: for its dtype, size and device."""

    def grad_norm_inputs(self, norm_type: float) -> list:
        """Per bucket: the gradient shard, or its norm (grad_memory.KnownNorm) where offload moved it to the host."""

    def releases_grad(self, bucket: Optional[int] = None) -> bool:
        """Whether :meth:`grads_to_host` would give ``bucket``'s (None: every bucket's) memory back now."""

    def grads_to_host(self, copy_in: Callable, norm_types: Sequence[float], in_use: Optional[Any],
                      bucket: Optional[int] = None) -> bool:
        """Offload copied the reduced gradient of ``bucket`` (None: every bucket) to the host: give the accelerator
        memory back if this part can (``copy_in`` brings the values back for a later reader). Whether it did."""

    def param_shards(self) -> list[torch.Tensor]:
        """This rank's model-side (training dtype) shard of each bucket: what the masters write back into."""

    def shard_in_memory(self) -> ContextManager:
        """A context in which :meth:`param_shards` hold this rank's values (NVMe parameter offload reads them)."""

    def zero_grads(self) -> None: ...

    def write_back_masters(self) -> None: ...


@runtime_checkable
class Runtime(Protocol):
    """Where parameters and gradients live for one stage; the engine's only partner for them."""

    module: nn.Module
    config: "ZeroConfig"
    comm: "Communicator"
    parts: list  # the trainable Parts, in optimizer-group order
    units: Sequence  # the partitioned units, trainable or frozen (stage 3's ParamUnits); none at stages 1-2
    param_swap: Optional[Any]  # offload_param nvme: the swap file of parameter shards (stage 3), else None

    def managed_params(self) -> list[nn.Parameter]: ...

    def add_trainable(self, by_group: dict[int, list[nn.Parameter]]) -> list: ...

    def set_sync(self, sync: bool) -> None: ...

    def reduce_gradients(self, parts: list) -> None: ...

    def after_step(self, parts: list) -> None: ...

    def update_order(self, parts: list) -> list:
        """``parts`` in the order the next forward reads their parameter shards (an overlapped step updates
        them in this order)."""

    def zero_grads(self, parts: list) -> None: ...

    def joined_pass(self) -> None:
        """``engine.join()``: this rank ran out of batches; issue the forward and backward collectives the ranks
        with data issue this step, contributing zero gradients (a joined-rank step; the engine steps after it)."""

    def begin_generation(self, budget: int) -> bool:
        """Generation starts: no-grad forwards may keep up to ``budget`` gathered elements (stage 3); whether
        they will issue no collective (the whole model is gathered, or never partitioned)."""

    def end_generation(self) -> None:
        """Generation ends: release what it kept."""

    def release_all(self) -> None:
        """Release every gathered parameter not in use (stage 3's partition cache; nothing at stages 1-2)."""

    def add_external_after_setup(self, module: nn.Module, param: nn.Parameter) -> None:
        """``register_external_parameter`` after setup (stage 3 gathers it with ``module``; whole elsewhere)."""

    def gathers_on_read(self) -> bool:
        """Whether a read of a partitioned parameter outside its module's hooks gathers it now (stage 3, inside
        the model's forward or a backward); else such a read is an error."""

    def gather_on_read(self, params) -> None:
        """Gather ``params`` for a read their hooks did not cover (a collective)."""

    def quiesce(self, communicate: bool) -> None: ...

    def replicated_state(self) -> dict[str, torch.Tensor]: ...

    def replicated_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (whole shape, dtype) of what :meth:`iter_replicated` yields, in its order; no collective."""

    def iter_replicated(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The replicated state one item at a time, whole (stage 3: frozen parameters gathered one unit at a
        time, a collective: call on every rank, copy what you keep before the next item)."""

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def gather_params(self, params, editing: bool = False) -> list: ...

    def commit_params(self, params, opened: list, modified: bool) -> None: ...

    def rewritten_fragments(self, params) -> list["Fragment"]:
        """The fragments whose masters :meth:`commit_params` (and :meth:`refresh_param`) rewrite after ``params``
        changed: what NVMe offload reads in for it, instead of everything."""

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None: ...

    def param_shards(self) -> list[torch.Tensor]: ...

    def scratch_tensors(self) -> list[torch.Tensor]:
        """The constant-size scratch buffers (the pool); stage 2 lends one to its last bucket's ``.grad``."""

    def grad_tensors(self) -> list[torch.Tensor]: ...

    # What differs by stage, asked by the engine instead of the stage number.
    @staticmethod
    def prepare_module(module: nn.Module, config: "ZeroConfig") -> None:
        """Before the runtime is built: the module's dtype cast (whole at stages 1-2, buffers only at stage 3)."""

    def averages_whole_grads(self) -> bool:
        """Whether reducing leaves every rank the averaged whole gradient, as DDP does (then the step leaves
        the gradients for ``zero_grad``)."""

    def serve_generation(self, owner: Any) -> None:
        """Route Hugging Face ``generate()`` on the module as this stage needs (stage 3: in sessions)."""

    def take_grad_notes(self, notes: Any) -> bool:
        """Whether the runtime's own gradient hooks feed ``notes`` (else the engine hooks the parameters)."""


@runtime_checkable
class ParamOwner(Protocol):
    """Who manages a parameter (zero_core/registry.py): a ZeroEngine, or a zero_core.Init partition. Partitioned
    parameters (stage3/partitioned_param.py) and ``GatheredParameters`` go through it."""

    def describe(self, param: torch.Tensor) -> str:
        """The parameter's name, for error messages."""

    def handles_released(self, func) -> bool:
        """Whether ``func`` on a released (partitioned) parameter is answered by :meth:`run_on_released`."""

    def run_on_released(self, func, args, kwargs) -> Any: ...

    def gather_for_read(self, params) -> bool:
        """Gather released ``params`` for a read compiled code makes next (partitioned_param.py); False where no
        read may gather them now (then the read is an error naming the parameter)."""

    def gather_params(self, params, editing: bool = False) -> list:
        """Gather what is partitioned; returns what was opened (for :meth:`commit_params`), and where ``editing``
        (a modifier rank is given) what commit needs to tell the edit's changes. A collective."""

    def commit_params(self, params, opened: list, modified: bool) -> None: ...


@runtime_checkable
class PendingPartition(ParamOwner, Protocol):
    """A ``zero_core.Init`` partition: parameters partitioned at construction, before any engine."""

    def assign_data(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """``param.data = value`` inside the context: the partition takes the new values."""

    def take_whole_value(self, param: nn.Parameter) -> torch.Tensor:
        """Hand the parameter to stage 3's setup: its whole value; the partition forgets it."""

    def copy_in(self, param: nn.Parameter, source: torch.Tensor) -> nn.Parameter:
        """``param.copy_(source)`` (no grad) after the context: ``model.load_state_dict`` before setup."""

    def reopened(self) -> ContextManager:
        """The context open again (after it closed, before setup): ``resize_token_embeddings``."""


@runtime_checkable
class CheckpointedEngine(Protocol):
    """What zero_core/checkpoint reads and writes of an engine (a ZeroEngine)."""

    module: nn.Module
    config: "ZeroConfig"
    topology: "Topology"
    comm: "Communicator"
    inner_optimizers: list[torch.optim.Optimizer]
    group_optimizer: list[int]  # per optimizer group (counted across optimizers): its optimizer's index
    group_param_names: list[list[str]]  # per optimizer group: its parameters' names, frozen ones included
    skipped_steps: int
    weights_ema: Optional["WeightsEMA"]  # the sharded moving average of the masters, or None (weights_ema_decay)

    @property
    def device(self) -> torch.device: ...

    @property
    def loss_scaler(self) -> Optional["LossScaler"]: ...

    def restore_skipped_steps(self, count: int) -> None:
        """A loaded checkpoint's count of fp16 steps skipped for overflow."""

    def fragments(self, optimizer=None) -> list["Fragment"]: ...

    def trainable_params(self, optimizer=None) -> list[nn.Parameter]: ...

    def optimizer_state_of(self, master: torch.Tensor) -> dict: ...

    def offload_tiles(self, fragments: list["Fragment"], write: bool = False) -> Iterator[list["Fragment"]]:
        """Groups of ``fragments`` whose masters and state are in memory while held (NVMe: a few tiles)."""

    def offload_in_file(self, fragment: "Fragment") -> Optional[PieceSlices]:
        """While :meth:`offload_tiles` holds ``fragment``: its master left in the NVMe file, to read and write a
        slice at a time (a piece bigger than a tile); None where it is in memory."""

    def offload_resident(self, fragments: Optional[list["Fragment"]] = None, state: bool = True,
                         write: bool = True) -> ContextManager:
        """Masters (all, or those of ``fragments``) and, if ``state``, their optimizer state in memory while held;
        written out to NVMe again afterwards if ``write``."""

    def shape_in_memory(self, master: torch.Tensor, key=None) -> torch.Size:
        """The in-memory shape of a master or of its state ``key``, also while swapped out to NVMe."""

    def add_param_group(self, optimizer, param_group: dict) -> None: ...

    def replicated_state(self) -> dict[str, torch.Tensor]: ...

    def replicated_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]: ...

    def iter_replicated(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def refresh_params_from_masters(self) -> None: ...

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None: ...

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def gather_params(self, params, editing: bool = False) -> list: ...

    def commit_params(self, params, opened: list, modified: bool) -> None: ...
