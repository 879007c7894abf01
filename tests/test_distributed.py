"""`distributed.finish`: the exit status of a run is its own, atexit handlers run and buffered output is flushed,
in one process, in the teardown-free exit path and in two processes (gloo, CPU).
Script: tests/scripts/finish_2proc.py."""

import os
import subprocess
import sys
import time

import pytest
from launcher import accelerate_launch


def _buffered_env(**extra):
    """stdout to a pipe is block-buffered unless PYTHONUNBUFFERED is set (CI sets it): unset it, so the test sees
    whether `finish` flushes."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return {**env, **extra}


@pytest.mark.parametrize("call,world,code,teardown", [
    ("finish(3)", "1", 3, True),  # one process: plain sys.exit, with the interpreter's teardown
    ("exit_without_teardown(5)", "1", 5, False),  # the multi-process path, without the process group
    # one of several processes whose group was already destroyed (as the command's was, once): still no teardown
    ("finish(4)", "2", 4, False),
])
def test_exit_status_atexit_and_flushed_output_in_one_process(tmp_path, call, world, code, teardown):
    marker = tmp_path / "atexit"
    script = (f"import atexit; atexit.register(lambda: open({str(marker)!r}, 'w').write('ran')); "
              "print('buffered', end=''); from trl_ppo_variants.distributed import *\n"
              f"try:\n    {call}\nfinally:\n    print(' teardown', end='')")
    proc = subprocess.run([sys.executable, "-c", script], env=_buffered_env(WORLD_SIZE=world), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout == ("buffered teardown" if teardown else "buffered")
    assert marker.read_text() == "ran"


def _launch(out_dir, code, machines):
    """Both processes end with `finish(code)`; stdout stays block-buffered (PYTHONUNBUFFERED unset)."""
    return accelerate_launch("finish_2proc.py", out_dir, code, timeout=300, check=code == 0, machines=machines,
                             unset=("PYTHONUNBUFFERED",))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_exit_with_their_status_after_atexit_and_flush(tmp_path, machines):
    proc = _launch(tmp_path, 0, machines)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"FINISH-RANK{rank} world=2" in proc.stdout  # flushed before os._exit
        assert (tmp_path / f"atexit_rank{rank}").read_text() == "ran"
    assert "finish returned" not in proc.stderr

    (tmp_path / "finishing_rank1").unlink()
    # rank 1 fails while rank 0 is busy (for 120 s): a failure stays a failure, and is not held up. Timed from when
    # rank 1 began to finish, not from the launch: starting the processes on a loaded machine can take a minute too
    failed = _launch(tmp_path, 7, machines)
    ended = time.time()
    assert failed.returncode != 0
    assert "exitcode: 7" in failed.stderr, failed.stderr[-2000:]
    finishing = (tmp_path / "finishing_rank1").stat().st_mtime
    assert ended - finishing < 60, "the failed process waited for its busy peer"
