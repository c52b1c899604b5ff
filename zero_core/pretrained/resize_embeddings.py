"""``resize_token_embeddings`` of a Hugging Face model built partitioned (under ``zero_core.Init``, or by
``from_pretrained`` under the Accelerate swap at stage 3), before setup: what a fine-tuning script does after adding
tokens (``model.resize_token_embeddings(len(tokenizer))``).

transformers resizes a ZeRO-3 model through DeepSpeed's own calls when DeepSpeed is configured; for any other engine
it reads and replaces the embedding's values directly, which a partitioned parameter refuses once the ``Init``
context has closed. So ``PreTrainedModel.resize_token_embeddings`` is wrapped, process-locally: on a model whose
embeddings an ``Init`` partition holds, the original runs with that partition open again, as it would inside the
context (each embedding gathered for the operations that read it, the resized one partitioned afresh from rank 0's
values). On a model an engine already trains it raises, naming the fix: resize before setup, as DeepSpeed needs it
before ``deepspeed.initialize``. Any other model runs the original unchanged.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

from zero_core import registry

_WRAPPED = "_zero_core_resize_wrapped"


def install_if_loaded() -> None:
    """Wrap ``PreTrainedModel.resize_token_embeddings`` once, if transformers is imported."""
    if "transformers" not in sys.modules:  # never import it for a model that does not use it
        return
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return
    original = PreTrainedModel.__dict__.get("resize_token_embeddings")
    if original is None or getattr(original, _WRAPPED, False):
        return
    PreTrainedModel.resize_token_embeddings = _wrapped(original)


def _wrapped(original: Callable) -> Callable:
    @functools.wraps(original)
    def resize_token_embeddings(self, *args, **kwargs):
        weights = [getattr(m, "weight", None) for m in (self.get_input_embeddings(), self.get_output_embeddings())
                   if m is not None]
        weights = [w for w in weights if w is not None]
        if any(registry.engine_of(w) is not None for w in weights):
            raise RuntimeError(
                f"{type(self).__name__}.resize_token_embeddings: the model's embeddings already train under a "
                "zero_core engine, which planned its buffers and shards from their sizes; resize before "
                "zero_core.setup (before accelerator.prepare, Trainer.train or trainer.fit), right after building or "
                "loading the model, as DeepSpeed needs it before deepspeed.initialize")
        partition = next((p for p in map(registry.pending_partition_of, weights) if p is not None), None)
        if partition is None:
            return original(self, *args, **kwargs)
        with partition.reopened():
            return original(self, *args, **kwargs)

    setattr(resize_token_embeddings, _WRAPPED, True)
    return resize_token_embeddings
