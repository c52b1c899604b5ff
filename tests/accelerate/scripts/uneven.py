"""Uneven inputs through ``accelerator.join_uneven_inputs``: ZeroAccelerator at stages 1-3 against torch's DDP under
``Join`` in one launch, each on a loader with ``even_batches=False`` (13 samples in batches of 2: rank 0 gets 4 batches,
rank 1 gets 3), with the model and its optimizer passed as joinables.

    accelerate launch --config_file accelerate.yaml uneven.py OUT.json

OUT.json holds, per run, rank 0's final weights and every rank's batch count.
"""

import sys

import torch
from accelerate.utils import DataLoaderConfiguration
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from common import make_accelerator, rank, to_lists, write_json


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(13, 6, generator=generator), torch.randn(13, 1, generator=generator))


def train(kind, override: bool = False) -> tuple[dict, list]:
    """override: the accelerator keeps even batches and join_uneven_inputs(even_batches=False) turns them off."""
    accelerator = make_accelerator(kind, gradient_accumulation_steps=1,
                                   dataloader_config=DataLoaderConfiguration(even_batches=override))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "ddp":  # Accelerate joins only on GPUs (multi_device): the reference is torch's DDP under Join
        loader = accelerator.prepare(DataLoader(dataset(), batch_size=2))
        trained = DistributedDataParallel(model)
        joined = Join([trained])
    else:
        trained, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset(), batch_size=2))
        joined = accelerator.join_uneven_inputs([trained, optimizer], even_batches=False if override else None)
    batches = 0
    with joined:
        for x, y in loader:
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward() if kind == "ddp" else accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            batches += 1
    counts = accelerator.gather(torch.tensor([batches])).tolist()
    state = model.state_dict() if kind == "ddp" else accelerator.get_state_dict(trained)
    return (to_lists(state) if rank() == 0 else {}), counts


def main() -> None:
    results = {}
    for name, kind in (("ddp", "ddp"), ("zero1", {"stage": 1}), ("zero2", {"stage": 2, "reduce_bucket_size": 100}),
                       ("zero3", {"stage": 3, "param_persistence_threshold": 0})):
        weights, counts = train(kind)
        results[name] = {"weights": weights, "batches": counts}
    weights, counts = train({"stage": 3, "param_persistence_threshold": 0}, override=True)
    results["zero3_override"] = {"weights": weights, "batches": counts}
    write_json(sys.argv[1], results)


if __name__ == "__main__":
    main()
