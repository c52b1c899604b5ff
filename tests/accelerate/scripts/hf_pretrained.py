"""An ordinary Hugging Face fine-tuning script: ``from_pretrained`` first, then a ``Trainer``; nothing knows ZeRO.

    accelerate launch --config_file cfg.yaml [-m accelerate_zero.swap] hf_pretrained.py MODEL_DIR OUT_DIR

Loads MODEL_DIR (written by ``save_pretrained``), notes the class of its parameters right after loading (under
ZeRO stage 3 they are already partitioned), resizes the embeddings for added tokens, trains 4 steps and
``save_model``s to OUT_DIR/final. Rank 0 writes OUT_DIR/result.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

SEQ, VOCAB = 8, 96


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int = 32, seed: int = 1):
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main(model_dir: Path, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    loaded_as = type(model.lm_head.weight).__name__
    # tokens added to the tokenizer; the new rows are drawn at random (seeded: the two launchers compared here leave
    # the random state elsewhere before this)
    torch.manual_seed(0)
    model.resize_token_embeddings(VOCAB + 4)
    args = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3,
                             logging_steps=1, report_to=[], seed=0, data_seed=0, use_cpu=True, save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    trainer.save_model(str(out / "final"))
    if trainer.args.process_index == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        (out / "result.json").write_text(json.dumps({"loaded_as": loaded_as, "losses": losses,
                                                     "accelerator": type(trainer.accelerator).__name__}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
