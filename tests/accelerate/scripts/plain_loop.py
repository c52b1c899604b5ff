"""A plain Accelerate loop that knows nothing of ZeRO: run it as ``python -m accelerate_zero.swap plain_loop.py``
(one process, no launcher) and it trains under ZeroAccelerator. Prints one JSON line."""

import json
import sys

import torch
from accelerate import Accelerator
from torch import nn


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(16, 6).to(accelerator.device), torch.randn(16, 1).to(accelerator.device)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    print(json.dumps({"class": type(accelerator).__name__, "stage": accelerator.zero_plugin.stage,
                      "argv": sys.argv[1:], "losses": losses, "keys": sorted(state),
                      "processes": accelerator.num_processes, "model": type(model).__name__}))


if __name__ == "__main__":
    main()
