"""Accelerate launches for the tests: the configs, the environment, ``accelerate launch`` of a test script
(tests/accelerate/scripts/), and the comparison of the JSON the scripts write."""

from __future__ import annotations

import sys
from pathlib import Path

from launch import ACCELERATE_SCRIPTS as SCRIPTS
from launch import child_env
from launch import run as run_command

TOLERANCE = 1e-5
MAX_NORM = 0.3  # parity.py clips at this norm

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
mixed_precision: 'no'
main_process_port: 0
"""

# use_cpu: this tier runs on CPUs wherever it runs (tests/gpu/ is the CUDA tier), also where a GPU is visible.
ZERO_YAML = ACCELERATE_YAML + """\
use_cpu: true
zero_optimization:
  stage: 2
  overlap_comm: true
  allgather_bucket_size: 300
"""


def clean_env(**extra) -> dict:
    """The launch environment (``launch.child_env``) without ZeRO/Accelerate settings that would change what is
    tested, and without GPUs: this tier is the CPU one wherever it runs (tests/gpu/ launches on a GPU). Its launches
    run two ranks, and with a GPU visible Accelerate's own barrier names device ``local_rank``, which a one-GPU
    machine lacks for rank 1 (on an H200: 11 of 32 tests failed, each with "invalid device ordinal";
    docs/benchmarks.md)."""
    env = {k: v for k, v in child_env().items()
           if not k.startswith(("ACCELERATE_ZERO_", "ACCELERATE_USE_", "ACCELERATE_MIXED_PRECISION"))}
    env.update(CUDA_VISIBLE_DEVICES="", **extra)
    return env


def run(cmd: list, cwd: Path, env: dict, timeout: int = 240) -> str:
    """Run a launch to its end; returns its standard output (the errors are shown only on failure)."""
    return run_command(cmd, timeout=timeout, env=env, cwd=cwd, stderr_apart=True)


def accelerate_launch(tmp: Path, script: str, *args, env: dict) -> None:
    """Plain ``accelerate launch`` of a MULTI_GPU config without GPUs: a script whose first Accelerator is a plain
    one (a DDP reference) would believe it is alone (DistributedType.NO) unless ACCELERATE_USE_CPU is set, as
    ``accelerate-zero launch`` does itself. The script runs through then_destroy_group.py, so that a DDP reference
    run, with no engine to tear gloo down, cannot abort at exit."""
    config = tmp / "accelerate.yaml"
    config.write_text(ACCELERATE_YAML)
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
         SCRIPTS / "then_destroy_group.py", SCRIPTS / script, *args],
        cwd=tmp, env={**env, "ACCELERATE_USE_CPU": "true"})


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
