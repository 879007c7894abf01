"""Helpers for multi-process runs."""

from __future__ import annotations

import sys


def shutdown() -> None:
    """End a multi-process run cleanly: wait for every process, then destroy the process group (and a colocate vLLM
    engine's groups first).

    A process group left to interpreter exit can abort a process that already finished training ("terminate called
    without an active exception", SIGABRT), turning a good run's exit status into a failure. vLLM's engine destroys
    its own groups in an exit-time finalizer: after the default group is gone, that printed a traceback ("Invalid
    process group specified") at the end of every good multi-process colocate run. No-op in one process.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
        if vllm_groups is not None and getattr(vllm_groups, "_WORLD", None) is not None:  # an engine was built
            vllm_groups.cleanup_dist_env_and_memory()  # its groups, then the default group, while all are valid
        if dist.is_initialized():
            dist.destroy_process_group()


def _world_size() -> int:
    """The process group's size; the launcher's WORLD_SIZE when the group is gone (destroyed before `finish`): the
    process is still one of several, and its teardown can still abort."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def finish(code: int = 0):
    """End the process of a finished run with exit status `code`, never with a teardown crash.

    In one process this is `sys.exit(code)`. In a multi-process run it calls `shutdown` (only when `code` is 0: a failed
    process leaves at once, without waiting for its peers), runs what was registered with
    `atexit` (loggers and trackers such as wandb finish there), flushes stdout and stderr, and leaves with
    `os._exit(code)`, skipping the interpreter's finalization. Why: even after a barrier and `destroy_process_group`, a
    2-process DeepSpeed ZeRO-3 run on CPU aborted in CI *after* its model and card were saved ("terminate called
    without an active exception", SIGABRT: a C++ thread meeting a Python runtime being torn down; rare, not
    reproduced in 50 runs here). A launcher then reports the whole job as failed and kills its other processes.
    Everything the run writes is written and closed by then, so only the finalization is skipped.
    """
    multi = _world_size() > 1
    if code == 0:
        shutdown()  # a failed process must not wait at a barrier for peers that may be stuck; the launcher ends them
    if not multi:
        sys.exit(code)
    exit_without_teardown(code)


def exit_without_teardown(code: int):
    """`os._exit(code)` after what a normal exit does first: collect garbage, run the `atexit` handlers, flush stdout
    and stderr (block-buffered when they are pipes, as under a launcher)."""
    import atexit
    import gc
    import os

    gc.collect()  # unreachable objects (files among them) are finalized while the interpreter is whole
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe must not change the exit status
            pass
    os._exit(code)
