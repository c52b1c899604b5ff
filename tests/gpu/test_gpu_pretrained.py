"""The GPU tier: pretrained weights land in the shards on the GPU (``zero_core.load_pretrained`` under
``torch.device("cuda")``), exactly, and the loaded model trains there. World size 1 over NCCL."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import zero_core

pytestmark = pytest.mark.cuda


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 64)
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 37)


@pytest.fixture()
def group():
    """A world of one, unless an earlier test of the tier left its group up (then that one is used)."""
    ours = not dist.is_initialized()
    if ours:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29577")
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    if ours:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_pretrained_weights_load_into_gpu_shards_and_train(tmp_path, group):
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in Net().state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    for how in ("init", "meta"):
        with torch.device("cuda"):
            if how == "init":
                with zero_core.Init(config={"stage": 3}):
                    model = Net()
            else:
                with torch.device("meta"):
                    model = Net()
            zero_core.load_pretrained(model, tmp_path, dtype=torch.float32)
        with zero_core.GatheredParameters(list(model.parameters())):
            for name, param in model.named_parameters():
                assert param.device.type == "cuda", (how, name)
                assert torch.equal(param.detach().cpu(), state[name].float()), (how, name)
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   {"stage": 3, "stage3_param_persistence_threshold": 0})
        ids = torch.arange(32, device="cuda").view(4, 8) % 37
        losses = []
        for _ in range(3):
            loss = nn.functional.cross_entropy(model.head(model.body(model.emb(ids))).flatten(0, 1), ids.flatten())
            loss.backward()
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0], (how, losses)
        engine.close()
