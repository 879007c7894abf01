"""A hard kill while a checkpoint is written leaves the last complete checkpoint usable (issue 7, point 2)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from launcher import SCRIPTS, accelerate_launch, launch_env
from reliability_helpers import make_trainer, modules_state
from transformers.trainer_utils import get_last_checkpoint

from trl_ppo_variants import checkpointing

SCRIPT = str(SCRIPTS / "reliability_slow_save.py")


@pytest.mark.timeout(400)
def test_sigkill_during_checkpoint_write_resumes_from_last_complete(toy_model_dir, tmp_path):
    out = tmp_path / "run"
    env = launch_env(RELIABILITY_SLOW_SAVE_AT="4")  # one process, the launched scripts' environment
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--model", toy_model_dir, "--output-dir", str(out), "--max-steps", "6",
         "--save-steps", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 300
        while not (out / "SAVING").exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "the run never reached the checkpoint of step 4"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # mid-checkpoint: weights written, optimizer/RNG/state not
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    half, last = out / "checkpoint-4", out / "checkpoint-2"
    assert (half / "model.safetensors").exists() and not (half / "optimizer.pt").exists()
    assert checkpointing.checkpoint_status(str(half)) == "incomplete"
    assert checkpointing.checkpoint_status(str(last)) == "complete"
    # what transformers alone would resume from, and what we resume from
    assert get_last_checkpoint(str(out)) == str(half)
    assert checkpointing.last_complete_checkpoint(str(out)) == str(last)

    common = dict(max_steps=6, save_strategy="steps", save_steps=2, steps_per_generation=2)
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "run", **common)
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    logged_steps = [e["step"] for e in resumed.state.log_history if "loss" in e]
    assert logged_steps == [1, 2, 3, 4, 5, 6]  # 1-2 from checkpoint-2's history, 3-6 trained after the resume
    for step in (2, 4, 6):
        assert checkpointing.checkpoint_status(str(out / f"checkpoint-{step}")) == "complete"

    # and the run it continued is the uninterrupted one
    reference = make_trainer("rloo", toy_model_dir, tmp_path, "reference", **common)
    reference.train()
    wa, wb = modules_state(reference), modules_state(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------------------------- lookup rules, no training
def _fake_checkpoint(folder, step, *, complete=False, in_progress=False, state_file=False, trainer_state=True):
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if trainer_state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        (path / checkpointing.COMPLETE_MARKER).write_text("{}")
    if in_progress:
        (path / checkpointing.IN_PROGRESS_MARKER).write_text("saving")
    if state_file:
        (path / "variant_state_rank0.pt").write_bytes(b"")
    return str(path)


def test_last_complete_checkpoint_skips_half_written(tmp_path):
    c2 = _fake_checkpoint(tmp_path, 2, complete=True, state_file=True)
    _fake_checkpoint(tmp_path, 4, in_progress=True, trainer_state=False)  # killed early in the save
    _fake_checkpoint(tmp_path, 6, state_file=True)  # killed after our state file, before the marker
    (tmp_path / "checkpoint-10.tmp").mkdir()  # not a checkpoint-N name: never picked
    (tmp_path / "checkpoint-10.tmp" / checkpointing.COMPLETE_MARKER).write_text("{}")
    assert checkpointing.last_complete_checkpoint(str(tmp_path)) == c2
    assert checkpointing.resolve_resume(False, str(tmp_path)) is False
    with pytest.warns(UserWarning, match="skipping incomplete"):
        assert checkpointing.resolve_resume(True, str(tmp_path)) == c2
    with pytest.raises(ValueError) as err:
        checkpointing.resolve_resume(str(tmp_path / "checkpoint-6"), str(tmp_path))
    assert "\n" not in str(err.value) and str(err.value).startswith("resume_from_checkpoint:") and c2 in str(err.value)


def test_foreign_checkpoints_follow_transformers(tmp_path):
    """A checkpoint written by another trainer (no marker of ours) is accepted when its trainer state parses."""
    good = _fake_checkpoint(tmp_path, 3)
    bad = _fake_checkpoint(tmp_path, 5, trainer_state=False)
    assert checkpointing.checkpoint_status(bad) == "foreign" and not checkpointing.is_resumable(bad)
    assert checkpointing.last_complete_checkpoint(str(tmp_path)) == good


def test_no_checkpoint_is_a_one_line_error(tmp_path):
    _fake_checkpoint(tmp_path, 4, in_progress=True)
    with pytest.raises(ValueError) as err:
        checkpointing.resolve_resume(True, str(tmp_path))
    assert "\n" not in str(err.value) and "resume_from_checkpoint" in str(err.value)


def test_rotation_keeps_last_complete(tmp_path):
    c2 = _fake_checkpoint(tmp_path, 2, complete=True)
    _fake_checkpoint(tmp_path, 3, in_progress=True)
    c4 = _fake_checkpoint(tmp_path, 4, complete=True)
    c6 = _fake_checkpoint(tmp_path, 6, complete=True)
    checkpointing.rotate(str(tmp_path), save_total_limit=2, keep=(c2,))
    remaining = sorted(p for _, p in checkpointing.list_checkpoints(str(tmp_path)))
    assert remaining == sorted([c2, c6]) and c4 not in remaining  # newest and best survive
    assert not (tmp_path / "checkpoint-3").exists()
    checkpointing.rotate(str(tmp_path), save_total_limit=1)
    assert [p for _, p in checkpointing.list_checkpoints(str(tmp_path))] == [c6]


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        checkpointing.atomic_write_bytes(str(target), boom)
    assert target.read_text() == "old"


# --------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_stay_in_step(toy_model_dir, tmp_path, machines):
    """Length limit hit on process 0 only (its rows all masked by mask_truncated_completions), for every trainer:
    no hang, same row counts, finite losses, identical weights on both processes; then a reward function raising on
    process 1 only: both processes stop with a one-line error instead of one of them hanging in the gather."""
    accelerate_launch("reliability_2proc.py", toy_model_dir, tmp_path, timeout=840, machines=machines)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["length_limit"].keys() == results[1]["length_limit"].keys()
    for name, res in results[0]["length_limit"].items():
        assert res["steps"] == 2, name
        assert res["rows_equal_across_ranks"] and res["weights_equal_across_ranks"], (name, res)
        assert res["weights_changed"] and res["losses_finite"], (name, res)
        assert all(c >= 0.5 for c in res["clipped_ratio"]), (name, res)  # process 0's half of the batch hit the limit
    for rank, res in enumerate(r["raise"] for r in results):
        assert res["error_type"] == "RuntimeError" and res["steps"] == 0, res
        assert "\n" not in res["message"] and "'rank1_breaks'" in res["message"], res
    assert "KeyError" in results[1]["raise"]["message"]  # the failing process names the exception
    assert "failed on process 1" in results[0]["raise"]["message"]  # the other one names the failing process
