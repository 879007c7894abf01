"""Checkpoints that resume exactly and survive a hard kill.

What `transformers.Trainer` already saves: the model, the optimizer and scheduler, the RNG states (per process) and the
`TrainerState`; on resume it fast-forwards the dataloader by the number of micro-batches already trained. What it
cannot know about is GRPO's in-flight state: with `steps_per_generation > 1` (or `num_iterations > 1`) one generation
feeds several optimizer steps, and a checkpoint taken inside such a block leaves `GRPOTrainer._buffered_inputs` and
its `_step` counter behind. TRL then regenerates the buffer after a resume, with other samples (measured on the toy
task: final weights 1.4e-3 away from the uninterrupted run). This module saves, per process, a small file next to the
Trainer's own files:

    checkpoint-N/variant_state_rank{r}.pt   {"_step", "buffered_inputs", "metrics", "extra", "world_size",
                                            "scoring_tally", "unscorable_prompts", ...}

and restores it on resume. Two kinds of state are in it:

- the run's, the same on every process (computed from gathered rewards): `scoring_tally` (the unscorable-run
  guard's count of the run's generation batches and completions: a run resumed for its last steps judges them with
  its earlier batches), the prompts of its current unscorable streak, and a trainer's own state
  (`VariantTrainer.extra_state()` / `load_extra_state(state)`: a prompt selection's refill position, keep-rate
  estimate and GRESO history). Every process restores it, whatever the number of processes that wrote the
  checkpoint (a process without a file of its own reads process 0's): were one process to start from zeros, the
  processes would stop on unscorable batches at different steps, and a collective would hang;
- each process's own: the generation buffer, its counter `_step` and the metrics not logged yet, restored only by
  as many processes as wrote them (else the buffer is regenerated, with a warning).

Atomicity. `Trainer._save_checkpoint` writes straight into `checkpoint-N/` and `get_last_checkpoint` picks the
highest-numbered directory, complete or not, so a run killed while saving resumes from a half-written directory (or
fails to load it). Here a save is bracketed by two markers:

1. before anything is written, `variant_checkpoint_in_progress` (a stale directory of the same step, left by a killed
   run or an abandoned branch, is removed first);
2. after every process has written its files (a barrier), `variant_checkpoint_complete.json` is written atomically
   (temp file + `os.replace`) and the in-progress marker removed.

Model weights. `Trainer` reads a checkpoint's weights back raw (`model.load_state_dict(saved, strict=False)`), but
transformers 5 saves them in the model's original format, reverting its weight conversions: a VLM's renamed keys, an
MoE's fused experts split into one tensor per expert. Every such weight is "missing" and silently keeps its value.
`load_model_weights` (resume and `load_best_model_at_end`) converts the checkpoint with transformers' own loader into
a weightless twin of the model and copies the result into the live model, refusing a checkpoint that lacks a trained
weight.

`last_complete_checkpoint` (used for `resume_from_checkpoint=True`) skips directories without the complete marker;
directories written by another trainer (no marker of ours at all) are accepted when their `trainer_state.json` parses,
as transformers would. `save_total_limit` rotation runs only after the marker, so the last complete checkpoint is
never deleted before its successor is complete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import warnings

import torch

COMPLETE_MARKER = "variant_checkpoint_complete.json"
IN_PROGRESS_MARKER = "variant_checkpoint_in_progress"
STATE_FILE = "variant_state_rank{rank}.pt"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_STATE_RE = re.compile(r"^variant_state_rank\d+\.pt$")

FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------- lookup (pure)
def checkpoint_status(path: str) -> str:
    """`"complete"`, `"incomplete"` (ours, half-written) or `"foreign"` (no marker of ours: another trainer's)."""
    if os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return "complete"
    if os.path.exists(os.path.join(path, IN_PROGRESS_MARKER)):
        return "incomplete"
    if os.path.isdir(path) and any(_STATE_RE.match(name) for name in os.listdir(path)):
        return "incomplete"  # our state files without the marker: the save was cut after them
    return "foreign"


def _foreign_is_loadable(path: str) -> bool:
    try:
        with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


def is_resumable(path: str) -> bool:
    """True when `path` is a complete checkpoint of ours, or another trainer's with a readable trainer state."""
    status = checkpoint_status(path)
    return status == "complete" or (status == "foreign" and _foreign_is_loadable(path))


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """`(step, path)` of every `checkpoint-N` directory of `folder`, by increasing step."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(folder, name)
        if match is not None and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def last_complete_checkpoint(folder: str) -> str | None:
    """The highest-step checkpoint of `folder` that can be resumed from (see `is_resumable`), or None.

    Unlike `transformers.trainer_utils.get_last_checkpoint`, a directory left half-written by a killed save is skipped.
    """
    for _, path in reversed(list_checkpoints(folder)):
        if is_resumable(path):
            return path
    return None


def resolve_resume(resume_from_checkpoint, output_dir: str):
    """What `Trainer.train` should resume from: `True` -> the last complete checkpoint (one-line error if none); a
    path -> itself, refused in one line when it is a half-written checkpoint of ours."""
    if resume_from_checkpoint is True:
        found = last_complete_checkpoint(output_dir)
        if found is None:
            raise ValueError(
                f"resume_from_checkpoint: expected a complete checkpoint-N directory in {output_dir!r}, found none"
            )
        skipped = [p for s, p in list_checkpoints(output_dir) if s > _step_of(found) and not is_resumable(p)]
        if skipped:
            warnings.warn(f"Resuming from {found}; skipping incomplete checkpoint(s) {skipped} (a save was cut short)")
        return found
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and checkpoint_status(str(resume_from_checkpoint)) == (
        "incomplete"
    ):
        last = last_complete_checkpoint(os.path.dirname(os.path.abspath(str(resume_from_checkpoint))))
        raise ValueError(
            f"resume_from_checkpoint: expected a complete checkpoint, got {str(resume_from_checkpoint)!r}, which was "
            f"cut short while saving (last complete: {last!r}; pass True to pick it)"
        )
    return resume_from_checkpoint


def _step_of(path: str) -> int:
    match = _CHECKPOINT_RE.match(os.path.basename(path))
    return int(match.group(1)) if match else -1


# --------------------------------------------------------------------------------------------- writing
def atomic_write_bytes(path: str, write) -> None:
    """Write a file so that readers see either nothing or the whole file: `write(fileobj)` into a temp file in the
    same directory, fsync, then `os.replace`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_dir(trainer, trial) -> str:
    """The directory `Trainer._save_checkpoint` is about to write (same naming as transformers)."""
    return os.path.join(trainer._get_output_dir(trial=trial), f"checkpoint-{trainer.state.global_step}")


def begin_checkpoint(trainer, output_dir: str) -> None:
    """Mark `output_dir` as being written (after removing a stale directory of the same step). Collective."""
    if trainer.args.should_save:
        if os.path.isdir(output_dir):
            # left by a killed save or by an abandoned run of the same output_dir: writing over it file by file
            # would mix two checkpoints (and an old complete marker would vouch for the mix)
            shutil.rmtree(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        atomic_write_bytes(os.path.join(output_dir, IN_PROGRESS_MARKER), lambda f: f.write(b"saving\n"))
        _fsync_dir(output_dir)
    trainer.accelerator.wait_for_everyone()


def trainer_state_dict(trainer) -> dict:
    """This process's in-flight state: the generation buffer and its counter, unlogged metrics, the scoring tally,
    extra state."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    step = int(trainer._step)
    # at a block boundary the buffer is about to be regenerated: it would be dead weight in the checkpoint
    buffered = trainer._buffered_inputs if step % generate_every != 0 else None
    return {
        "format_version": FORMAT_VERSION,
        "world_size": trainer.accelerator.num_processes,
        "process_index": trainer.accelerator.process_index,
        "global_step": trainer.state.global_step,
        "_step": step,
        "buffered_inputs": buffered,
        "metrics": {k: list(v) for k, v in trainer._metrics["train"].items()},
        "scoring_tally": dict(trainer.scoring_tally),
        "unscorable_prompts": list(trainer._unscorable_prompts),
        "extra": trainer.extra_state(),
    }


def save_trainer_state(trainer, output_dir: str) -> None:
    """Write this process's `variant_state_rank{r}.pt` (every process writes its own)."""
    os.makedirs(output_dir, exist_ok=True)
    state = trainer_state_dict(trainer)
    path = os.path.join(output_dir, STATE_FILE.format(rank=trainer.accelerator.process_index))
    atomic_write_bytes(path, lambda f: torch.save(state, f))


def finish_checkpoint(trainer, output_dir: str) -> None:
    """Wait for every process, then mark `output_dir` complete (atomically). Collective."""
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        info = {
            "global_step": trainer.state.global_step,
            "world_size": trainer.accelerator.num_processes,
            "format_version": FORMAT_VERSION,
        }
        atomic_write_bytes(os.path.join(output_dir, COMPLETE_MARKER), lambda f: f.write(json.dumps(info).encode()))
        try:
            os.remove(os.path.join(output_dir, IN_PROGRESS_MARKER))
        except FileNotFoundError:
            pass
        _fsync_dir(output_dir)
    trainer.accelerator.wait_for_everyone()


def rotate(run_dir: str, save_total_limit: int | None, keep: tuple[str, ...] = ()) -> None:
    """Keep the `save_total_limit` newest complete checkpoints (and `keep`); remove older ones and the half-written
    ones older than the newest complete checkpoint. Run on the saving process only, after `finish_checkpoint`."""
    checkpoints = list_checkpoints(run_dir)
    complete = [(s, p) for s, p in checkpoints if checkpoint_status(p) == "complete"]
    if not complete:
        return
    newest = complete[-1][0]
    protected = {os.path.abspath(p) for p in keep if p}
    for step, path in checkpoints:
        if step < newest and checkpoint_status(path) == "incomplete" and os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)
    if save_total_limit is None or save_total_limit <= 0:
        return
    removable = [p for _, p in complete[:-1] if os.path.abspath(p) not in protected]
    excess = len(complete) - max(save_total_limit, 1)
    for path in removable[: max(excess, 0)]:
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(trainer, model, trial, save_fn) -> None:
    """`Trainer._save_checkpoint` made atomic and complete: `save_fn(model, trial)` is the parent's method."""
    output_dir = checkpoint_dir(trainer, trial)
    begin_checkpoint(trainer, output_dir)
    limit = trainer.args.save_total_limit
    trainer.args.save_total_limit = None  # the parent's rotation would run before our marker: rotate afterwards
    try:
        save_fn(model, trial)
    finally:
        trainer.args.save_total_limit = limit
    save_trainer_state(trainer, output_dir)
    finish_checkpoint(trainer, output_dir)
    if trainer.args.should_save:
        rotate(trainer._get_output_dir(trial=trial), limit, keep=(trainer.state.best_model_checkpoint,))


# --------------------------------------------------------------------------------------------- loading
def load_trainer_state(trainer, checkpoint: str) -> bool:
    """Restore the in-flight state from `checkpoint` (see the module docstring): the run's state on every process,
    from this process's file or else process 0's; this process's own state when as many processes wrote the
    checkpoint. Returns False (with a warning saying what is lost) when this process's own state was not restored:
    then TRL's behaviour applies (the buffer is regenerated)."""
    rank, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
    own = os.path.join(checkpoint, STATE_FILE.format(rank=rank))
    path = own if os.path.isfile(own) else os.path.join(checkpoint, STATE_FILE.format(rank=0))
    if not os.path.isfile(path):
        warnings.warn(
            f"{checkpoint} holds no generation buffer for process {rank} (written by another trainer): the resumed "
            "run regenerates it, so it will not reproduce the uninterrupted run exactly"
        )
        return False
    # our own file, written by `save_trainer_state`; it holds tensors and Python containers (not only weights)
    state = torch.load(path, map_location=trainer.accelerator.device, weights_only=False)
    trainer.scoring_tally.update(state.get("scoring_tally") or {})
    trainer._unscorable_prompts = set(state.get("unscorable_prompts") or ())
    trainer.load_extra_state(state.get("extra") or {})
    written = state.get("world_size")
    if path != own or written != processes:
        warnings.warn(
            f"{checkpoint} was written by {written} process{'' if written == 1 else 'es'}, resuming with "
            f"{processes}: the run's state (scoring tally, prompt selection) is restored on every process, but not "
            "each process's generation buffer and unlogged metrics: the buffer is regenerated (not an exact resume)"
        )
        return False
    trainer._step = int(state["_step"])
    trainer._buffered_inputs = state["buffered_inputs"]
    metrics = trainer._metrics["train"]
    metrics.clear()
    for key, values in state.get("metrics", {}).items():
        metrics[key].extend(values)
    return True


# --------------------------------------------------------------------------------------------- model weights
#: a checkpoint's full-model weight files, in the order transformers prefers them: (single file, sharded index)
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def weight_files(folder: str) -> list[str]:
    """The files that hold the full model's weights in the checkpoint folder `folder` (every shard of a sharded one),
    or [] when it holds none (an adapter's checkpoint, FSDP's sharded state, a folder without weights)."""
    for single, index in WEIGHT_FILES:
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
        if os.path.isfile(os.path.join(folder, index)):
            with open(os.path.join(folder, index)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(folder, shard) for shard in shards]
    return []


def _read_weights(files: list[str], stack: contextlib.ExitStack) -> dict:
    """Every tensor of `files` by its saved name: safetensors lazily (slices, read when converted), torch files
    whole. Open files stay open until `stack` closes."""
    from safetensors import safe_open

    state = {}
    for file in files:
        if file.endswith(".safetensors"):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            state.update({key: handle.get_slice(key) for key in handle.keys()})
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def _meta_twin(model):
    """A weightless copy of `model`'s class and config (meta tensors), each tensor in the dtype of the model's own
    (a `cast_lm_head_to_fp32` head stays fp32): what transformers' loader fills without rounding anything."""
    with torch.device("meta"):
        twin = type(model)(copy.deepcopy(model.config))
    own = model.state_dict()
    for name, tensor in twin.state_dict(keep_vars=True).items():
        if name in own and own[name].dtype != tensor.dtype:
            tensor.data = tensor.data.to(own[name].dtype)
    return twin


def checkpoint_to_model_keys(model, state_dict: dict) -> dict:
    """The tensors of a state dict written by `save_pretrained` under the model's own keys and layout, ready for
    `model.load_state_dict`; keys of the model the checkpoint does not hold are absent. Values may be tensors or
    safetensors slices. See `convert_checkpoint`."""
    return convert_checkpoint(model, state_dict)[0]


def convert_checkpoint(model, state_dict: dict, source: str = "checkpoint") -> tuple[dict, set[str]]:
    """(`checkpoint_to_model_keys`, the keys of the model's class): a `save_pretrained` state dict is in the model's
    original format (transformers 5 reverts its weight conversions on save: a VLM's "model.language_model.*" becomes
    "language_model.model.*", an MoE's fused `experts.gate_up_proj` one `gate_proj` and one `up_proj` per expert).

    transformers' own checkpoint loader (`convert_and_load_state_dict_in_model`, what `from_pretrained` runs) does the
    conversion, with the mapping the model was saved with (`_weight_conversions`, else its class's), into a
    weightless twin of the model (`_meta_twin`): the live model's parameters (the optimizer's, DDP's, tied ones) are
    only ever copied into, never replaced. A checkpoint key the class does not know but the live model holds verbatim
    (a PPO policy's attached critic, in checkpoints written before the critic was saved apart) is passed through."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    twin = _meta_twin(model)
    mapping = getattr(model, "_weight_conversions", None)
    # a copy: loading marks the transforms it used, and the model saves with those marked at its own load
    mapping = copy.deepcopy(mapping if mapping is not None else get_model_conversion_mapping(model))
    info, _ = convert_and_load_state_dict_in_model(twin, state_dict, LoadStateDictConfig(weight_mapping=mapping))
    if info.mismatched_keys:  # e.g. an expert missing from a fused tensor
        key, shape, expected = sorted(info.mismatched_keys)[0]
        raise ValueError(f"{source}: expected {key} of shape {tuple(expected)}, got {tuple(shape)} from its saved "
                         f"tensors ({len(info.mismatched_keys)} such)")
    twin_state = twin.state_dict()
    converted = {key: value for key, value in twin_state.items() if not value.is_meta}
    own = model.state_dict()
    converted.update({key: value if isinstance(value, torch.Tensor) else value[:]
                      for key, value in state_dict.items() if key in info.unexpected_keys and key in own})
    return converted, set(twin_state)


def load_model_weights(trainer, model, folder: str) -> bool:
    """Load the model weights of the checkpoint folder `folder` into `model` in place, every trained weight of the
    model's class included (`convert_checkpoint`); False, with nothing done, when this is not the path: `model` is
    not a plain transformers model (a PEFT model: its adapter), or the folder holds no full-model weights.

    transformers' `Trainer` reads the files and calls `model.load_state_dict(saved, strict=False)`: weights saved in
    another format than the model's are "missing" and silently keep their values (a VLM's 57 of 58, an MoE's fused
    experts: trl.GRPOTrainer resumes a tiny Qwen3-MoE with 23 of its 25 tensors). Here a trained weight of the
    model's class that the checkpoint does not restore is an error."""
    from transformers import PreTrainedModel

    files = weight_files(folder)
    if not files or not isinstance(model, PreTrainedModel):
        return False
    with contextlib.ExitStack() as stack:
        converted, owned = convert_checkpoint(model, _read_weights(files, stack), f"checkpoint {folder}")
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    lost = [name for name, param in model.named_parameters()
            if name in owned and param.requires_grad and name not in converted and name not in tied]
    if lost:
        raise ValueError(f"checkpoint {folder}: expected every trained weight of the model, {len(lost)} missing "
                         f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): they would keep their "
                         "current values")
    trainer._issue_warnings_after_load(model.load_state_dict(converted, strict=False))
    return True


# --------------------------------------------------------------------------------------------- data order
def resumable_sampler(sampler, trainer):
    """TRL's `RepeatSampler` draws epoch e's shuffle from one generator advanced by the e earlier passes, so a run
    resumed in epoch e >= 1 (a fresh sampler: no earlier pass) sees epoch 0's order again. Measured on the toy task:
    resuming at step 5 of 7 with 4 steps per epoch gave final weights 5e-4 away from the uninterrupted run. The
    replacement draws the same permutations as TRL's uninterrupted sampler (epoch e = the (e+1)-th draw from the
    seed), computed from the epoch alone. Other samplers are returned unchanged."""
    from trl.trainer.utils import RepeatSampler

    if type(sampler) is not RepeatSampler or not sampler.shuffle or sampler.seed is None:
        return sampler
    return _ResumableRepeatSampler(sampler, trainer)


class _EpochOf:
    """The epoch the trainer is in: floor of `TrainerState.epoch` (fractional inside an epoch, exact at its end;
    after a resume it is the checkpoint's, whose floor is the epoch being resumed)."""

    def __init__(self, trainer):
        import weakref

        self._trainer = weakref.ref(trainer)

    def __call__(self) -> int:
        trainer = self._trainer()
        epoch = getattr(getattr(trainer, "state", None), "epoch", None) or 0.0
        return int(epoch)


def _resumable_repeat_sampler_class():
    from trl.trainer.utils import RepeatSampler

    class ResumableRepeatSampler(RepeatSampler):
        def __init__(self, base, trainer):
            super().__init__(base.data_source, mini_repeat_count=base.mini_repeat_count, batch_size=base.batch_size,
                             repeat_count=base.repeat_count, shuffle=base.shuffle, seed=base.seed)
            self.epoch_of = _EpochOf(trainer)

        def __iter__(self):
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed)
            for _ in range(self.epoch_of()):  # O(epochs x dataset): negligible next to one generation
                torch.randperm(self.num_samples, generator=self.generator)
            return super().__iter__()

    return ResumableRepeatSampler


def _ResumableRepeatSampler(base, trainer):
    global _SAMPLER_CLASS
    if _SAMPLER_CLASS is None:
        _SAMPLER_CLASS = _resumable_repeat_sampler_class()
    return _SAMPLER_CLASS(base, trainer)


_SAMPLER_CLASS = None
