"""TRL's ``SFTTrainer``, ``DPOTrainer`` (its own reference model) and ``GRPOTrainer`` (generation inside the
step) under the swap at stages 2 and 3, in both precision modes: Accelerate-style autocast (bf16), which equals
DDP within 1e-5, and the engine's own bf16 (bf16 weights, fp32 masters), within bf16 rounding of it; each against
plain ``accelerate launch`` (DDP, autocast) in the same test. Also LoRA adapters (PEFT) at stage 3, through
``SFTTrainer`` and the plain ``transformers.Trainer``: the adapter ``save_model`` writes equals DDP's and loads
with ``PeftModel.from_pretrained``; PEFT's own ``save_pretrained`` on rank 0 alone gets a clear error.

Two launches of tests/accelerate/scripts/trl_trainers.py, 2 CPU ranks each, shared by every test here: one for
the DDP references, one for every ZeRO run (each run sets its config, stage and autocast included, before its
trainer is built), since a launch costs more than the few steps each run takes.

TRL patches the model's forward with its fused LM head, which reads ``lm_head.weight`` directly. Before, the
autocast wrapping at ``prepare`` dropped that patch and the first step failed with "'CausalLMOutputWithPast'
object has no attribute 'log_probs'"; at stage 3 the head is gathered when read (every parameter partitioned,
and ``max_live_parameters`` too small for the root group that would otherwise gather it).
"""

import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelerate_runs import ACCELERATE_YAML, SCRIPTS, accelerate_launch, clean_env, run

TOLERANCE = 1e-5
# The engine's own bf16 against DDP's autocast: bf16 rounding apart, the tolerance docs/accelerate.md states
# (measured on SFT: losses 2e-4, weights 7e-3 after 4 steps at lr 3e-3).
BF16_LOSS_TOLERANCE, BF16_WEIGHT_TOLERANCE = 2e-3, 3e-2
# Adam moves a weight by about lr per step whatever its gradient, so an elementwise bound says little after a few
# steps: the difference from DDP must also stay a small part of DDP's own update, in norm (measured 6-8%).
BF16_UPDATE_FRACTION = 0.25
STAGES = {2: {"stage": 2}, 3: {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 100}}
MODES = {"autocast": {"torch_autocast": {"enabled": True}},  # DeepSpeed's switch, in a whole config: per run
         "bf16": {}}  # the default: the engine's 16-bit weights (bf16=True in the trainers' arguments)
TRAINERS = {"sft": 4, "dpo": 3, "grpo": 2}  # the steps each trains
ZERO_RUNS = {f"zero{stage}_{mode}_{trainer}": {"zero_optimization": STAGES[stage], **MODES[mode]}
             for stage in STAGES for mode in MODES for trainer in TRAINERS}
ZERO_RUNS.update({f"zero3_autocast_{kind}": {"zero_optimization": STAGES[3], **MODES["autocast"]}
                  for kind in ("peft", "hfpeft")})  # LoRA adapters (PEFT): TRL's SFT, the plain Trainer
DDP_RUNS = [f"ddp_{kind}" for kind in (*TRAINERS, "peft", "hfpeft")]


def _read(directory: Path) -> dict:
    final = directory / "final"
    adapter = final / "adapter_model.safetensors"
    read = {"result": json.loads((directory / "result.json").read_text()), "directory": directory, "final": final,
            "weights": load_file(adapter if adapter.is_file() else final / "model.safetensors")}
    if not adapter.is_file():
        read["config"] = json.loads((final / "config.json").read_text())
    return read


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trl")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    accelerate_launch(tmp, "trl_trainers.py", tmp, *DDP_RUNS, env=clean_env(**offline))
    (tmp / "accelerate.yaml").write_text(ACCELERATE_YAML)
    specs = [f"{name}={json.dumps(config)}" for name, config in ZERO_RUNS.items()]
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", tmp / "accelerate.yaml",
         "-m", "accelerate_zero.swap", SCRIPTS / "trl_trainers.py", tmp, *specs], cwd=tmp,
        env=clean_env(ACCELERATE_USE_CPU="true", **offline), timeout=300)
    return {name: _read(tmp / name) for name in (*DDP_RUNS, *ZERO_RUNS)}


def _max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("stage", STAGES)
def test_trainer_with_autocast_logs_ddps_losses_and_saves_its_weights(runs, stage, trainer):
    ddp, zero = runs[f"ddp_{trainer}"], runs[f"zero{stage}_autocast_{trainer}"]
    assert (ddp["result"]["accelerator"], zero["result"]["accelerator"]) == ("Accelerator", "ZeroAccelerator")
    losses = ddp["result"]["loss"]
    assert len(losses) == len(zero["result"]["loss"]) == TRAINERS[trainer] and losses[1] != losses[0]
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(zero["result"]["loss"], losses))
    assert _max_difference(zero["weights"], ddp["weights"]) <= TOLERANCE
    assert zero["config"]["dtype"] == ddp["config"]["dtype"] == "float32"


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("stage", STAGES)
def test_trainer_in_the_engines_bf16_stays_within_bf16_rounding_of_ddp(runs, stage, trainer):
    ddp, zero = runs[f"ddp_{trainer}"], runs[f"zero{stage}_bf16_{trainer}"]
    assert len(zero["result"]["loss"]) == TRAINERS[trainer]
    assert all(abs(a - b) <= BF16_LOSS_TOLERANCE for a, b in zip(zero["result"]["loss"], ddp["result"]["loss"]))
    assert 0 < _max_difference(zero["weights"], ddp["weights"]) <= BF16_WEIGHT_TOLERANCE
    initial = _script().tiny_llama().state_dict()
    update = _norm({k: ddp["weights"][k] - initial[k] for k in ddp["weights"]})
    assert _norm({k: zero["weights"][k] - ddp["weights"][k] for k in ddp["weights"]}) <= BF16_UPDATE_FRACTION * update
    assert zero["config"]["dtype"] == "float32"  # the fp32 masters, named so (tests/checkpoint/test_saved_dtype.py)


def _norm(tensors: dict) -> float:
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values())).item()


@functools.cache
def _script():
    spec = importlib.util.spec_from_file_location("trl_trainers", SCRIPTS / "trl_trainers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _load_adapter(directory: Path) -> dict:
    from peft import PeftModel

    return PeftModel.from_pretrained(_script().tiny_llama(), directory).state_dict()


@pytest.mark.parametrize("kind", ["peft", "hfpeft"])
def test_a_lora_adapter_saved_by_save_model_equals_ddps_and_loads_with_peft(runs, kind):
    ddp, zero = runs[f"ddp_{kind}"], runs[f"zero3_autocast_{kind}"]
    assert len(ddp["result"]["loss"]) == 4
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(zero["result"]["loss"], ddp["result"]["loss"]))
    assert any("lora_B" in k for k in ddp["weights"]) and _max_difference(zero["weights"], ddp["weights"]) <= TOLERANCE
    assert any(ddp["weights"][k].abs().max() > 0 for k in ddp["weights"] if "lora_B" in k)  # it trained
    loaded = _load_adapter(zero["final"])
    for name, tensor in zero["weights"].items():
        key = name.replace(".weight", ".default.weight")  # PEFT names the adapter in the model
        assert torch.equal(loaded[key], tensor), name


def test_an_adapter_trainers_checkpoint_leaves_the_base_out_and_resumes_to_the_same_adapter(runs):
    """The plain Trainer with a LoRA adapter saves at steps 2 and 4; its zero_model holds the adapter alone (the
    frozen base excluded, as transformers has DeepSpeed exclude it for PEFT), and a new trainer resumed from step 2
    ends at step 4 with the adapter the run ended with, bit for bit."""
    result = runs["zero3_autocast_hfpeft"]["result"]
    assert result["saved"] and all("lora_" in name for name in result["saved"]), result["saved"]
    assert result["replicated"] == [], result["replicated"]  # the base left out; the Llama has no persistent buffer
    assert any("embed_tokens" in name for name in result["excluded"]), result["excluded"]
    assert not any("lora_" in name for name in result["excluded"])
    assert result["resumed_adapter_equal"]
    assert result["save_state_excluded"] == result["excluded"]  # accelerator.save_state(exclude_frozen_parameters=)


@pytest.mark.parametrize("name", [name for name in (*DDP_RUNS, *ZERO_RUNS) if not name.startswith("zero3")])
def test_save_pretrained_on_rank_0_alone_saves_under_ddp_and_at_stage_2(runs, name):
    assert runs[name]["result"]["rank0_save_error"] is None  # every rank holds the whole model
    assert any((runs[name]["directory"] / "rank0").glob("*.safetensors"))


@pytest.mark.parametrize("name", [name for name in ZERO_RUNS if name.startswith("zero3")])
def test_save_pretrained_on_rank_0_alone_at_stage_3_is_a_clear_error_naming_the_fix(runs, name):
    model = "PeftModel" if name.endswith("peft") else "LlamaForCausalLM"
    error = runs[name]["result"]["rank0_save_error"]
    assert error is not None and error.startswith(f"RuntimeError: {model}.save_pretrained without state_dict="), error
    assert "accelerator.get_state_dict(model)" in error and "trainer.save_model(dir)" in error
    assert not (runs[name]["directory"] / "rank0").exists()  # refused before writing anything


@pytest.mark.parametrize("kind", ["peft", "hfpeft"])
def test_peft_save_pretrained_given_the_gathered_state_on_rank_0_saves_ddps_adapter(runs, kind):
    given = load_file(runs[f"zero3_autocast_{kind}"]["directory"] / "given" / "adapter_model.safetensors")
    assert _max_difference(given, runs[f"ddp_{kind}"]["weights"]) <= TOLERANCE


def test_save_pretrained_sees_a_state_dict_given_by_name_by_position_or_through_kwargs():
    """The stage 3 check lets every call that passes ``state_dict`` through: transformers' takes it by name or
    third positionally, PEFT's through ``**kwargs``."""
    import inspect

    from peft import PeftModel
    from transformers import PreTrainedModel

    from zero_core.stage3.save_pretrained_check import given_state_dict as _given_state_dict

    hf, peft = inspect.signature(PreTrainedModel.save_pretrained), inspect.signature(PeftModel.save_pretrained)
    given = {"w": torch.zeros(1)}
    assert _given_state_dict(hf, None, "dir", (True, given), {}) is given
    assert _given_state_dict(hf, None, "dir", (), {"state_dict": given}) is given
    assert _given_state_dict(peft, None, "dir", (), {"state_dict": given}) is given
    assert _given_state_dict(hf, None, "dir", (), {}) is None and _given_state_dict(peft, None, "dir", (), {}) is None
