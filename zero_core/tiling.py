"""``TiledLinear``: one linear layer split into tiles that stage 3 gathers one at a time (memory-centric tiling).

DeepSpeed's ``deepspeed.zero.TiledLinear``, same signature and semantics: the weight is cut into
``out_splits x in_splits`` tiles, each an own ``linear_cls`` (``linears[out_id][in_id]``); the input's last
dimension is split along ``in_parts``, each row of tiles sums its partial products, and the rows are concatenated
(or returned as a list). The bias lives in the last tile of each row (``in_id == in_splits - 1``). At stage 3 each
tile is its own unit, gathered just before it runs and released after it, with the next tile prefetched
(stage3/tile_units.py), so a layer larger than the gather budget runs; at stages 0-2 it is an ordinary layer.
``TiledLinearReturnBias`` is the same for Megatron-style ``linear_cls`` that return ``(output, bias)`` unadded.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """CSR-style bounds ``[0, ..., num_items]`` of ``num_parts`` near-equal parts, the first parts one larger
    (DeepSpeed's ``partition_uniform``, so tiles have DeepSpeed's shapes and its checkpoints' names fit)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


class TiledLinear(nn.Module):
    """A drop-in ``nn.Linear`` whose weight is ``out_splits x in_splits`` tiles (docs/stage3.md, "Very large
    layers"). ``input_is_already_split``: ``forward`` takes a sequence of ``in_splits`` tensors;
    ``combine_out_splits=False``: it returns the list of ``out_splits`` outputs; ``init_linear``: copy that
    layer's weight and bias; ``kwargs`` go to ``linear_cls``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls: type = nn.Linear, init_linear: Optional[nn.Module] = None, **kwargs) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise ValueError(f"TiledLinear: in_splits must be in [1, in_features={in_features}], got {in_splits}")
        if not 1 <= out_splits <= out_features:
            raise ValueError(f"TiledLinear: out_splits must be in [1, out_features={out_features}], "
                             f"got {out_splits}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = nn.ModuleList()
        for out_id in range(out_splits):
            rows = self.out_parts[out_id + 1] - self.out_parts[out_id]
            row = nn.ModuleList()
            for in_id in range(in_splits):
                cols = self.in_parts[in_id + 1] - self.in_parts[in_id]
                # One bias per output row: the input splits' partial products are summed.
                row.append(linear_cls(cols, rows, bias=bias and in_id == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def tiles(self) -> list[nn.Module]:
        """Every tile, in the order ``forward`` runs them (row by row)."""
        return [tile for row in self.linears for tile in row]

    def forward(self, input_):
        inputs = self._inputs(input_)
        outputs = [None] * self.out_splits
        for out_id in range(self.out_splits):
            for in_id in range(self.in_splits):
                part = inputs[in_id]
                if self.out_splits > 1 and isinstance(part, torch.Tensor) and part.requires_grad:
                    # An own alias per tile: stage 3 releases a tile once the gradient of its input is computed,
                    # which for a tensor shared by every row would wait for the last row's backward.
                    part = part.view_as(part)
                local = self.linears[out_id][in_id](part)
                outputs[out_id] = self._reduce_local_output(in_id, out_id, outputs[out_id], local)
        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _inputs(self, input_) -> Sequence:
        if self.in_splits == 1:
            return [input_]
        if not self.input_is_already_split:
            sizes = [self.in_parts[p + 1] - self.in_parts[p] for p in range(self.in_splits)]
            return self._split_global_input(input_, sizes)
        if len(input_) != self.in_splits:
            raise ValueError(f"TiledLinear: input_is_already_split needs {self.in_splits} input pieces (in_splits), "
                             f"got {len(input_)}")
        return input_

    def _split_global_input(self, input_, split_sizes: list[int]):
        """The input's pieces along its last dimension (override for other input types, as in DeepSpeed)."""
        return torch.split(input_, split_sizes, dim=-1)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out, new_out):
        """Sum a tile's partial product into its row's (override for other output types, as in DeepSpeed)."""
        if current_out is None:
            return new_out.clone()  # the row's sum must not be a view of the first tile's output
        return current_out + new_out

    def _combine_output_splits(self, outputs: list):
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other``'s weight (and bias) into the tiles. At stage 3 a collective on every rank (the tiles are
        gathered, written and re-partitioned; every rank must pass the same values)."""
        from zero_core.stage3.external_params import GatheredParameters  # the stage 3 gather, no import cycle

        weight, other_bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: need a weight of shape ({self.out_features}, "
                             f"{self.in_features}), got {None if weight is None else tuple(weight.shape)}")
        if self.use_bias != (other_bias is not None):
            raise ValueError(f"TiledLinear.copy_params_from: this layer has bias={self.use_bias}, the source "
                             f"{'has' if other_bias is not None else 'has no'} bias")
        if other_bias is not None and tuple(other_bias.shape) != (self.out_features,):
            raise ValueError(f"TiledLinear.copy_params_from: need a bias of shape ({self.out_features},), got "
                             f"{tuple(other_bias.shape)}")
        with GatheredParameters([weight] + ([other_bias] if other_bias is not None else [])):
            for out_id, row in enumerate(self.linears):
                r0, r1 = self.out_parts[out_id], self.out_parts[out_id + 1]
                for in_id, tile in enumerate(row):
                    c0, c1 = self.in_parts[in_id], self.in_parts[in_id + 1]
                    params = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(params, modifier_rank=0):
                        tile.weight.copy_(weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.copy_(other_bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """DeepSpeed's ``TiledLinearReturnBias``: ``TiledLinear`` for a ``linear_cls`` that returns ``(output, bias)``
    with the bias not added (Megatron-LM's ``skip_bias_add``), so the caller can fuse it into what follows.
    ``forward`` returns ``(output, bias)``: the rows' outputs and the rows' biases each concatenated (``bias`` None
    when no tile has one); with ``combine_out_splits=False``, one ``(output, bias)`` per row."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out, new_out):
        if not isinstance(new_out, tuple) or len(new_out) != 2 or new_out[0] is None:
            raise TypeError(f"TiledLinearReturnBias: linear_cls must return (output, bias), got "
                            f"{type(new_out).__name__} from tile ({out_id}, {in_id}); use TiledLinear for a layer "
                            "that returns its output alone")
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, old_bias if bias is None else bias  # the bias is returned, never summed

    def _combine_output_splits(self, outputs: list):
        tensor = super()._combine_output_splits([out[0] for out in outputs])
        biases = [out[1] for out in outputs if out[1] is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
