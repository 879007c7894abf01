"""Bad input refused early, bad rewards contained: the checks shared by every trainer of the package.

- `post_init(config, parent_post_init)`: `VariantConfig.__post_init__` runs TRL's checks through this, so that TRL's
  batch-size errors come out as our one-line `field: expected ..., got ...`, then the shared construction-time checks
  (clip ranges, coefficients, DeepSpeed ZeRO-3 combinations known to fail).
- `check_model_limits(trainer)`: what needs the loaded model (the context length).
- `RewardGuard`: wraps each reward function for one `_calculate_rewards` call. A function that raises, returns the
  wrong number of rewards or a non-number does not crash this process alone (the others would hang in the gather
  that follows): the failure is recorded, every process learns it through one small gather, and every process
  raises the same one-line error naming the function and the batch, before any loss is computed on the batch.
  ``None``/NaN/``+-inf`` rewards are contained: ``+-inf`` becomes NaN ("unscorable", advantage 0, as TRL treats
  ``None``) and the number of such values per function is logged as ``rewards/<name>/non_finite``.

The table of every check is in `docs/reliability.md`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os

import torch

from .errors import check

# --------------------------------------------------------------------------------------------- config


def _batch_error(args) -> None:
    """Re-state TRL's generation-batch errors (raised in `GRPOConfig.__post_init__`) as one line naming the field."""
    world = args.world_size
    per_device = args.per_device_train_batch_size
    gbs, spg, group = args.generation_batch_size, args.steps_per_generation, args.num_generations
    if gbs is not None and spg is not None:
        check(gbs == per_device * world * spg, "steps_per_generation",
              "None when generation_batch_size is set (set only one of the two)", spg)
    if gbs is not None and spg is None:
        check(gbs % (per_device * world) == 0, "generation_batch_size",
              f"a multiple of per_device_train_batch_size x processes = {per_device * world}", gbs)
    if gbs is not None and group:
        check(gbs % group == 0, "generation_batch_size", f"a multiple of num_generations={group} "
              f"(generation_batch_size = per_device_train_batch_size {per_device} x {world} processes x "
              f"steps_per_generation {spg})", gbs)
    if args.do_eval and args.eval_strategy != "no":
        eval_group = args.num_generations_eval or group
        check((args.per_device_eval_batch_size * world) % eval_group == 0, "per_device_eval_batch_size",
              f"a value whose product with {world} processes is a multiple of num_generations_eval={eval_group}",
              args.per_device_eval_batch_size)


def _zero_stage(args) -> int | None:
    plugin = getattr(args, "deepspeed_plugin", None)
    return getattr(plugin, "zero_stage", None) if plugin is not None else None


def _own_fields(args):
    """(name, value) of the fields our configs add on top of `GRPOConfig` (VariantConfig and the algorithms')."""
    import dataclasses

    from trl import GRPOConfig

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(args):
        if f.name not in trl_fields:
            yield f.name, getattr(args, f.name)


def _looks_local(value: str) -> bool:
    """A path, not a Hub id: absolute, relative with ./ or ../, home-relative, or more than one separator."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or os.sep != "/" and os.sep in value


def check_config(args) -> None:
    """The shared construction-time checks that need TRL's derived fields (run after `GRPOConfig.__post_init__`)."""
    # clip ranges: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]; epsilon > 1 makes the lower bound negative
    if args.loss_type != "cispo":
        check(0 <= args.epsilon <= 1, "epsilon",
              "a number in [0, 1] (the ratio's lower clip bound 1 - epsilon must stay >= 0)", args.epsilon)
    high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if args.delta is not None:
        check(args.delta > 1 + high, "delta", f"a number > 1 + epsilon_high = {1 + high} (the two-sided clip's upper "
              "bound)", args.delta)
    for name in ("num_iterations", "steps_per_generation"):
        value = getattr(args, name)
        check(value is None or isinstance(value, int) and value >= 1, name, "an integer >= 1", value)
    if args.max_completion_length is not None:
        check(args.max_completion_length >= 1, "max_completion_length", "an integer >= 1", args.max_completion_length)
    check(0 < args.top_p <= 1, "top_p", "a number in (0, 1]", args.top_p)
    check(not args.learning_rate < 0, "learning_rate", "a number >= 0", args.learning_rate)
    # every coefficient our configs add (kl_in_reward_coef, vf_coef, positive_lm_coef, ...) weights a loss or a
    # penalty term whose sign is fixed by the paper: a negative one silently turns a penalty into a bonus
    for name, value in _own_fields(args):
        if name.endswith("_coef") and isinstance(value, numbers.Real):
            check(value >= 0, name, "a number >= 0", value)
        # model paths (value_model_path, ...): a local path must exist now, not after the policy has loaded (a Hub
        # id "org/name" is left to from_pretrained)
        if name.endswith("_path") and isinstance(value, str) and _looks_local(value):
            check(os.path.exists(os.path.expanduser(value)), name, "an existing local path or a Hub model id", value)
    # DeepSpeed ZeRO-3 combinations known not to work (see docs/reliability.md for the sources)
    if _zero_stage(args) == 3 and args.use_vllm:
        check(args.ds3_gather_for_generation, "ds3_gather_for_generation", "True with use_vllm=True under DeepSpeed "
              "ZeRO-3 (vLLM needs the full weights; TRL documents the pair as incompatible)",
              args.ds3_gather_for_generation)


def post_init(args, parent_post_init) -> None:
    """Run `GRPOConfig.__post_init__` (passed bound), restating its batch errors in one line; then `check_config`."""
    try:
        parent_post_init()
    except ValueError:
        if getattr(args, "num_generations", None) is not None and getattr(args, "generation_batch_size", None):
            _batch_error(args)
        raise
    check_config(args)


def model_context_length(model) -> int | None:
    """The longest sequence the model's config declares (None when it declares none)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model_limits(trainer) -> None:
    """Checks that need the loaded model: the completion must fit in the model's context with at least one prompt
    token."""
    context = model_context_length(trainer.model)
    limit = trainer.args.max_completion_length
    if context is not None and limit is not None:
        check(limit < context, "max_completion_length", f"at most {context - 1} (the model's context is {context} "
              "positions, the prompt needs at least one)", limit)


# --------------------------------------------------------------------------------------------- rewards
#: the logger of TRL's `GRPOTrainer._calculate_rewards`
TRL_GRPO_LOGGER = "trl.trainer.grpo_trainer"


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_reward(value):
    """A reward value as float or None; raises TypeError for anything else (strings, lists, ...)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _as_reward(value.item())
    raise TypeError(f"a non-number {_one_line(repr(value), 40)}")


class RewardGuard:
    """Wraps the reward functions of `trainer` for one `_calculate_rewards` call (see the module docstring)."""

    RAISED, BAD_OUTPUT = 1, 2

    def __init__(self, trainer, prompts):
        self.trainer = trainer
        self.prompts = prompts
        self.failure = None  # (function index, kind, one-line detail) of this process's first failure

    def wrap(self, funcs):
        from trl.trainer.utils import is_async_callable

        wrapped = []
        for index, func in enumerate(funcs):
            if isinstance(func, torch.nn.Module):
                wrapped.append(func)  # reward models return tensors; their non-finite values are caught after
            elif is_async_callable(func):
                wrapped.append(self._async_wrapper(index, func))
            else:
                wrapped.append(self._sync_wrapper(index, func))
        return wrapped

    def _check(self, index, output, expected):
        try:
            count = len(output)
        except TypeError:
            self.failure = (index, self.BAD_OUTPUT, f"returned {_one_line(repr(output), 40)} instead of a list")
            return [None] * expected
        if count != expected:
            self.failure = (index, self.BAD_OUTPUT, f"returned {count} rewards for {expected} completions")
            return [None] * expected
        try:
            return [_as_reward(v) for v in output]
        except TypeError as exc:
            self.failure = (index, self.BAD_OUTPUT, f"returned {exc}")
            return [None] * expected

    def _raised(self, index, exc, expected):
        """Record that reward function `index` raised `exc`; its rows become unscorable until `raise_if_failed`."""
        self.failure = (index, self.RAISED, f"raised {type(exc).__name__}: {_one_line(exc, 120)}")
        self.exception = exc
        return [None] * expected

    def _sync_wrapper(self, index, func):
        def guarded(*args, **kwargs):
            expected = len(kwargs.get("prompts", self.prompts))
            if self.failure is not None:
                return [None] * expected  # the batch is lost anyway: do not spend time on the other functions
            try:
                output = func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every process, with the batch named
                return self._raised(index, exc, expected)
            return self._check(index, output, expected)

        guarded.__name__ = getattr(func, "__name__", type(func).__name__)
        return guarded

    def _async_wrapper(self, index, func):
        async def guarded(*args, **kwargs):
            expected = len(kwargs.get("prompts", self.prompts))
            if self.failure is not None:
                return [None] * expected
            try:
                output = await func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                return self._raised(index, exc, expected)
            return self._check(index, output, expected)

        guarded.__name__ = getattr(func, "__name__", type(func).__name__)
        return guarded

    @contextlib.contextmanager
    def quiet_trl_none_warning(self):
        """While TRL scores the batch: drop its warning "All reward functions returned None ... ensure that at least
        one reward function returns a valid reward" when it comes from this guard's placeholders (a function raised
        or returned bad output: the one-line error that follows says so). A real all-None row still warns."""
        trl_logger = logging.getLogger(TRL_GRPO_LOGGER)

        def keep(record: logging.LogRecord) -> bool:
            return self.failure is None or "All reward functions returned None" not in str(record.msg)

        trl_logger.addFilter(keep)
        try:
            yield
        finally:
            trl_logger.removeFilter(keep)

    def raise_if_failed(self) -> None:
        """Collective: every process raises the same kind of one-line error when any process recorded a failure."""
        trainer = self.trainer
        code = torch.tensor(
            [0, 0] if self.failure is None else [self.failure[1], self.failure[0]],
            dtype=torch.long, device=trainer.accelerator.device,
        )
        if trainer.accelerator.num_processes > 1:
            codes = trainer.accelerator.gather(code.unsqueeze(0)).view(-1, 2)
        else:
            codes = code.view(1, 2)
        failed = (codes[:, 0] != 0).nonzero(as_tuple=True)[0]
        if failed.numel() == 0:
            return
        step = trainer.state.global_step
        rank = trainer.accelerator.process_index
        if self.failure is not None:
            index, kind, detail = self.failure
            name = trainer.reward_func_names[index]
            first = _one_line(repr(self.prompts[0]), 80) if len(self.prompts) else "(none)"
            message = (f"reward function '{name}' {detail} (batch of global step {step}, process {rank}, first prompt "
                       f"{first}); no optimizer step was taken on this batch")
            error = RuntimeError(message) if kind == self.RAISED else ValueError(message)
            raise error from getattr(self, "exception", None)
        other = int(failed[0])
        name = trainer.reward_func_names[int(codes[other, 1])]
        raise RuntimeError(f"reward function '{name}' failed on process {other} (batch of global step {step}); see "
                           "that process's error; no optimizer step was taken on this batch")


def contain_non_finite(trainer, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """(N, F) gathered rewards -> the same with +-inf turned into NaN (unscorable: advantage 0, as TRL does for None);
    logs the number of None/NaN/inf values per function as `rewards/<name>/non_finite`."""
    mode = "train" if trainer.model.training else "eval"
    bad = ~torch.isfinite(rewards_per_func)
    counts = bad.sum(dim=0).tolist()
    for name, count in zip(trainer.reward_func_names, counts):
        trainer._metrics[mode][f"rewards/{name}/non_finite"].append(float(count))
    if torch.isinf(rewards_per_func).any():
        rewards_per_func = torch.where(torch.isinf(rewards_per_func), torch.full_like(rewards_per_func, math.nan),
                                       rewards_per_func)
    return rewards_per_func
