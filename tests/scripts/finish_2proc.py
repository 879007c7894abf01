"""Launched by tests/test_distributed.py with `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU).

Usage: finish_2proc.py OUT_DIR CODE

Each rank joins the process group, registers an atexit handler that writes OUT_DIR/atexit_rank{r}, prints a line
(stdout is a pipe, so it sits in Python's buffer), and ends with `distributed.finish(CODE)`. With a non-zero CODE only
rank 1 fails, while rank 0 is still busy (sleeps 120 s): rank 1 must leave at once, not wait for rank 0.
"""

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

from trl_ppo_variants.distributed import finish

out_dir, code = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
atexit.register(lambda: open(os.path.join(out_dir, f"atexit_rank{rank}"), "w").write("ran"))
print(f"FINISH-RANK{rank} world={int(t.item())}")
open(os.path.join(out_dir, f"finishing_rank{rank}"), "w").close()  # when it began to finish, for the test's clock
if code != 0 and rank == 0:
    time.sleep(120)
    code = 0
finish(code)
raise AssertionError("finish returned")
