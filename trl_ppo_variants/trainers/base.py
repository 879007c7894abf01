"""The seam into TRL's `GRPOTrainer`, shared by every trainer of this package.

TRL has no advantage hook: advantages are computed inside `_generate_and_score_completions` (about 600 lines). We do
not copy that method (TRL deleted several of its own experimental trainers whose copies drifted). Instead:

1. `_calculate_rewards` is wrapped to keep the rewards it returns (already gathered across processes);
2. `_generate_and_score_completions` calls TRL's, then lets the algorithm
   a. optionally keep only some rows (`select_rows`: DAPO's filter, TTRL's vote/train split; see `selection.py`),
   b. recompute the advantages from the kept rewards with the pure functions of `advantages.py`
      (`compute_advantages`, (N,) or (N, T) on the global batch), and
   c. replace `output["advantages"]` with this process's slice and the logged advantages with ours.
3. `_compute_loss` is TRL's, which accepts (B, T) advantages; the base adds the terms every algorithm shares: our
   KL loss estimators, the dual-clip correction (`clip_ratio_c`), each reduced like the policy loss (`_aggregate`).
4. `_prepare_inputs` is TRL's; with `steps_per_generation != gradient_accumulation_steps` the token count that
   normalises token-level losses is replaced by that optimizer step's own (`token_level_normalizer`).
5. `_get_per_token_logps_and_entropies` is TRL's; where one of its chunks of rows (or a micro-batch) holds no image,
   it runs per chunk with the chunk's own image inputs (`rollout.image_chunks`: none for a chunk without an image;
   TRL's slicing gives such a chunk empty image tensors, which the vision towers refuse).

`tests/test_trl_guard.py` fails loudly when the private signatures used here change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer

from .. import async_rollout, checkpointing, generation, guards, rollout, vllm_cpu, vllm_server
from ..advantages import KL_KINDS, grpo_advantages, kl_estimate, normalize_then_sum_advantages
from ..errors import check
from ..losses import LOSS_TYPES, aggregate_token_loss, ppo_clip_policy_loss
from ..screening import SELECTION_MODES

# Private TRL methods this package overrides or calls, with the parameters it relies on (checked by a guard test).
TRL_PRIVATE_API = {
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_compute_loss": ("self", "model", "inputs"),
    "_generate_single_turn": ("self", "prompt_ids", "images", "multimodal_fields", "num_generations"),  # base, ReMax
    "_tokenize_prompts": ("self", "prompts"),  # base (prompts without images in a VLM batch)
    # base: its image keywords (`rollout.MULTIMODAL_KEYS`, guarded too) split per chunk of `batch_size` rows
    "_get_per_token_logps_and_entropies": ("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                           "batch_size"),
    "_prepare_inputs": ("self", "generation_batch"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "_get_train_sampler": ("self", "dataset"),
    "_generate": ("self", "prompts"),  # base (prompts without images under vLLM), ReMax
    "_save": ("self", "output_dir", "state_dict"),  # PPO (value model)
    "_load_from_checkpoint": ("self", "resume_from_checkpoint", "model"),  # base (VLM keys), PPO (value model)
    "_load_best_model": ("self",),  # base (VLM keys), PPO (value model)
    "_push_from_checkpoint": ("self", "checkpoint_folder"),  # PPO (value model)
    "_issue_warnings_after_load": ("self", "load_result"),  # base (tied weights), PPO (value model)
    "get_batch_samples": ("self", "epoch_iterator", "num_batches", "device"),  # base (max_staleness: read ahead)
    "_get_num_items_in_batch": ("self", "batch_samples", "device"),  # base (max_staleness)
}


logger = logging.get_logger(__name__)

#: values of `VariantConfig.sampling_logps_source`
SAMPLING_LOGPS_SOURCES = ("generate", "forward")
#: the logged share of KL-in-reward batches whose sampling log-probs took the forward pass although
#: `sampling_logps_source="generate"` (0.0: the generation's were used)
FORWARD_FALLBACK_METRIC = "sampling_logps/forward_fallback"


def _is_count(value) -> bool:
    """An integer >= 1 (a bool is an int to Python, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@functools.lru_cache(maxsize=None)
def numeric_field_types(config: type) -> dict[str, type]:
    """The fields of a config class declared as a plain `int` or `float` (not Optional) with a number as default: name
    -> the `numbers` class a value must belong to. Read from the classes' own annotations (strings for ours, classes
    for TRL's), not from `dataclasses.fields`: transformers' `HfArgumentParser` rewrites those fields' `type` in place
    (an `int | None` becomes `int`) once a command line was parsed."""
    kinds = {"int": numbers.Integral, "float": numbers.Real}
    declared = {}
    for klass in reversed(config.__mro__):  # a subclass's annotation overrides its base's
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            declared[name] = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    out = {}
    for f in dataclasses.fields(config):
        if declared.get(f.name) in kinds and isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            out[f.name] = kinds[declared[f.name]]
    return out


def is_coefficient(value) -> bool:
    """A number >= 0 (None, a bool or a string is not: it would fail raw at the first comparison)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


#: loss types whose per-token loss is PPO's clipped surrogate with token-level ratios: dual-clip can correct them
DUAL_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: loss types normalised by a token count (`num_items_in_batch`), DAPO's token-level loss and its relatives
TOKEN_LEVEL_LOSS_TYPES = ("dapo", "cispo", "vespo")
TOKEN_LEVEL_NORMALIZERS = ("optimizer_step", "generation_batch")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
#: the values TRL 1.16's GRPOTrainer branches on (anything else fails at the first step, or is never read)
SCALE_REWARDS = ("group", "batch", "none")  # and True / False, which GRPOConfig maps to "group" / "none"
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class _GroupOfOne(int):
    """`num_generations = 1` while `GRPOConfig.__post_init__` runs, for the configs whose estimator needs no group.

    TRL refuses `num_generations < 2` because GRPO's baseline is the group mean; REINFORCE++ and ReMax have no group.
    This integer is 1 for every check TRL makes (divisibility of the batch sizes) but never compares as less than
    anything, so the refusal passes; it is replaced by a plain 1 right after.
    """

    def __lt__(self, other):
        return False


@dataclass
class VariantConfig(GRPOConfig):
    r"""
    Fields shared by every config of this package, on top of [`~trl.GRPOConfig`].

    Parameters:
        kl_in_reward_coef (`float`, *optional*, defaults to `0.0`):
            Coefficient of the per-token KL(pi || ref) folded into the reward (classic RLHF; REINFORCE++ Eq. 4, PPO).
            Non-zero loads the reference model even when `beta == 0`. Independent of `beta`, which weights a KL term
            in the loss as in TRL.
        kl_in_reward_estimator (`str`, *optional*, defaults to `"k1"`):
            Estimator of the KL in the reward: `"k1"`, `"k2"` or `"k3"`.
        kl_loss_estimator (`str`, *optional*, defaults to `"k3"`):
            Estimator of the KL loss term weighted by `beta`: `"k3"` (TRL's), `"k2"` (REINFORCE++-baseline, Eq. 8) or
            `"k1"`.
        clip_ratio_c (`float` or `None`, *optional*, defaults to `None`):
            Dual-clip bound (> 1; Ye et al., arXiv 1912.09729; 3.0 in verl): for tokens with a negative advantage the
            PPO-clip loss is further capped at `-A * clip_ratio_c`, so a token whose ratio exploded cannot push an
            unbounded update. `None` disables it. Refused (one-line error) where the loss is not a token-level PPO-clip
            loss: `loss_type` other than `"grpo"`, `"bnpo"`, `"dr_grpo"`, `"dapo"` (e.g. `"cispo"`, `"vespo"`,
            `"sapo"`, `"luspo"`), `importance_sampling_level="sequence"`, and together with `delta`,
            `top_entropy_quantile < 1` or `off_policy_mask_threshold` (TRL reweights those tokens in ways the
            correction would have to mirror).
        token_level_normalizer (`str`, *optional*, defaults to `"optimizer_step"`):
            What divides a token-level loss (`loss_type` `"dapo"`, `"cispo"`, `"vespo"`, and every term this package
            reduces like it: KL, value and positive-example NLL losses) when `steps_per_generation !=
            gradient_accumulation_steps`. `"optimizer_step"`: the loss tokens of that optimizer step, summed over its
            accumulation micro-batches and the processes (verl's `token-mean`, DAPO arXiv 2503.14476 Eq. 12).
            `"generation_batch"`: TRL's `GRPOTrainer` normaliser, the tokens of the whole generation batch divided
            by the number of optimizer steps it feeds (every step gets the same average count). The two are equal
            when `steps_per_generation == gradient_accumulation_steps` (the default). `"optimizer_step"` needs
            `steps_per_generation * num_iterations` to be a multiple of `gradient_accumulation_steps` (otherwise an
            optimizer step would span generation batches not generated yet): other layouts are refused with a
            token-level loss.
        sampling_logps_source (`str`, *optional*, defaults to `"generate"`):
            Where the KL in the reward takes the sampling policy's log-probs `log pi_old(y_t)` from, when TRL has not
            computed them anyway (it does with vLLM's importance-sampling correction and with `steps_per_generation x
            num_iterations` not dividing `gradient_accumulation_steps`). `"generate"`: recorded during HF `generate`
            (the raw logits / `temperature`, before any logits processor or top-k/top-p warping), or vLLM's own
            log-probs; no extra forward pass. `"forward"`: one more no-grad forward pass of the policy over the batch,
            as TRL computes them. With HF `generate`, sampling or greedy decoding, both agree up to rounding (with or
            without PEFT, left padding of rotary models, KV cache, gradient checkpointing): the recording `generate`
            runs under the training forward's autocast (which PEFT's `generate` otherwise skips) and, for rotary
            models, with the forward's positions (counted from the first column; the same distribution). Measured on
            CPU on the toy model (`bench/sampling_logps_bound.py`, prompts padded by 0-6 words, 4-32 new tokens): at
            most 5.2e-6 per token in fp32; under bf16 autocast at most 0.072 per token and a step-0 KL of at most
            9.2e-4 with policy == reference (SmolLM2-135M: 0.28 and 1.3e-3), since bf16 kernels round `generate`'s
            KV-cached calls differently from the forward's full sequence (on a GPU too, not measured; the
            training/inference mismatch TRL accepts for vLLM's log-probs). Where the numbers cannot be the training
            forward's, the KL takes the forward pass automatically, on every process at once, logged as
            `sampling_logps/forward_fallback` (1.0 for such a batch): beam search, assisted / prompt-lookup decoding,
            `cast_lm_head_to_fp32` under mixed precision, and left-padded batches of a model without rotary positions
            (GPT-2, OPT, ...: `generate` numbers a padded row's positions from its first token, TRL's forwards, the
            reference's included, from the first column; sampling with the latter would change the distribution).
            vLLM's are its processed log-probs, renormalised after top-k/top-p when those are set. Without a KL in the
            reward it changes nothing.
        max_unscorable_batches (`int` or `None`, *optional*, defaults to `5`):
            Stop training with a one-line error after this many consecutive generation batches (the
            `generation_batch_size` completions of a rollout, gathered over all processes; each of DAPO's generation
            rounds counts as one) in which not one completion got a finite reward, holding together at least
            `min_unscorable_prompts` prompts: every reward function returned `None` or NaN for all of them, so every
            advantage is 0 and nothing can be learned (a broken reward function or a dataset column it cannot
            read). A run that ends without one scored completion fails too. Batches with some scorable completions
            reset the count and train as usual (the unscorable rows get advantage 0; `rewards/<name>/non_finite`
            counts them). `None` disables the check.
        min_unscorable_prompts (`int`, *optional*, defaults to `32`):
            The fewest consecutive prompts without a scored completion that `max_unscorable_batches` stops on.
            Unscorability comes mostly per prompt (TRL's `accuracy_reward` returns `None` for every completion of a
            prompt whose gold answer does not parse), so a healthy run whose generation batches hold one prompt
            each meets runs of unscorable batches by chance: with 30% of prompts unscorable, a run of 5 starts
            about once in 600 batches, one of 32 practically never (0.3^32 ~ 2e-17). A run that never scores
            still stops after max(`max_unscorable_batches` batches, this many prompts).
        prompt_selection (`str`, *optional*, defaults to `"none"`):
            Choose the prompts a step trains on while generating (`trl_ppo_variants.screening`): `"dynamic_sampling"`
            (DAPO's: generate whole groups, keep those with a reward spread, refill), `"speed"` (SPEED, arXiv
            2506.09016: screen each new prompt with a few completions, complete only those whose screening has a
            spread), `"greso"` (GRESO, arXiv 2506.02177: skip, before generating, prompts whose recent groups had no
            spread; then dynamic sampling) or `"speed+greso"`. Only for the estimators that use groups (GRPO, RLOO,
            REINFORCE++-baseline, DAPO, process GRPO; tuned by their `PromptSelectionFields`); the others refuse it
            with the reason.
        max_staleness (`int`, *optional*, defaults to `0`):
            How many optimizer steps old a generation batch may be when it trains (TRL's `AsyncGRPOConfig` name).
            `0`: synchronous generation, today's code path. `k >= 1`: while a step trains, the vLLM server already
            generates the batches of the next `k` steps with the current policy (`trl_ppo_variants.async_rollout`);
            an answer older than `k` steps is generated again, never trained on. Needs `use_vllm=True` and
            `vllm_mode="server"`. The sampling policy's log-probs (the server's) feed TRL's
            `vllm_importance_sampling_correction`, which then weights the clipped objective by pi_old / pi_sampling
            (the decoupled objective of AReaL, arXiv 2505.24298); a checkpoint drops the queued batches, so that a
            resumed run generates what the uninterrupted run generated.

    `num_generations` must be >= 2 except for the estimators that need no group (plain REINFORCE++ and ReMax accept
    1). `multi_objective_aggregation="normalize_then_sum"` (GDPO) is accepted by the configs whose advantage is
    GRPO's (DAPO, TTRL) and refused by the others.
    """

    kl_in_reward_coef: float = field(
        default=0.0,
        metadata={"help": "Coefficient of the per-token KL(pi || ref) folded into the reward; loads the reference."},
    )
    kl_in_reward_estimator: str = field(
        default="k1", metadata={"help": "KL estimator in the reward: 'k1', 'k2' or 'k3'."}
    )
    kl_loss_estimator: str = field(
        default="k3", metadata={"help": "KL estimator of the loss term weighted by `beta`: 'k1', 'k2' or 'k3'."}
    )
    clip_ratio_c: float | None = field(
        default=None,
        metadata={"help": "Dual-clip bound (> 1) for negative advantages (PPO-clip losses only); None disables it."},
    )
    token_level_normalizer: str = field(
        default="optimizer_step",
        metadata={"help": "Token-level losses: divide each optimizer step by its own loss tokens ('optimizer_step', "
                          "DAPO Eq. 12) or by the generation batch's average per step ('generation_batch', TRL's)."},
    )

    max_unscorable_batches: int | None = field(
        default=5,
        metadata={"help": "Stop with an error after this many consecutive generation batches in which no completion "
                          "got a finite reward from any reward function, holding at least `min_unscorable_prompts` "
                          "prompts (None: never)."},
    )
    min_unscorable_prompts: int = field(
        default=32,
        metadata={"help": "The fewest consecutive prompts without a scored completion that `max_unscorable_batches` "
                          "stops on (a run of one-prompt batches with some unscorable prompts is not stopped by "
                          "chance)."},
    )

    sampling_logps_source: str = field(
        default="generate",
        metadata={
            "help": "Sampling log-probs for the KL in the reward: 'generate' (recorded while generating, or vLLM's; "
            "no extra forward pass; the training forward's up to rounding: on CPU 5.2e-6 per token in fp32, up to "
            "0.072 under bf16 autocast (toy model; 0.28 on SmolLM2-135M), as vLLM's differ; beam search, assisted "
            "decoding and left-padded batches of models without rotary positions fall back to the forward "
            "automatically, logged as sampling_logps/forward_fallback) or 'forward' (one more no-grad policy forward "
            "pass, TRL's numbers)."
        },
    )

    prompt_selection: str = field(
        default="none",
        metadata={"help": "Choose prompts while generating: 'none', 'dynamic_sampling' (DAPO), 'speed' (SPEED "
                          "screening, arXiv 2506.09016), 'greso' (GRESO skipping, arXiv 2506.02177) or 'speed+greso'."},
    )

    max_staleness: int = field(
        default=0,
        metadata={"help": "How many optimizer steps old a generation batch may be (0: synchronous generation; k >= 1: "
                          "the vLLM server generates the next k batches while a step trains; needs use_vllm=True and "
                          "vllm_mode='server')."},
    )

    #: `multi_objective_aggregation` values this config's estimator gives a meaning to (GRPO-advantage configs add
    #: "normalize_then_sum")
    multi_objective_aggregations: ClassVar[tuple[str, ...]] = ("sum_then_normalize",)

    def min_num_generations(self) -> tuple[int, str]:
        """The smallest `num_generations` this config's estimator works with, and why (for the error message)."""
        return 2, "a group baseline needs siblings"

    def prompt_selection_refused(self) -> str | None:
        """Why this config cannot select prompts (`prompt_selection`), or None when it can."""
        return "this estimator has no group of completions whose spread could be screened"

    def uses_token_level_normalizer(self) -> bool:
        """Whether a term of the loss is normalised by a token count (`token_level_normalizer` applies)."""
        return self.loss_type in TOKEN_LEVEL_LOSS_TYPES

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None:
            # a subclass's own checks run before it calls ours: its numbers are checked first, so that `None` (a
            # YAML `~`, a forgotten value) is a one-line error naming the field, not a raw TypeError of a comparison
            @functools.wraps(own)
            def post_init(self):
                self.check_numeric_fields()
                own(self)

            cls.__post_init__ = post_init

    def check_numeric_fields(self) -> None:
        """Every field declared as a plain `int` / `float` holds a number (not None, a bool or a string)."""
        for name, kind in numeric_field_types(type(self)).items():
            value = getattr(self, name)
            check(isinstance(value, kind) and not isinstance(value, bool), name,
                  "an integer" if kind is numbers.Integral else "a number", value)

    def __post_init__(self):
        self.check_numeric_fields()
        # Our checks run before GRPOConfig's so that the user gets the one-line message naming the field (GRPOConfig
        # rejects num_generations < 2 with a message that does not name it).
        least, why = self.min_num_generations()
        check(isinstance(self.num_generations, int) and self.num_generations >= least, "num_generations",
              f"an integer >= {least} ({why})", self.num_generations)
        check(is_coefficient(self.kl_in_reward_coef), "kl_in_reward_coef", "a number >= 0", self.kl_in_reward_coef)
        check(is_coefficient(self.beta), "beta", "a number >= 0", self.beta)
        self._check_trl_choices()
        check(self.kl_in_reward_estimator in KL_KINDS, "kl_in_reward_estimator", f"one of {KL_KINDS}",
              self.kl_in_reward_estimator)
        check(self.kl_loss_estimator in KL_KINDS, "kl_loss_estimator", f"one of {KL_KINDS}", self.kl_loss_estimator)
        check(self.sampling_logps_source in SAMPLING_LOGPS_SOURCES, "sampling_logps_source",
              f"one of {SAMPLING_LOGPS_SOURCES}", self.sampling_logps_source)
        check(self.temperature > 0, "temperature", "a number > 0", self.temperature)
        returned = (self.generation_kwargs or {}).get("num_return_sequences") or 1
        check(returned == 1, "generation_kwargs", "no num_return_sequences above 1 (TRL's generation keeps one "
              "completion per prompt row; num_generations sets the group size)", self.generation_kwargs)
        check(self.epsilon >= 0, "epsilon", "a number >= 0", self.epsilon)
        if self.epsilon_high is not None:
            check(self.epsilon_high >= 0, "epsilon_high", "a number >= 0", self.epsilon_high)
        allowed = self.multi_objective_aggregations
        why = "" if allowed == AGGREGATIONS else (" ('normalize_then_sum' normalises each reward function within its "
                                                  "group for GRPO's advantage; this estimator takes the weighted sum "
                                                  "of the rewards)")
        check(self.multi_objective_aggregation in allowed, "multi_objective_aggregation", f"one of {allowed}{why}",
              self.multi_objective_aggregation)
        self._check_dual_clip()
        check(self.token_level_normalizer in TOKEN_LEVEL_NORMALIZERS, "token_level_normalizer",
              f"one of {TOKEN_LEVEL_NORMALIZERS}", self.token_level_normalizer)
        check(self.max_unscorable_batches is None or _is_count(self.max_unscorable_batches), "max_unscorable_batches",
              "an integer >= 1 or None", self.max_unscorable_batches)
        check(_is_count(self.min_unscorable_prompts), "min_unscorable_prompts", "an integer >= 1",
              self.min_unscorable_prompts)
        check(self.prompt_selection in SELECTION_MODES, "prompt_selection", f"one of {SELECTION_MODES}",
              self.prompt_selection)
        if self.prompt_selection != "none":
            refused = self.prompt_selection_refused()
            check(refused is None, "prompt_selection", f"'none' for {type(self).__name__} ({refused})",
                  self.prompt_selection)
        # an integer already (`check_numeric_fields`)
        check(self.max_staleness >= 0, "max_staleness", "an integer >= 0", self.max_staleness)
        if self.max_staleness:
            check(self.use_vllm and self.vllm_mode == "server", "max_staleness",
                  "0 unless use_vllm=True and vllm_mode='server' (the overlapped generation runs on the vLLM server)",
                  self.max_staleness)
        one = self.num_generations == 1
        if one:
            self.num_generations = _GroupOfOne(1)
        try:
            guards.post_init(self, super().__post_init__)  # TRL's checks (batch errors restated in one line) + shared
        finally:
            if one:
                self.num_generations = 1
        if self.token_level_normalizer == "optimizer_step" and self.uses_token_level_normalizer():
            block = self.steps_per_generation * self.num_iterations
            check(block % self.gradient_accumulation_steps == 0, "steps_per_generation",
                  f"a value whose product with num_iterations={self.num_iterations} is a multiple of "
                  f"gradient_accumulation_steps={self.gradient_accumulation_steps} with token_level_normalizer="
                  "'optimizer_step' (or token_level_normalizer='generation_batch', TRL's normaliser)",
                  self.steps_per_generation)

    def _check_trl_choices(self):
        """TRL's own fields whose values TRL checks only when it reads them (at the first step, or never)."""
        check(self.loss_type in LOSS_TYPES, "loss_type", f"one of {LOSS_TYPES}", self.loss_type)
        check(isinstance(self.scale_rewards, bool) or self.scale_rewards in SCALE_REWARDS, "scale_rewards",
              f"one of {SCALE_REWARDS}, True or False", self.scale_rewards)
        check(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
              f"one of {IMPORTANCE_SAMPLING_LEVELS}", self.importance_sampling_level)
        check(self.vllm_importance_sampling_mode in VLLM_IMPORTANCE_SAMPLING_MODES, "vllm_importance_sampling_mode",
              f"one of {VLLM_IMPORTANCE_SAMPLING_MODES}", self.vllm_importance_sampling_mode)
        # a number already (`check_numeric_fields`)
        check(0.0 <= self.top_entropy_quantile <= 1.0, "top_entropy_quantile", "a number in [0, 1]",
              self.top_entropy_quantile)

    def _check_dual_clip(self):
        if self.clip_ratio_c is None:
            return
        check(self.clip_ratio_c > 1.0, "clip_ratio_c", "a number > 1 or None", self.clip_ratio_c)
        check(self.loss_type in DUAL_CLIP_LOSS_TYPES, "loss_type",
              f"one of {DUAL_CLIP_LOSS_TYPES} with clip_ratio_c (the token-level PPO-clip losses)", self.loss_type)
        check(self.importance_sampling_level == "token", "importance_sampling_level",
              "'token' with clip_ratio_c (dual-clip is per token)", self.importance_sampling_level)
        check(self.delta is None, "delta", "None with clip_ratio_c (both cap the ratio; pick one)", self.delta)
        check(self.top_entropy_quantile == 1.0, "top_entropy_quantile", "1.0 with clip_ratio_c",
              self.top_entropy_quantile)
        check(self.off_policy_mask_threshold is None, "off_policy_mask_threshold", "None with clip_ratio_c",
              self.off_policy_mask_threshold)


#: the parameters of TRL's `GRPOTrainer.__init__` after `self`, in its order (model, reward_funcs, args,
#: train_dataset, ..., environment_factory): every trainer takes them, by name or by position
TRL_INIT_PARAMETERS = tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]


def accepts_trl_positional(init):
    """Wrap a trainer's `__init__(self, model, reward_funcs=None, args=None, **kwargs)` so that it takes TRL's later
    parameters by position too (`Trainer(model, rewards, args, train_dataset)`, as `GRPOTrainer` does), handing them
    on by name: the trainers' own code (and their refusals) only ever see keywords."""

    @functools.wraps(init)
    def wrapper(self, *positional, **kwargs):
        if len(positional) > 3:
            names = TRL_INIT_PARAMETERS
            if len(positional) > len(names):
                raise TypeError(f"{type(self).__name__}() takes at most {len(names)} positional arguments "
                                f"({len(positional)} given)")
            for name, value in zip(names[3:], positional[3:]):
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}() got multiple values for argument '{name}'")
                kwargs[name] = value
            positional = positional[:3]
        return init(self, *positional, **kwargs)

    wrapper.accepts_trl_positional = True
    return wrapper


def _join_forward_chunks(parts: list[tuple]) -> tuple:
    """`(logps, entropies, aux_loss)` of a batch from those of its chunks of rows, joined as TRL's
    `_get_per_token_logps_and_entropies` joins its own: rows concatenated, the MoE aux loss averaged over chunks."""
    logps, entropies, aux = zip(*parts)
    return (torch.cat(logps, dim=0), None if entropies[0] is None else torch.cat(entropies, dim=0),
            None if aux[0] is None else torch.stack(aux).mean())


def no_image_as_empty_list(images: list) -> list:
    """TRL's per-prompt image lists with `None` (a prompt without images) as `[]`, which its processor call takes."""
    return [prompt_images if prompt_images is not None else [] for prompt_images in images]


class VariantTrainer(GRPOTrainer):
    """Base class: `GRPOTrainer` with the advantage estimator (and optionally the rows) replaced.

    Subclasses override `compute_advantages` and, when they drop rows, `select_rows`. Every trainer's constructor takes
    `GRPOTrainer.__init__`'s arguments with their meaning (`reward_funcs` may be None when an `environment_factory`
    owns the reward), by name or by position (`accepts_trl_positional`, applied to every subclass's `__init__`).
    """

    _tag_names = ["trl", "trl-ppo-variants"]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "accepts_trl_positional", False):
            cls.__init__ = accepts_trl_positional(init)

    @accepts_trl_positional
    def __init__(self, model, reward_funcs=None, args=None, **kwargs):
        self._captured_rewards_per_func = None
        self._capture_logps = False
        self._captured_logps = None
        self._loss_logps = None
        #: (N, F) per-function rewards of the rows whose advantages `compute_advantages` is computing
        self.advantage_rewards_per_func = None
        self._counted_buffer = None
        self._step_counts = None
        #: completions and generation batches of this run's training, and how many had no finite reward
        self.scoring_tally = {"batches": 0, "unscorable_batches": 0, "consecutive": 0, "consecutive_prompts": 0,
                              "completions": 0, "unscorable_completions": 0}
        self._unscorable_prompts = set()  # the prompts counted in "consecutive_prompts" (`track_scorable`)
        # the KL coefficients, read once: TRL's `beta` is then set from them only ("TRL's beta" below)
        self.loss_beta, self.kl_in_reward_coef = self.kl_coefficients(args)
        self.kl_loss_estimator = getattr(args, "kl_loss_estimator", "k3")
        self.kl_in_reward_estimator = getattr(args, "kl_in_reward_estimator", "k1")
        self.sampling_logps_source = getattr(args, "sampling_logps_source", "generate")
        self.needs_reference = self.loss_beta != 0.0 or self.kl_in_reward_coef != 0.0
        if getattr(args, "max_staleness", 0):
            refused = self.async_refused(kwargs)
            check(refused is None, "max_staleness", f"0 for {type(self).__name__} ({refused})", args.max_staleness)
        # the sync's image cache; vLLM's CPU build: dtype, sync (vllm_cpu.py); server mode: vllm_server.py
        with vllm_cpu.colocate_engine(args), vllm_server.server_generation(args), self._loading_reference(args):
            super().__init__(model, reward_funcs, args=args, **kwargs)
        self.use_reference_beta()
        #: whether the policy's logits are unchanged by a shift of a row's positions (`unusable_sampling_logps`)
        self.relative_positions = generation.relative_positions(self.model)
        #: whether the policy derives its positions from its image inputs (M-RoPE): a recording `generate` is then
        #: given none (`generation.computes_own_positions`)
        self.own_positions = generation.computes_own_positions(self.model)
        guards.check_model_limits(self)
        if getattr(self.args, "max_staleness", 0):
            self._async = async_rollout.AsyncRollout(self)

    #: the config class this trainer takes (a subclass sets its own)
    config_class = VariantConfig
    #: the overlapped generation (`max_staleness >= 1`, set at the end of `__init__`), None for synchronous generation
    _async: async_rollout.AsyncRollout | None = None

    @classmethod
    def resolve_args(cls, args):
        """`args`, or the config's defaults when None; anything but this trainer's config class is refused."""
        if args is None:
            return cls.config_class(output_dir=f"{cls._tag_names[-1]}-output")
        if not isinstance(args, cls.config_class):
            raise TypeError(f"args: expected a {cls.config_class.__name__}, got {type(args).__name__}")
        return args

    # -------------------------------------------------------------------------------------------- TRL's beta
    # Every write of TRL's `beta` is in this section. `GRPOTrainer`'s `beta` has two roles: non-zero, it loads a
    # reference model (its `__init__` reads `args.beta`; with PEFT, a "ref" adapter) whose log-probs are then computed
    # at generation (`self.beta` in `_generate_and_score_completions`), and it weights TRL's k3 KL term in the loss
    # (`self.beta` in `_compute_loss`). Our estimators need the two apart: the reference without a loss term (the KL
    # in the reward, `kl_in_reward_coef`: REINFORCE++, PPO, ReMax, TTRL, RLOO's `beta`), or a loss term with another
    # estimator than k3 (`kl_loss_estimator`: k2 for REINFORCE++-baseline), which `_compute_loss` adds itself. So
    # TRL's `beta` is 1.0 exactly when a reference is needed (`reference_beta`), in `__init__`, at generation and
    # between steps, and only inside `_compute_loss` the coefficient of TRL's own k3 term (`_trl_loss_beta`).
    # The config's `beta` is never changed: it is the user's (saved with checkpoints, read by the model card).
    def kl_coefficients(self, args) -> tuple[float, float]:
        """`(loss, reward)`: the coefficients of the KL term in the loss and of the KL in the reward, read from `args`
        once, at construction. The config's `beta` weights the loss term (TRL's meaning) and `kl_in_reward_coef` the
        KL in the reward; a trainer whose `beta` means something else says so here (RLOO: the reward's)."""
        if args is None:
            return 0.0, 0.0
        return float(args.beta), float(getattr(args, "kl_in_reward_coef", 0.0) or 0.0)

    @property
    def reference_beta(self) -> float:
        """TRL's `beta` outside the loss: 1.0 when a reference is needed (a KL in the loss or in the reward), else 0.0
        (TRL then neither loads a reference nor computes its log-probs)."""
        return 1.0 if self.needs_reference else 0.0

    @property
    def own_kl_loss(self) -> bool:
        """Whether the KL term of the loss is ours (`kl_loss_estimator` other than TRL's k3), added by `_compute_loss`
        in place of TRL's."""
        return self.loss_beta != 0.0 and self.kl_loss_estimator != "k3"

    @contextlib.contextmanager
    def _loading_reference(self, args):
        """Around `GRPOTrainer.__init__`: `args.beta` is `reference_beta`, so that TRL loads a reference model exactly
        when one is needed; the user's `beta` is put back after."""
        if args is None:
            yield
            return
        beta, args.beta = args.beta, self.reference_beta
        try:
            yield
        finally:
            args.beta = beta

    def use_reference_beta(self) -> None:
        """Set TRL's `beta` to `reference_beta`: TRL computes the reference log-probs of a rollout iff it is non-zero.
        Every generation batch sets it (prompt selections' rounds too), in case anything changed it in between."""
        self.beta = self.reference_beta

    @contextlib.contextmanager
    def _trl_loss_beta(self):
        """Inside TRL's `_compute_loss`, which adds `beta * k3`: `beta` is the loss coefficient, or 0 when our own KL
        estimator replaces TRL's (`own_kl_loss`); `reference_beta` again after."""
        self.beta = 0.0 if self.own_kl_loss else self.loss_beta
        try:
            yield
        finally:
            self.use_reference_beta()

    # -------------------------------------------------------------------------------------------- hooks
    def compute_advantages(self, rewards: torch.Tensor, batch: dict, group_size: int) -> torch.Tensor:
        """Advantages for the global batch: (N,) or (N, T). `rewards` is (N,) (NaN: unscorable), `batch` the
        `global_batch_keys` entries of the global rollout (only built when `needs_global_batch` is True or a KL is in
        the reward, else None)."""
        raise NotImplementedError

    #: set by trainers that read the policy log-probs (with grad) of the loss's forward pass (`_loss_logps`)
    captures_policy_logps = False
    #: set by estimators that need per-token tensors of the whole batch (masks, KL, values) to compute advantages
    needs_global_batch = False
    #: the rollout entries gathered into that batch (when present); ids and log-probs never are (memory)
    global_batch_keys = ("completion_mask", "tool_mask", "kl_in_reward", "old_values")

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card would name GRPO and its paper; ours names this algorithm (see `model_card.py`)."""
        from ..model_card import create_model_card

        create_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def extra_state(self) -> dict:
        """State of a subclass that belongs to the run, the same on every process (e.g. a refill sampler's
        position): saved with every checkpoint and given back to `load_extra_state` on every process of the resumed
        run, whatever their number. Values: tensors and Python containers."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Restore what `extra_state` returned (an empty dict for checkpoints written without it)."""

    # -------------------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        if self._async is not None:  # what a resumed run cannot regenerate is not trained on
            self._async.drop()
        # atomic (completion marker) and complete (generation buffer, `_step`, extra state): see checkpointing.py
        checkpointing.save_checkpoint(self, model, trial, super()._save_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            checkpointing.load_trainer_state(self, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # transformers loads the saved weights raw: those saved in another format than the model's (a VLM's names, an
        # MoE's experts) would keep their values (checkpointing.load_model_weights)
        if self.is_fsdp_enabled or not checkpointing.load_model_weights(
                self, model if model is not None else self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not checkpointing.load_model_weights(
                self, self.model, best):
            super()._load_best_model()
        else:
            logger.info(f"Loaded the best model from {best} (score: {self.state.best_metric}).")

    def _issue_warnings_after_load(self, load_result):
        # a tied weight (Gemma3's lm_head) is not saved, so it is "missing" from every checkpoint: not worth a warning
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        if tied and hasattr(load_result, "_replace"):
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

    def _get_train_sampler(self, dataset=None):
        # TRL's shuffle of epoch e depends on the passes already made: a resumed run would replay epoch 0's order
        return checkpointing.resumable_sampler(super()._get_train_sampler(dataset), self)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # True must skip a checkpoint left half-written by a killed run (transformers picks the highest number)
        resume_from_checkpoint = checkpointing.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if self._async is not None:
            self._async.start()
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._async is not None:
                self._async.drop()
        tally = self.scoring_tally
        if (self.args.max_unscorable_batches is not None and tally["batches"]
                and tally["unscorable_batches"] == tally["batches"]):  # the run learned nothing at all
            raise RuntimeError(self._unscorable_message(f"any of the run's {tally['batches']} generation batches"))
        return output

    # -------------------------------------------------------------------------------------------- unscorable rewards
    def track_scorable(self, rewards_per_func: torch.Tensor, group_size: int, prompts=None) -> None:
        """Count a training generation batch's completions that no reward function scored (every entry of their row
        NaN: advantage 0, nothing learned from them) into `scoring_tally`; after `max_unscorable_batches`
        consecutive batches without one scored completion that hold `min_unscorable_prompts` prompts or more, stop
        with a one-line error. `rewards_per_func` is the gathered (N, F) table, the same on every process, so every
        process stops at the same batch.

        A batch's prompts are its rows / `group_size` (whole groups), or `prompts`, the identities (hashable, unique
        within the run) of the prompts whose rows it holds when its row blocks are parts of groups (SPEED's
        screenings and completions): a prompt counts once in a run of unscorable batches, its screening and its
        completion being one prompt."""
        if not self.model.training:
            return
        columns = self.scorable_columns()
        if columns:
            rewards_per_func = rewards_per_func[:, columns]
        total = int(rewards_per_func.shape[0])
        unscored = int(torch.isnan(rewards_per_func).all(dim=1).sum()) if total else 0
        tally = self.scoring_tally
        tally["batches"] += 1
        tally["completions"] += total
        tally["unscorable_completions"] += unscored
        if unscored < total or total == 0:
            tally["consecutive"] = tally["consecutive_prompts"] = 0
            self._unscorable_prompts.clear()
            return
        tally["unscorable_batches"] += 1
        tally["consecutive"] += 1
        if prompts is None:
            tally["consecutive_prompts"] += -(-total // max(group_size, 1))
        else:
            new = set(prompts) - self._unscorable_prompts
            self._unscorable_prompts |= new
            tally["consecutive_prompts"] += len(new)
        limit = self.args.max_unscorable_batches
        if limit is not None and tally["consecutive"] >= limit and (
                tally["consecutive_prompts"] >= self.args.min_unscorable_prompts):
            raise RuntimeError(self._unscorable_message(
                f"{tally['consecutive']} consecutive generation batches ({tally['consecutive_prompts']} prompts)"))

    def scorable_columns(self) -> list[int] | None:
        """The reward columns whose finite values make a completion scorable (None: all); a trainer's own shaping
        term, which scores every completion alike, is left out (DAPO's overlong penalty)."""
        return None

    def _unscorable_message(self, where: str) -> str:
        names = ", ".join(f"'{n}'" for n in self.reward_func_names)
        return (f"no completion got a finite reward in {where} (up to global step {self.state.global_step}): "
                f"the reward functions ({names}) returned None or NaN for every completion, so nothing was learned; "
                "check them and the dataset columns they read (max_unscorable_batches="
                f"{self.args.max_unscorable_batches} and min_unscorable_prompts={self.args.min_unscorable_prompts} "
                "set this limit, max_unscorable_batches=None disables it)")

    def select_rows(self, rewards_per_func: torch.Tensor, group_size: int, inputs: list) -> torch.Tensor | None:
        """Global row indices to keep (the same on every rank), or None to keep every row."""
        return None

    def kept_group_size(self, group_size: int) -> int:
        """The group size after `select_rows` (TTRL trains on n_train of n_votes rows per prompt)."""
        return group_size

    def grpo_group_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """GRPO's advantage (N,) of the rows being estimated, as `GRPOTrainer` computes it for
        `multi_objective_aggregation`: the weighted sum `rewards` normalised with `scale_rewards`
        ("sum_then_normalize"), or each function's reward normalised within its group, summed and normalised over the
        batch (`advantages.normalize_then_sum_advantages`, GDPO), from `advantage_rewards_per_func`."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            per_func = self.advantage_rewards_per_func
            if per_func is None or per_func.shape[0] != rewards.shape[0]:
                raise RuntimeError("normalize_then_sum needs `advantage_rewards_per_func` of the same rows")
            return normalize_then_sum_advantages(per_func, self.reward_column_weights().to(per_func.device),
                                                 group_size)
        return grpo_advantages(rewards, group_size, scale=self.scale_rewards)
    # -------------------------------------------------------------------------------------------- generation
    def generation_logits_processors(self) -> list:
        """Logits processors to add to the next HF `generate` call of `_generate_single_turn` (ReMax: its greedy
        rows); [] by default. A non-empty list makes any other generation backend an error."""
        return []

    def records_sampling_logps(self) -> bool:
        """Whether HF `generate` records the sampling log-probs (only the KL in the reward reads them)."""
        return self.kl_in_reward_coef != 0.0 and self.sampling_logps_source == "generate"

    def unrecordable_reason(self) -> str | None:
        """Why HF `generate` cannot record log-probs equal to the training forward's in this configuration (a
        phrase for the fallback warning), or None: a decoding mode other than sampling or greedy decoding
        (`generation.unrecordable_reason`), or `cast_lm_head_to_fp32` under mixed precision (the training forward
        runs its LM head in fp32 outside autocast, `generate` inside it)."""
        reason = generation.unrecordable_reason(getattr(self, "generation_config", None))
        if reason is None and self.args.cast_lm_head_to_fp32 and self.accelerator.native_amp:
            reason = "cast_lm_head_to_fp32 under mixed precision"
        return reason

    def _tokenize_prompts(self, prompts):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if images is not None and not self.use_vllm:
            # TRL marks a prompt without images `None`, which its own processor call for the forward's image inputs
            # refuses ("only a single or a list of entries") once a batch mixes prompts with and without images: a
            # batch of several prompts (DAPO's rounds, SPEED, GRESO, any batch of TRL's too) hits it where one prompt a
            # batch does not. The processor takes an empty list. vLLM reads `None` as "no image" (an empty list fails
            # there): left as it is for generation, and made a list after it (`_generate`).
            images = no_image_as_empty_list(images)
        self._unexpanded_prompts = {}
        if images is not None and self.use_vllm and self.vllm_mode == "colocate":  # `vllm_cpu.unexpanded_prompt_ids`
            if self.environment_factories is not None:
                tools = [self._env_tools[name] or None for name in self._batch_environments]
            else:
                tools = [self.tools or None] * len(prompts)
            self._unexpanded_prompts = vllm_cpu.unexpanded_prompt_ids(
                self.processing_class, prompts, prompt_ids, images, tools, self.chat_template,
                self.chat_template_kwargs)
        return prompt_ids, images, multimodal_fields

    def engine_prompt_ids(self, prompt_ids: list) -> list:
        """The prompts of the batch being generated as the colocate vLLM engine takes them: its images' placeholders
        unexpanded (`vllm_cpu.engine_prompt_ids`); as they are without images or in server mode."""
        return vllm_cpu.engine_prompt_ids(prompt_ids, getattr(self, "_unexpanded_prompts", {}))

    def _generate(self, prompts):
        *generated, images, tool_images = super()._generate(prompts)
        if images is not None and self.use_vllm:  # the forward's processor call, next: see `_tokenize_prompts`
            images = no_image_as_empty_list(images)
        return (*generated, images, tool_images)

    # -------------------------------------------------------------------------------------------- overlapped generation
    def async_refused(self, kwargs: dict) -> str | None:
        """Why this trainer, given its constructor's keyword arguments, cannot generate ahead of training
        (`max_staleness >= 1`), or None: multi-turn generation (tools, environments, a `rollout_func`) makes requests
        that are not known before the batch trains."""
        if any(kwargs.get(name) for name in ("tools", "environment_factory", "rollout_func")):
            return "tools, environments and rollout_func generate in several turns, which are not prefetched"
        return None

    def prefetches_generation(self) -> bool:
        """Whether the next generation batch's requests are queued ahead now (`max_staleness >= 1`): a step whose first
        request cannot be known a step ahead (GRESO's skipping) makes each request when it comes, with the current
        policy."""
        return True

    def prefetch_rows(self, rows: list, step: int) -> tuple[list, int]:
        """The rows (this process's) whose generation TRL will request first for the generation batch `rows` that
        micro-step `step` generates, and the completions a prompt of that request: the batch itself, or a prompt
        selection's first round planned ahead (`screening.PromptSelection.reserve`). Every process, in order."""
        return rows, self.num_generations

    def async_requests(self, prompt_ids: list, num_generations: int) -> list[tuple[list, int, dict]]:
        """The server requests TRL's generation of a batch makes, as (this process's prompt ids, completions a prompt,
        sampling parameters changed) triples, in order: queued together, so generated with one policy version."""
        return [(prompt_ids, num_generations, {})]

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self._async is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples = self._async.batch_samples(epoch_iterator, num_batches)
        return batch_samples, self._get_num_items_in_batch(batch_samples, device)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._async is None:
            return self._generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self._async.before_generation()
        result = self._generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self._async.after_generation()
        return result

    def _generate_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Every change to TRL's HF `generate` call goes through one wrapper (generation.patched_generate): ReMax's
        # greedy rows and the sampling log-probs that spare the KL in the reward a forward pass.
        processors = self.generation_logits_processors()
        hf_generate = not self.use_vllm and not self.use_transformers_continuous_batching
        record = hf_generate and self.records_sampling_logps() and self.unrecordable_reason() is None
        if processors and not hf_generate:
            raise RuntimeError(f"{type(self).__name__}: logits processors need HF `generate` (not vLLM or "
                               "transformers continuous batching)")
        if not (processors or record):  # vLLM returns its own log-probs; continuous batching none (forward)
            if self.use_vllm:  # (TRL's vLLM path reads the prompt ids for the engine only)
                prompt_ids = self.engine_prompt_ids(prompt_ids)
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        target = self.accelerator.unwrap_model(self.model_wrapped)
        temperature = self.temperature if record else None
        # A recording `generate` computes what the training forward computes, so that the recorded numbers are that
        # forward's: under its autocast (a prepared plain model's forward is wrapped in it already, a no-op then;
        # PEFT's `generate` runs the base model's forward outside it: fp32 decoding under bf16 mixed precision) and,
        # for rotary models, with its positions (counted from the first column: the same distribution, the
        # forward's rounding). Only when recording: the tokens are then sampled with the numerics the loss and the
        # KL see; without a recording the sampling stays exactly TRL's (`sampling_logps_source="forward"` keeps it
        # so with a KL too), which is why PEFT users who do not record keep TRL's fp32 decoding.
        autocast = self.accelerator.autocast() if record else contextlib.nullcontext()
        column_positions = record and self.relative_positions and not self.own_positions
        with autocast, generation.patched_generate(target, processors, temperature, column_positions) as calls:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if processors and not calls:
            raise RuntimeError(
                f"{type(self).__name__}: TRL's _generate_single_turn no longer calls model.generate, so the logits "
                f"processors {[type(p).__name__ for p in processors]} were not applied. This TRL version is not "
                "supported."
            )
        if record:
            logprobs = generation.rows_to_lists(calls[0] if len(calls) == 1 else None, completion_ids)
        return completion_ids, logprobs

    # -------------------------------------------------------------------------------------------- the seam
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        guard = guards.RewardGuard(self, prompts)  # a raising/wrong-length function: one-line error on every rank
        funcs, self.reward_funcs = self.reward_funcs, guard.wrap(self.reward_funcs)
        try:
            with guard.quiet_trl_none_warning():  # TRL's "all returned None" is untrue when a function failed
                rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = funcs
        guard.raise_if_failed()
        rewards_per_func = guards.contain_non_finite(self, rewards_per_func)  # +-inf -> NaN (advantage 0), counted
        self._captured_rewards_per_func = rewards_per_func
        return rewards_per_func

    def reward_column_weights(self) -> torch.Tensor:
        """(F,) weights of the columns of the captured reward table: TRL's `reward_weights`, one per reward function
        (a trainer that appends a column of its own to the table, DAPO's overlong shaping, appends its weight)."""
        return self.reward_weights

    def total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Weighted sum over reward functions, NaN where every function returned None (as TRL does). (N, F) -> (N,)."""
        weights = self.reward_column_weights().to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
        return rewards

    def _generate_and_score_completions(self, inputs):
        self.use_reference_beta()
        output = self.score_rollout(inputs)
        return self._replace_advantages(output, inputs)

    def score_rollout(self, inputs: list, prompts=None) -> dict:
        """TRL's generation and scoring of the rows `inputs` (groups of `num_generations`), counted by
        `track_scorable` (`prompts`: see there). Every generation batch of every trainer passes here, each round of
        a prompt selection too, so the unscorable-run guard holds whether or not a trainer replaces TRL's
        advantages."""
        output = super()._generate_and_score_completions(inputs)
        self.track_scorable(self._captured_rewards_per_func, self.num_generations, prompts)
        if self._async is not None and "importance_sampling_ratio" in output:
            counts = async_rollout.corrected_share(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                                   output["importance_sampling_ratio"], rollout.loss_mask(output))
            counts = self.accelerator.reduce(torch.stack(counts), reduction="sum")
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][async_rollout.CORRECTED_SHARE].append((counts[0] / counts[1].clamp(min=1)).item())
        return output

    def _compute_loss(self, model, inputs):
        own_kl = self.own_kl_loss
        dual_clip = self.args.clip_ratio_c is not None
        self._capture_logps = own_kl or dual_clip or self.captures_policy_logps
        try:
            with self._trl_loss_beta():
                loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_logps = False
        logps, self._captured_logps = self._captured_logps, None
        self._loss_logps = logps if self.captures_policy_logps else None
        if own_kl:
            loss = loss + self.loss_beta * self._kl_loss_term(inputs, logps)
        if dual_clip:
            loss = loss + self._dual_clip_correction(inputs, logps)
        return loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        images = {key: kwargs.pop(key) for key in rollout.MULTIMODAL_KEYS if key in kwargs}
        if args or not rollout.has_image_less_chunk(images, input_ids.shape[0], kwargs.get("batch_size")):
            result = super()._get_per_token_logps_and_entropies(  # TRL's slicing: every chunk has an image
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs, **images
            )
        else:  # TRL's chunks, and a micro-batch, each with its own rows' images: none for rows without one
            chunks = rollout.image_chunks(images, input_ids.shape[0], kwargs.pop("batch_size", None))
            result = _join_forward_chunks([super(VariantTrainer, self)._get_per_token_logps_and_entropies(
                model, input_ids[start:end], attention_mask[start:end], logits_to_keep, **kwargs, **chunk_images)
                for start, end, chunk_images in chunks])
        if self._capture_logps:  # the policy log-probs (with grad) of the loss's forward pass
            self._captured_logps = result[0]
        return result

    def _aggregate(self, inputs, per_token, mask, loss_type=None, num_items_in_batch=None) -> torch.Tensor:
        """Reduce a (B, T) per-token term the way TRL reduces the policy loss of `loss_type` (default: the config's)
        on this micro-batch, so that its weight relative to the policy loss does not depend on the batch layout."""
        training = self.model.training
        return aggregate_token_loss(
            per_token,
            mask,
            loss_type or self.loss_type,
            num_items_in_batch=inputs["num_items_in_batch"] if num_items_in_batch is None else num_items_in_batch,
            num_processes=self.accelerator.num_processes,
            grad_accum=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation if training else 1,
            max_completion_length=self.max_completion_length,
        )

    def _global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Mean of `x` over the `mask` entries of every process."""
        m = mask.to(torch.float32)
        stats = self.accelerator.reduce(torch.stack([(x.detach().float() * m).sum(), m.sum()]), reduction="sum")
        return (stats[0] / stats[1].clamp(min=1.0)).item()

    def _kl_loss_term(self, inputs, logps) -> torch.Tensor:
        """KL(pi || ref) loss term with `kl_loss_estimator`, aggregated like the policy loss of `loss_type`."""
        mask = rollout.loss_mask(inputs)
        per_token_kl = kl_estimate(logps, inputs["ref_per_token_logps"], self.kl_loss_estimator)
        if self.args.use_bias_correction_kl:  # as TRL does for its k3 term: weight by the (differentiable) IS ratio
            old = inputs.get("old_per_token_logps")
            log_ratio = logps - (logps.detach() if old is None else old)
            if self.importance_sampling_level == "sequence":
                log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
            per_token_kl = per_token_kl * torch.exp(log_ratio)
        mode = "train" if self.model.training else "eval"
        value = self._aggregate(inputs, per_token_kl, mask)
        self._metrics[mode]["kl"].append(self._global_mean(per_token_kl, mask))
        return value

    def _dual_clip_correction(self, inputs, logps) -> torch.Tensor:
        """Dual-clip (arXiv 1912.09729) on top of TRL's PPO-clip loss: `aggregate(loss_dual - loss_standard)`.

        TRL's policy loss stays the source of truth (its loss types, vLLM importance-sampling correction, entropy
        bonus, metrics); dual-clip only changes the loss of tokens with A < 0 and r > c, from `-A r` to the constant
        `-A c`, so the difference of the two `losses.ppo_clip_policy_loss` on the same log-probs is non-zero only on
        those tokens, where it cancels the gradient. The combinations in which TRL reweights the per-token loss in
        ways this would have to mirror are refused by the config (`VariantConfig._check_dual_clip`).
        """
        mode = "train" if self.model.training else "eval"
        mask = rollout.loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        eps = (self.epsilon_low, self.epsilon_high)
        dual, masks = ppo_clip_policy_loss(logps, old, advantages, *eps, clip_ratio_c=self.args.clip_ratio_c)
        standard, _ = ppo_clip_policy_loss(logps, old, advantages, *eps)
        correction = dual - standard  # non-zero only where dual-clip bites
        if self.use_vllm and self.vllm_importance_sampling_correction:
            correction = correction * inputs["importance_sampling_ratio"]
        self._metrics[mode]["clip_ratio/dual_mean"].append(self._global_mean(masks["dual"].float(), mask))
        return self._aggregate(inputs, correction, mask)

    # -------------------------------------------------------------------------------------------- token normaliser
    def step_token_counts(self, inputs: dict) -> dict[str, torch.Tensor]:
        """The token counts (local, 0-dim) of one micro-batch that normalise token-level terms, by the key of the
        inputs that carries their total (`num_items_in_batch`: the loss tokens; VAPO adds its correct-completion
        tokens)."""
        return {"num_items_in_batch": rollout.loss_mask(inputs).sum()}

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training or self.args.token_level_normalizer != "optimizer_step":
            return inputs
        spg = self.args.steps_per_generation
        accum = self.current_gradient_accumulation_steps
        if spg == accum or (spg * self.num_iterations) % accum != 0:
            # eval, TRL's normaliser, or a generation batch that is exactly one optimizer step (TRL's count is then
            # already the step's); a misaligned layout is refused by the config for the losses that read the count
            return inputs
        return {**inputs, **self._step_normalizers(spg, accum)}

    def _step_normalizers(self, spg: int, accum: int) -> dict[str, torch.Tensor]:
        """For the micro-batch about to be trained: each `step_token_counts` key set to its total over the optimizer
        step this micro-batch belongs to (its accumulation micro-batches, all processes), times `spg / accum`, which
        TRL's and `aggregate_token_loss`'s "dapo" normaliser (`total / processes * accum / spg`) divide back out."""
        if self._counted_buffer is not self._buffered_inputs:  # a new (or restored) generation batch: count it once
            counts = [self.step_token_counts(part) for part in self._buffered_inputs]
            keys = list(counts[0])
            local = torch.stack([torch.stack([c[k].float() for k in keys]) for c in counts])  # (spg, K)
            self._step_counts = (keys, self.accelerator.reduce(local, reduction="sum"))
            self._counted_buffer = self._buffered_inputs
        keys, totals = self._step_counts
        # optimizer steps start at micro-batches that are multiples of `accum` (the config makes `accum` divide the
        # generation block), and micro-batch m trains slice m % spg of the buffer
        first = self._step - self._step % accum
        slices = torch.tensor([(first + j) % spg for j in range(accum)], device=totals.device)
        step_totals = totals[slices].sum(dim=0) * (spg / accum)
        return {key: step_totals[i] for i, key in enumerate(keys)}
    def sampling_logps(self, output: dict) -> torch.Tensor:
        """The sampling policy's per-token log-probs of this process's rollout rows, (B, T), for the KL in the reward.

        In order: TRL's `old_per_token_logps` when it computed them (importance sampling: the training forward's
        numbers); else, with `sampling_logps_source="generate"`, those of the generation (`sampling_per_token_logps`:
        recorded during HF `generate` by `_generate_single_turn`, or vLLM's) when every process can use its own
        (`unusable_sampling_logps`); else one no-grad forward pass of the policy (TRL's
        `_get_per_token_logps_and_entropies`), the documented fallback, logged as `FORWARD_FALLBACK_METRIC`.
        """
        old = output.get("old_per_token_logps")
        if old is not None:
            return old
        if self.sampling_logps_source == "generate":
            reason = self.unusable_sampling_logps(output)
            # one decision for every process: the fallback forward is a collective under ZeRO-3 / FSDP
            flags = self.accelerator.gather(torch.tensor([reason is None], device=self.accelerator.device))
            usable = bool(flags.all())
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][FORWARD_FALLBACK_METRIC].append(0.0 if usable else 1.0)
            if usable:
                sampled = output["sampling_per_token_logps"]
                mask = rollout.loss_mask(output).bool()
                return torch.where(mask, sampled, torch.zeros_like(sampled))
            if reason is not None:
                logger.warning_once(f"sampling_logps_source='generate': {reason}; the KL in the reward takes one "
                                    f"more forward pass of the policy instead (logged as {FORWARD_FALLBACK_METRIC})")
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():  # the image inputs too (each chunk of rows gets its own, as in TRL's forwards)
            old, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size if self.model.training
                else self.args.per_device_eval_batch_size,
                **rollout.image_inputs(output),
            )
        return old

    def unusable_sampling_logps(self, output: dict) -> str | None:
        """Why this process's generation log-probs (`output["sampling_per_token_logps"]`) are not the training
        forward's numbers (a phrase for the fallback warning), or None when they are usable.

        Not there (nothing recorded: `unrecordable_reason`, continuous batching), not every loss token scored (a
        recording that failed its self-check, a token vLLM could not score), or a left-padded batch of a model whose
        logits depend on absolute positions (`generation.relative_positions`): `generate` (and vLLM) number a row's
        positions from its first token, TRL's training and reference forwards from the first column, pads included,
        so a padded row's log-probs differ between the two and the KL would depend on how much padding a prompt got.
        """
        sampled = output.get("sampling_per_token_logps")
        if sampled is None:
            return self.unrecordable_reason() or "the generation returned no log-probs"
        mask = rollout.loss_mask(output).bool()
        if sampled.shape != mask.shape or torch.isnan(sampled[mask]).any():
            return ("not every loss token has a generation log-prob (a recording that failed its self-check, a token "
                    "vLLM could not score)")
        if not (output["prompt_mask"] != 0).all() and not self.relative_positions:
            return ("left-padded prompts with a model whose logits depend on absolute positions (`generate` and "
                    "TRL's forward number a padded row's positions differently)")
        return None

    def reference_kl(self, output: dict) -> torch.Tensor | None:
        """Per-token KL(pi_old || ref) with `kl_in_reward_estimator`, for KL-in-reward estimators. Local (B, T).

        Uses the sampling-time policy log-probs (REINFORCE++ Eq. 5 and RLOO take the KL of the policy that sampled;
        see `sampling_logps` for where they come from). Returns the KL times the loss mask (`completion_mask`, times
        `tool_mask` when present: tool output is not sampled by the policy), or None when `kl_in_reward_coef == 0`.
        """
        if self.kl_in_reward_coef == 0.0:
            return None
        old = self.sampling_logps(output)
        kl = kl_estimate(old, output["ref_per_token_logps"], self.kl_in_reward_estimator)
        mask = rollout.loss_mask(output)
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
        mode = "train" if self.model.training else "eval"
        stats = self.accelerator.reduce(torch.stack([kl.sum(), mask.sum().float()]), reduction="sum")
        self._metrics[mode]["kl_in_reward"].append((stats[0] / stats[1].clamp(min=1.0)).item())
        return kl

    def _replace_advantages(self, output: dict, inputs: list) -> dict:
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        rewards_per_func = self._captured_rewards_per_func
        num_local = output["prompt_ids"].shape[0]
        num_logged = rewards_per_func.shape[0]

        if group_size == 1:
            # TRL logs the share of groups whose rewards have zero std: 1.0 for groups of one, which says nothing
            # (`reward_std`, the std over the whole batch, stays)
            self._metrics[mode].pop("frac_reward_zero_std", None)
        keep = self.select_rows(rewards_per_func, group_size, inputs)
        kl = self._reward_kl(output)
        if kl is not None:
            output["kl_in_reward"] = kl
        global_batch = None
        if self.needs_global_batch or kl is not None:
            needed = {key: output[key] for key in self.global_batch_keys if key in output}
            global_batch = rollout.gather_rollout(self.accelerator, needed, num_local, self._tokenizer.pad_token_id)
            output.pop("kl_in_reward", None)
        if keep is not None:
            rewards_per_func = rewards_per_func[keep]
            if global_batch is not None:
                global_batch = {k: v[keep] for k, v in global_batch.items()}
            group_size = self.kept_group_size(group_size)

        advantages = self._advantages_for(rewards_per_func, global_batch, group_size)

        rank = self.accelerator.process_index
        if keep is not None:  # only the kept rows move, each straight to the process that trains it
            sources = torch.div(keep, num_local, rounding_mode="floor")
            mine = keep[sources == rank] - rank * num_local
            rows = rollout.row_entries(output, num_local)
            rows = {k: v[mine.to(v.device)] for k, v in rows.items() if k not in ("advantages", "kl_in_reward")}
            output = rollout.redistribute_rows(self.accelerator, rows, sources, self._tokenizer.pad_token_id)
            num_local = advantages.shape[0] // self.accelerator.num_processes
        local = advantages[rank * num_local : (rank + 1) * num_local]
        if local.dim() == 2:
            local = local[:, : output["completion_mask"].shape[1]]
        output["advantages"] = local
        tokens = rollout.loss_mask(global_batch) if global_batch and "completion_mask" in global_batch else None
        self._log_advantages(advantages, num_logged, keep, tokens)
        return output

    def _reward_kl(self, output: dict) -> torch.Tensor | None:
        """The KL in the reward of a rollout's rows (`reference_kl`); drops the sampling log-probs recorded for it."""
        kl = self.reference_kl(output)
        if self.records_sampling_logps() and not self.use_vllm and self.rollout_func is None:
            # recorded for the KL only: TRL's loss (off-policy mask) then sees what it sees without them
            output.pop("sampling_per_token_logps", None)
        return kl

    def _advantages_for(self, rewards_per_func: torch.Tensor, global_batch: dict | None, group_size: int):
        """`compute_advantages` of the (kept) rows whose per-function rewards are `rewards_per_func` (N, F)."""
        rewards = self.total_rewards(rewards_per_func)
        self.advantage_rewards_per_func = rewards_per_func
        advantages = self.compute_advantages(rewards, global_batch, group_size)
        self.advantage_rewards_per_func = None
        if not torch.isfinite(advantages).all():  # the estimators promise this; a broken subclass must not train
            raise FloatingPointError(f"{type(self).__name__}.compute_advantages returned non-finite advantages")
        return advantages

    def _log_advantages(
        self, advantages: torch.Tensor, num_logged: int, keep: torch.Tensor | None, mask: torch.Tensor | None = None
    ):
        """Put this algorithm's advantages (per-sequence mean over the loss tokens for token-level ones) in the
        completions table. `mask` (N, T) marks the loss tokens of the (kept) global rows."""
        per_row = advantages
        if per_row.dim() == 2:
            if mask is None or mask.shape != per_row.shape:
                mask = per_row != 0
            valid = mask.bool()
            per_row = torch.where(valid, per_row, torch.zeros_like(per_row)).sum(dim=1) / valid.sum(dim=1).clamp(min=1)
        if keep is not None:  # dropped rows show NaN: they were generated and scored but not trained on
            full = torch.full((num_logged,), float("nan"), device=per_row.device)
            full[keep] = per_row
            per_row = full
        logged = self._logs["advantages"]
        # the table keeps the last `generation_batch_size` rows: after several generation rounds (DAPO) it holds only
        # the newest of the `num_logged` rows, which are the last ones of `per_row`
        count = min(num_logged, len(logged))
        for _ in range(count):
            logged.pop()
        logged.extend(per_row[num_logged - count :].tolist())
