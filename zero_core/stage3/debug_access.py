"""DeepSpeed's debugging API: full fp32 parameters, gradients and optimizer state, read and written by name.

Every function is a collective: all ranks must call it, in the same order, with the same parameter. Built on
:mod:`zero_core.fragments`, so it is the same code for every stage.
"""

from __future__ import annotations

import torch

from zero_core.arg_checks import check_parameter
from zero_core.fragments import whole_value, write_whole
from zero_core.registry import require_engine


def _assemble(engine, param: torch.Tensor, pick, state: bool = False) -> torch.Tensor:
    """Sum each rank's fragments of ``param`` into one full fp32 tensor on every rank."""
    full = torch.zeros(param.shape.numel(), dtype=torch.float32, device=engine.device)
    fragments = engine.fragments_of(engine.name_of(param))
    # NVMe-offloaded: this parameter's masters (and optimizer state, if read) are read in for the duration
    with engine.offload_resident(fragments, state=state, write=False):
        for fragment in fragments:
            full[fragment.param_range.as_slice()] = pick(fragment).float()
    engine.comm.all_reduce(full)
    return full.view(param.shape)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The fp32 master value of ``param``, whole, on every rank."""
    check_parameter(param, "zero_core.safe_get_full_fp32_param", "param")
    engine = require_engine(param)
    return whole_value(engine, param.shape, engine.fragments_of(engine.name_of(param)))


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor:
    """The reduced (averaged over ranks), unscaled fp32 gradient of ``param``; call after backward, before step."""
    check_parameter(param, "zero_core.safe_get_full_grad", "param")
    engine = require_engine(param)
    engine.reduce_gradients()
    scale = engine.loss_scale
    return _assemble(engine, param, lambda f: f.grad_values().float() / scale)


def _require_state(engine, key: str) -> None:
    states = [s for inner in engine.inner_optimizers for s in inner.state.values()]
    if not states:
        raise RuntimeError("the optimizer has no state yet: optimizer state exists after the first step()")
    if not any(key in s for s in states):
        raise KeyError(f"optimizer state has no key {key!r}; keys: {sorted(states[0])}")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor:
    """The per-element optimizer state ``optim_state_key`` (e.g. ``exp_avg``) of ``param``, whole."""
    check_parameter(param, "zero_core.safe_get_full_optimizer_state", "param")
    engine = require_engine(param)
    _require_state(engine, optim_state_key)
    return whole_value(engine, param.shape, engine.fragments_of(engine.name_of(param)), optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the fp32 master of ``param`` (and the model's copy) from ``value``, given on every rank."""
    check_parameter(param, "zero_core.safe_set_full_fp32_param", "param")
    engine = require_engine(param)
    flat = value.detach().reshape(-1).to(torch.float32)
    write_whole(engine, flat, engine.fragments_of(engine.name_of(param)))
    # NVMe: the masters it rewrites read in (stage 3 reads the whole unit's back from its shards), not everything
    with engine.offload_resident(engine.rewritten_fragments([param]), state=False):
        engine.refresh_param(param, value)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the per-element optimizer state ``optim_state_key`` of ``param`` from ``value``, given on every rank."""
    check_parameter(param, "zero_core.safe_set_full_optimizer_state", "param")
    engine = require_engine(param)
    _require_state(engine, optim_state_key)
    flat = value.detach().reshape(-1).to(torch.float32)
    write_whole(engine, flat, engine.fragments_of(engine.name_of(param)), optim_state_key)
