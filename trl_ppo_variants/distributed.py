"""Helpers for multi-process runs."""

from __future__ import annotations


def shutdown() -> None:
    """End a multi-process run cleanly: wait for every process, then destroy the process group.

    A process group left to interpreter exit can abort a process that already finished training ("terminate called
    without an active exception", SIGABRT), turning a good run's exit status into a failure. No-op in one process.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
