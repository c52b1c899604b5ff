"""Hugging Face generate() on a stage 3 model, with and without synced_gpus, ranks stopping at different lengths.

Each forward pass gathers the partitioned weights collectively, so a rank that has finished must keep joining the
others' forward passes (transformers' synced_gpus). The engine makes synced_gpus the default of the model's
generate() (zero_core/stage3/generation.py); without that, the run without the flag hangs. Tokens are compared with the
same model generating without ZeRO in each rank's process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config)


def generate(model, rank: int, synced_gpus) -> list[int]:
    prompt = torch.tensor([[1, 5 + rank, 9, 17 + 3 * rank]])
    kwargs = {} if synced_gpus == "default" else {"synced_gpus": synced_gpus}
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=2 + 5 * rank, do_sample=False, pad_token_id=0, **kwargs)
    return out[0].tolist()


def worker(rank: int, world_size: int) -> dict:
    reference = generate(tiny_llama(), rank, False)  # plain model, this rank alone
    model = tiny_llama()
    zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), STAGE3)
    results = {"reference": reference}
    for synced in ("default", True):
        results[str(synced)] = generate(model, rank, synced)
    dist.barrier()
    return results


def test_generate_on_stage3_with_and_without_synced_gpus():
    ranks = run_distributed(worker, 2, timeout=120)
    for rank, result in enumerate(ranks):
        assert len(result["reference"]) == 4 + 2 + 5 * rank  # the ranks stop at different lengths
        assert result["default"] == result["reference"], f"rank {rank}: generate() without synced_gpus"
        assert result["True"] == result["reference"], f"rank {rank}: generate(synced_gpus=True)"
