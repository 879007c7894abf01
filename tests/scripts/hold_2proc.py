"""Launched by tests/test_launcher.py: a run that never ends, as a hung job does.

Usage: hold_2proc.py OUT_DIR

Each rank writes its pid to OUT_DIR/pid_rank{r} as soon as it starts, joins the process group (gloo), checks that
every rank is there with one all-reduce, writes OUT_DIR/joined_rank{r}, then waits in a second all-reduce that rank 1
never enters (it sleeps): both ranks hang, one in a collective and one outside, until the launcher kills them.
"""

import os
import sys
import time

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"pid_rank{rank}"), "w") as f:
    f.write(str(os.getpid()))

import torch  # noqa: E402 (the pid first: the test must find the worker even if it hangs in the import)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(out_dir, f"joined_rank{rank}"), "w") as f:
    f.write(str(int(t.item())))
if rank == 0:
    dist.all_reduce(t)
time.sleep(3600)
