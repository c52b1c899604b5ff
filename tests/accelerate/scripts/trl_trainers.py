"""TRL's ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``, unmodified, on a tiny Llama built from a config.

    accelerate launch --config_file cfg.yaml [-m accelerate_zero.swap] trl_trainers.py OUT_DIR RUN [RUN ...]

Each RUN is a name, or ``name=<ZeRO config as JSON>`` (set as ``ACCELERATE_ZERO_CONFIG`` before its trainer
is built). A name ending in ``_dpo`` runs ``DPOTrainer`` (with its own reference model, prepared for
evaluation), ``_grpo`` ``GRPOTrainer`` (generation inside the step, a length reward), ``_peft`` ``SFTTrainer``
with a LoRA adapter (PEFT), ``_hfpeft`` the plain ``transformers.Trainer`` with a LoRA adapter, any other
``SFTTrainer``. After each run, rank 0 alone also calls the model's own ``save_pretrained`` (PEFT's for an
adapter), as a script that saves ``if accelerator.is_main_process`` does, into ``OUT_DIR/<name>/rank0``
(result.json records its error, if any); after an adapter run, also with
``state_dict=accelerator.get_state_dict(model)`` (taken on every rank) into ``OUT_DIR/<name>/given``.
TRL installs its fused LM head on the model instance (``add_fused_lm_head``: a patched forward that reads
``lm_head.weight`` directly); each run trains a few steps with ``bf16=True``; ``save_model`` writes
``OUT_DIR/<name>/final``, rank 0 the logged losses to ``OUT_DIR/<name>/result.json``.
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

VOCAB, SEQ = 64, 12


def tokenizer() -> PreTrainedTokenizerFast:
    word_level = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # DPO's text: "t3 t17 ..."
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t1", unk_token="t0")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


def data() -> Dataset:
    ids = torch.randint(2, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids})


def preferences() -> Dataset:
    generator = torch.Generator().manual_seed(2)

    def words(count: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (count,), generator=generator))

    return Dataset.from_list([{"prompt": words(5), "chosen": words(4), "rejected": words(4)} for _ in range(16)])


def prompts() -> Dataset:
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, VOCAB, (5,), generator=generator) for _ in range(16)]
    return Dataset.from_list([{"prompt": " ".join(f"t{int(i)}" for i in row)} for row in rows])


def length_reward(completions, **kwargs) -> list:
    return [len(completion.split()) / 10 for completion in completions]


def arguments(config_class, out: Path, steps: int, batch: int = 2, **extra):
    given = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-3,
                 logging_steps=1, report_to=[], seed=0, use_cpu=True, disable_tqdm=True, save_strategy="no",
                 bf16=True, dataloader_num_workers=0)
    return config_class(**{**given, **extra})


def adapter() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def trainer_for(name: str, out: Path):
    if name.endswith("_hfpeft"):  # the plain Trainer: labels are the inputs (the model shifts them)
        rows = data().map(lambda row: {"labels": row["input_ids"]})
        saves = {"save_strategy": "steps", "save_steps": 2} if name.startswith("zero") else {}  # see resume()
        return Trainer(model=get_peft_model(tiny_llama(), adapter()),
                       args=arguments(TrainingArguments, out, 4, **saves), train_dataset=rows)
    if name.endswith("_grpo"):
        args = arguments(GRPOConfig, out, 2, batch=4, num_generations=4, max_completion_length=6)
        return GRPOTrainer(model=tiny_llama(), reward_funcs=length_reward, args=args, train_dataset=prompts(),
                           processing_class=tokenizer())
    if name.endswith("_dpo"):
        return DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=arguments(DPOConfig, out, 3),
                          train_dataset=preferences(), processing_class=tokenizer())
    return SFTTrainer(model=tiny_llama(), args=arguments(SFTConfig, out, 4), train_dataset=data(),
                      processing_class=tokenizer(), peft_config=adapter() if name.endswith("_peft") else None)


def run(name: str, out: Path) -> None:
    trainer = trainer_for(name, out)
    trainer.train()
    trainer.save_model(str(out / "final"))
    adapter_run = name.endswith("peft")
    whole = trainer.accelerator.get_state_dict(trainer.model) if adapter_run else None  # every rank: a collective
    if trainer.accelerator.is_main_process:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        result = {"loss": losses, "accelerator": type(trainer.accelerator).__name__,
                  "rank0_save_error": save_on_rank0(trainer, out / "rank0")}  # save_pretrained as is
        if adapter_run:  # and with the whole state given
            trainer.accelerator.unwrap_model(trainer.model).save_pretrained(str(out / "given"), state_dict=whole)
    if name.startswith("zero") and name.endswith("_hfpeft"):
        resumed = resume(name, out, whole)
        if trainer.accelerator.is_main_process:
            result.update(resumed)
    if trainer.accelerator.is_main_process:
        (out / "result.json").write_text(json.dumps(result))
    trainer.accelerator.wait_for_everyone()


def resume(name: str, out: Path, whole: dict) -> dict:
    """The adapter Trainer's step-2 checkpoint (the frozen base left out of its zero_model, as transformers has
    DeepSpeed leave it out for PEFT) resumed by a new trainer to step 4: the adapter it ends with against the run's
    own (``whole``, rank 0's), and what the checkpoint holds."""
    trainer = trainer_for(name, out / "resumed")
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    ended = trainer.accelerator.get_state_dict(trainer.model)  # every rank: a collective
    manifest = json.loads((out / "checkpoint-2" / "zero_model" / "manifest.json").read_text())
    trainer.accelerator.save_state(str(out / "state"), exclude_frozen_parameters=True)  # DeepSpeed's keyword
    state = json.loads((out / "state" / "zero_model" / "manifest.json").read_text())
    adapter = [key for key in whole if "lora_" in key]
    return {"resumed_adapter_equal": bool(adapter) and all(torch.equal(ended[k], whole[k]) for k in adapter),
            "excluded": manifest["excluded_frozen_parameters"],
            "replicated": [entry["name"] for entry in manifest["replicated"]],
            "saved": [p["name"] for p in manifest["parameters"]],
            "save_state_excluded": state["excluded_frozen_parameters"]}


def save_on_rank0(trainer, directory: Path):
    """The model's own ``save_pretrained`` (PEFT's for an adapter), on this rank only; the error it raised
    (type and message), or None."""
    try:
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(str(directory))
    except Exception as error:  # recorded for the test, which checks it names the way out
        return f"{type(error).__name__}: {error}"
    return None


def main(out: Path, runs: list) -> None:
    for spec in runs:
        name, _, config = spec.partition("=")
        if config:
            os.environ["ACCELERATE_ZERO_CONFIG"] = config
        run(name, out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
