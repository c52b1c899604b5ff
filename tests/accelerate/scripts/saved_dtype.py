"""Every way a ``Trainer`` run under ZeRO saves a Hugging Face model, with the engine's bf16 training.

    accelerate launch --config_file cfg.yaml -m accelerate_zero.swap saved_dtype.py OUT_DIR

A tiny Llama (built from a config, no download) trains 2 steps with ``bf16=True`` at stages 2 and 3 (the stage
set through ``ACCELERATE_ZERO_CONFIG`` before each ``Trainer``), with a checkpoint at step 2. Then, into
``OUT_DIR/z<stage>/``: ``save_model`` (``Trainer.save_model``), ``save_pretrained`` (Accelerate's recipe:
``unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model))``) and ``save_16bit``
(``zero_core.save_16bit_model`` with the model's config). The test loads each with ``from_pretrained``.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import zero_core

VOCAB, SEQ = 64, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 16):
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False))


def run(out: Path, stage: int) -> None:
    os.environ["ACCELERATE_ZERO_CONFIG"] = json.dumps({
        "stage": stage, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True})
    args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, bf16=True, report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens())
    trainer.train()
    trainer.save_model(str(out / "save_model"))
    accelerator, model = trainer.accelerator, trainer.model
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(out / "save_pretrained", state_dict=state,
                                                    is_main_process=accelerator.is_main_process)
    zero_core.save_16bit_model(accelerator.zero_engine(model), out / "save_16bit", hf_config=model.config.to_dict())
    accelerator.wait_for_everyone()


def main(out: Path) -> None:
    for stage in (2, 3):
        run(out / f"z{stage}", stage)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
