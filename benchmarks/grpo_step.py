"""TRL's ``GRPOTrainer`` step time under ZeRO stage 3 against plain Accelerate DDP, interleaved.

    python -m benchmarks.grpo_step --rounds 3 [--out benchmarks/results/grpo_step.md]

One ``accelerate launch`` of 2 CPU ranks (gloo) runs this file as a worker. Each round trains a fresh
``GRPOTrainer`` (a 4-layer Llama built from a config, fp32, 4 prompts x 4 generations of 16 new tokens per step,
sampled, a length reward) under plain Accelerate (DDP) and under ``ZeroAccelerator`` at stage 3 with every
parameter partitioned (``stage3_param_persistence_threshold: 0``), in alternating order, so the machine's load
falls on both alike. Generation inside the step runs in a generation session (docs/stage3.md#generation). A step's time is
``on_step_begin`` to ``on_step_end`` on rank 0: generation, the reward, the loss's forward and backward and
the optimizer step. The first step of each run (the trace is recorded then) is left out; the medians of the
rest over all rounds are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS, VOCAB = 5, 256
STAGE3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
LAUNCH_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
mixed_precision: 'no'
main_process_port: 0
"""


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128, tie_word_embeddings=False))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="t0", eos_token="t1", unk_token="t0")


def _prompts():
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, VOCAB, (8,), generator=generator) for _ in range(64)]
    return Dataset.from_list([{"prompt": " ".join(f"t{int(i)}" for i in row)} for row in rows])


def _length_reward(completions, **kwargs) -> list:
    return [len(completion.split()) / 16 for completion in completions]


def _step_times(out: Path) -> list:
    """Train one fresh GRPOTrainer (whichever Accelerator transformers.trainer names now); its step times."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    clock = StepClock()
    args = GRPOConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, learning_rate=1e-4, logging_steps=1, report_to=[], seed=0,
                      use_cpu=True, disable_tqdm=True, save_strategy="no", dataloader_num_workers=0)
    trainer = GRPOTrainer(model=_model(), reward_funcs=_length_reward, args=args, train_dataset=_prompts(),
                          processing_class=_tokenizer(), callbacks=[clock])
    trainer.train()
    trainer.accelerator.wait_for_everyone()
    return type(trainer.accelerator).__name__, clock.times[1:]  # the first step records the trace, warms caches


def worker(out: Path, rounds: int) -> None:
    import accelerate.accelerator

    import accelerate_zero.swap

    plain = accelerate.accelerator.Accelerator
    accelerate_zero.swap.install()  # the process group; ZeroAccelerator wherever Accelerator is named
    import transformers.trainer

    from accelerate_zero import ZeroAccelerator

    os.environ["ACCELERATE_ZERO_CONFIG"] = json.dumps(STAGE3)
    ways = [("ddp", plain), ("zero3", ZeroAccelerator)]
    times = {name: [] for name, _ in ways}
    for round_ in range(rounds):
        for name, accelerator_class in ways if round_ % 2 == 0 else ways[::-1]:  # neither always goes first
            transformers.trainer.Accelerator = accelerator_class  # what Trainer builds its accelerator from
            used, step_times = _step_times(out / f"{name}_{round_}")
            if used != accelerator_class.__name__:
                raise RuntimeError(f"the {name} run's Trainer built a {used}, not a {accelerator_class.__name__}")
            times[name] += step_times
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "times.json").write_text(json.dumps(times))


def table(times: dict, rounds: int) -> str:
    ddp = statistics.median(times["ddp"])
    lines = [f"TRL GRPOTrainer step, 4-layer Llama (hidden 128, fp32), 4 prompts x 4 generations x 16 new tokens "
             f"per rank, 2 ranks (gloo, CPU), {rounds} interleaved rounds of {STEPS - 1} timed steps, medians of "
             "rank 0", "", "| way | s per step | x DDP |", "| --- | --- | --- |"]
    for name, label in (("ddp", "plain Accelerate (DDP)"), ("zero3", "stage 3, every parameter partitioned")):
        median = statistics.median(times[name])
        lines.append(f"| {label} | {median:.3f} | {ddp / median:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.rounds)
        return
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "accelerate.yaml"
        config.write_text(LAUNCH_YAML)
        env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                        __file__, "--worker", directory, "--rounds", str(args.rounds)], env=env, check=True,
                       timeout=1800)
        result = table(json.loads((Path(directory) / "times.json").read_text()), args.rounds)
    print(result)
    if args.out is not None:
        args.out.write_text(result)


if __name__ == "__main__":
    main()
