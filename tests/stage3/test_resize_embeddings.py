"""``model.resize_token_embeddings(n)`` on a Hugging Face model built partitioned (``zero_core.Init``; the Accelerate
swap's ``from_pretrained`` at stage 3 builds it the same way), after the context closed and before setup: what a
fine-tuning script does after adding tokens. Before, the first read of the partitioned embedding raised.

Two ranks against the same model built and resized in one process without ZeRO (the reference computes the same
mean-and-covariance initialisation of the new rows from the same random state): a tiny Llama with its own head and
a tiny GPT-2 whose head is tied to the embedding. The resized model is bit for bit the reference's, then trains
at stage 3 to DDP's weights. After setup a resize is an error that names the fix."""

from __future__ import annotations

import pytest
import torch

import zero_core
from distributed import run_distributed

NEW_VOCAB = 70


def _model(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16))


def _train(model, engine_or_ddp, steps: int = 2) -> list[float]:
    optimizer = engine_or_ddp.optimizer if hasattr(engine_or_ddp, "optimizer") else None
    losses = []
    for step in range(steps):
        ids = torch.randint(0, NEW_VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine_or_ddp(input_ids=ids, labels=ids).loss if optimizer is None else \
            engine_or_ddp.module(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        if optimizer is None:
            loss.backward()
            model._ddp_optimizer.step()
            model._ddp_optimizer.zero_grad()
        else:
            engine_or_ddp.backward(loss)
            engine_or_ddp.step()
    return losses


def _worker(rank: int, world_size: int, kind: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    reference = _model(kind)
    reference.resize_token_embeddings(NEW_VOCAB)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    reference._ddp_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ddp = DistributedDataParallel(reference)
    ddp_losses = _train(reference, ddp)
    ddp_weights = {n: p.detach().clone() for n, p in reference.named_parameters()}

    with zero_core.Init(config={"stage": 3}):
        model = _model(kind)
    model.resize_token_embeddings(NEW_VOCAB)  # the context has closed: as after from_pretrained
    with zero_core.GatheredParameters(list(model.parameters())):
        resized = {n: p.detach().clone() for n, p in model.named_parameters()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                             {"stage": 3, "stage3_param_persistence_threshold": 0})
    losses = _train(model, engine)
    with zero_core.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model.resize_token_embeddings(NEW_VOCAB + 2)
        after_setup = None
    except RuntimeError as error:
        after_setup = str(error)
    return {"resized_equal": sorted(resized) == sorted(expected)
            and all(torch.equal(resized[n], expected[n]) for n in expected),
            "shape": tuple(resized[next(n for n in resized if "wte" in n or "embed_tokens" in n)].shape),
            "tied": tied, "losses": (losses, ddp_losses),
            "max_dw": max((trained[n] - ddp_weights[n]).abs().max().item() for n in ddp_weights),
            "after_setup": after_setup}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_resize_after_init_equals_the_plain_resize_and_trains_like_ddp(kind):
    results = run_distributed(_worker, 2, kind, timeout=200)
    for rank, result in enumerate(results):
        assert result["shape"] == (NEW_VOCAB, 32), result
        assert result["resized_equal"], rank
        assert result["tied"] == (kind == "gpt2"), result
        ours, ddp = result["losses"]
        assert ours == pytest.approx(ddp, rel=1e-5), result["losses"]
        assert result["max_dw"] <= 1e-5, result["max_dw"]
        assert "resize before zero_core.setup" in result["after_setup"], result["after_setup"]
