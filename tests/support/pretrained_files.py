"""A tiny Hugging Face Llama saved with ``save_pretrained`` (safetensors shards), for the pretrained-loading tests
of every front-end."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(path: Path, tied: bool = True, shard_size: str = "20KB") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size=shard_size)
