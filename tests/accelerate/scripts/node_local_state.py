"""``save_state``/``load_state`` with node-local checkpoints (``checkpoint.use_node_local_storage``) on two machines
of two processes (``accelerate launch --num_machines 2 --machine_rank i``, tests/multinode/test_multinode_launch.py).
Each machine runs in its own working directory and saves to the same relative path, as to its own local disk;
Accelerate's own files go to every machine too (``ProjectConfiguration(save_on_each_node=True)``).

    accelerate launch --num_machines 2 --machine_rank I --num_processes 4 ... node_local_state.py OUT_DIR

examples/accelerate_train.py trains 6 steps saving after step 3, then again resuming from that save; each rank
writes both runs' final weights (rank 0), and each machine's first process lists its directory.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration

from common import load_example, make_accelerator, to_lists

STEPS, SAVE_AT, STATE = 6, 3, "state"  # STATE: relative, this machine's own directory
CONFIG = {"stage": 3, "param_persistence_threshold": 0, "checkpoint": {"use_node_local_storage": True}}


def _accelerator():
    return make_accelerator(CONFIG, project_config=ProjectConfiguration(save_on_each_node=True))


def main() -> None:
    out, example = Path(sys.argv[1]), load_example()
    accelerator = _accelerator()
    straight, _ = example.train(accelerator, STEPS, save_state=STATE, save_at=SAVE_AT)
    straight = to_lists(accelerator.get_state_dict(straight))
    accelerator = _accelerator()
    resumed, _ = example.train(accelerator, STEPS, resume_from=STATE)
    resumed = to_lists(accelerator.get_state_dict(resumed))
    if accelerator.is_main_process:  # get_state_dict gives the whole model on the main process
        (out / "weights.json").write_text(json.dumps({"straight": straight, "resumed": resumed}))
    if accelerator.is_local_main_process:
        zero = Path(STATE) / "zero_model"
        report = {"files": sorted(p.name for p in Path(STATE).iterdir()),
                  "zero_files": sorted(p.name for p in zero.iterdir()),
                  "node_local": json.loads((zero / "manifest.json").read_text()).get("node_local")}
        (out / f"machine{os.environ.get('GROUP_RANK', '0')}.json").write_text(json.dumps(report))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
