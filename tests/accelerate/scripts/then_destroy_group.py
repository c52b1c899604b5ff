"""``then_destroy_group.py SCRIPT ARGS...``: run SCRIPT as ``accelerate launch`` would, then destroy the process
group it left up.

A reference run (plain DDP, no engine) that returns with gloo's group still up can die at interpreter exit
("terminate called without an active exception": a gloo worker thread freeing a finished collective's tensors
while Python finalises; docs/reliability.md). Seen once in this suite, on the DDP launch of the Hugging Face
Trainer script. An engine's atexit handler prevents it in ZeRO runs; this does the same for any launch, as a
script that called ``dist.destroy_process_group()`` itself would.
"""

import runpy
import sys
from pathlib import Path

import torch.distributed as dist

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")
    if dist.is_available() and dist.is_initialized():  # not after an error: another rank may be gone
        dist.destroy_process_group()
