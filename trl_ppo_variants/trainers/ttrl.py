"""TTRL: Test-Time Reinforcement Learning (Zuo et al., arXiv 2504.16084).

On unlabelled prompts: sample `n_votes` completions per prompt, extract each answer, take the most frequent answer of
the group as the pseudo-label (majority vote), reward 1 the completions that agree with it and 0 the others, then
train on `n_train` of the `n_votes` completions with GRPO advantages. No ground truth enters the reward.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from .. import rewards as R
from ..errors import check
from .base import VariantConfig, VariantTrainer

TRAIN_SUBSETS = ("first", "random")
EQUIVALENCES = ("normalized", "math_verify")


@dataclass
class TTRLConfig(VariantConfig):
    r"""
    Configuration for [`TTRLTrainer`]: [`~trl.GRPOConfig`] with TTRL's fields.

    Batch sizes keep `GRPOConfig`'s meaning: `per_device_train_batch_size` counts *generated* completions, so the
    dataloader, the prompts per step and the generation cost are exactly those of `GRPOTrainer` with
    `num_generations=n_votes`. After the vote, only `n_train` of every `n_votes` completions are kept, so each
    optimisation micro-batch holds `per_device_train_batch_size * n_train / n_votes` completions (the backward pass,
    its memory and its time scale with `n_train`). This must be a whole number.

    Parameters:
        n_votes (`int`, *optional*):
            Completions sampled per prompt, all of which vote (paper: 64). Sets `num_generations`; defaults to it.
        n_train (`int`, *optional*):
            Completions per prompt trained on, `2 <= n_train <= n_votes` (paper: 32). Defaults to `n_votes // 2`
            (at least 2).
        train_subset (`str`, *optional*, defaults to `"first"`):
            Which `n_train` completions of a group are trained on: `"first"` (the first in sampling order; the
            samples are i.i.d., so this is already a uniform subset) or `"random"` (a fresh subset per group and
            step, seeded by `seed` and the global step, hence reproducible and identical on every process).
        answer_extractor (`str`, *optional*, defaults to `"math"`):
            How an answer is read from a completion: `"math"` (last `\boxed{}`, else last number), `"boxed"`,
            `"last_number"`, or `"module:function"` (a callable `completion -> str | None`).
        label_column (`str` or `None`, *optional*, defaults to `"answer"`):
            Dataset column holding the ground truth. Only logged (`ttrl/...` metrics: how good the pseudo-labels
            are), never used for the reward. Ignored when the dataset has no such column.
        answer_equivalence (`str`, *optional*, defaults to `"normalized"`):
            When two answers vote together (and match the ground truth in the metrics): `"normalized"` (equal after
            `rewards.normalize_answer`) or `"math_verify"` (also merge symbolically equal answers with the optional
            `math-verify` package, run in a killable worker with a hard timeout).
        kl_in_reward_coef (`float`, *optional*, defaults to `0.0`):
            As in every config of the package: the summed per-token KL to the reference (`kl_in_reward_estimator`,
            k1 by default) times this coefficient is subtracted from each trained completion's reward (the vote plus
            any extra reward) before the GRPO advantage, as ReMax does. Refused with
            `multi_objective_aggregation="normalize_then_sum"`.
        allow_labelled_rewards (`bool`, *optional*, defaults to `False`):
            TTRL is label-free: the reward is agreement with the majority vote. Extra `reward_funcs` are added to
            the vote's reward (weighted by `reward_weights`), so one that reads a dataset column (its arguments
            without a default, or its `required_columns`/`column` attribute: `math_accuracy`, TRL's
            `accuracy_reward`, ...) would train on the ground truth. Such a reward is refused at construction unless
            this is `True` (a warning then names it). Label-free extras (`format`, `overlong`, a reward model) are
            always accepted. A function reading a column only through `**kwargs` cannot be detected.
        multi_objective_aggregation (`str`, *optional*, defaults to `"sum_then_normalize"`):
            As in [`~trl.GRPOConfig`]; `"normalize_then_sum"` (GDPO) normalises the vote and each extra reward within
            the trained group, sums them with `reward_weights` and normalises over the batch.
    """

    n_votes: int | None = field(
        default=None, metadata={"help": "Completions sampled per prompt for the vote; sets num_generations."}
    )
    n_train: int | None = field(
        default=None, metadata={"help": "Completions per prompt trained on (<= n_votes); default n_votes // 2."}
    )
    train_subset: str = field(
        default="first", metadata={"help": "Which n_train completions are trained on: 'first' or 'random'."}
    )
    answer_extractor: str = field(
        default="math",
        metadata={"help": "Answer extractor: 'math', 'boxed', 'last_number' or 'module:function'."},
    )
    label_column: str | None = field(
        default="answer", metadata={"help": "Ground-truth column, logged only (never used for the reward)."}
    )
    answer_equivalence: str = field(
        default="normalized", metadata={"help": "Answer equivalence: 'normalized' or 'math_verify'."}
    )
    allow_labelled_rewards: bool = field(
        default=False,
        metadata={"help": "Accept extra reward_funcs that read dataset columns (ground truth); their rewards are added "
                          "to the vote's, so the run is no longer label-free."},
    )

    multi_objective_aggregations = ("sum_then_normalize", "normalize_then_sum")

    def prompt_selection_refused(self):
        return ("TTRL's reward is the majority vote of the whole group, which a screening subset does not have, and "
                "its data are the test prompts themselves, which skipping would leave untrained")

    def __post_init__(self):
        if self.n_votes is not None:
            check(isinstance(self.n_votes, int) and self.n_votes >= 2, "n_votes", "an integer >= 2", self.n_votes)
            self.num_generations = self.n_votes
        super().__post_init__()
        self.n_votes = self.num_generations
        if self.n_train is None:
            self.n_train = max(2, self.n_votes // 2)
        check(isinstance(self.n_train, int) and 2 <= self.n_train <= self.n_votes, "n_train",
              f"an integer in [2, n_votes={self.n_votes}] (a group of 1 has no GRPO baseline)", self.n_train)
        check(self.train_subset in TRAIN_SUBSETS, "train_subset", f"one of {TRAIN_SUBSETS}", self.train_subset)
        check(self.answer_equivalence in EQUIVALENCES, "answer_equivalence", f"one of {EQUIVALENCES}",
              self.answer_equivalence)
        if self.answer_equivalence == "math_verify":
            check(R.math_verify_available(), "answer_equivalence",
                  "'normalized' unless math-verify is installed (pip install math-verify)", self.answer_equivalence)
        try:
            R.get_answer_extractor(self.answer_extractor)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"answer_extractor: expected {list(R.EXTRACTORS)} or an importable 'module:function', "
                             f"got {self.answer_extractor!r} ({type(e).__name__})") from None
        if self.multi_objective_aggregation == "normalize_then_sum":
            check(self.kl_in_reward_coef == 0, "kl_in_reward_coef",
                  "0 with multi_objective_aggregation='normalize_then_sum' (the KL is subtracted from the summed "
                  "reward, which GDPO never forms; use beta for a KL loss term)", self.kl_in_reward_coef)
        step = self.n_votes // math.gcd(self.n_votes, self.n_train)
        check(self.per_device_train_batch_size % step == 0, "per_device_train_batch_size",
              f"a multiple of {step} so that its n_train/n_votes = {self.n_train}/{self.n_votes} share (the rows "
              "trained per micro-batch) is a whole number", self.per_device_train_batch_size)


class _MajorityVote:
    """The vote's column of the reward table. Called by TRL on each process's own completions, it can only extract
    answers (a group may be spread over processes); it returns placeholders, and `TTRLTrainer._calculate_rewards`
    fills the column once the answers of whole groups are gathered."""

    __name__ = "majority_vote"

    def __init__(self, extractor):
        self.extractor = extractor
        self.last_answers = None

    def __call__(self, completions, **kwargs):
        self.last_answers = R.extract_answers(completions, self.extractor)
        log_extra = kwargs.get("log_extra")
        if log_extra is not None:  # shown in the completions table next to the rewards
            log_extra("ttrl_answer", ["" if a is None else a for a in self.last_answers])
        return [0.0] * len(completions)


class TTRLTrainer(VariantTrainer):
    """TTRL (arXiv 2504.16084) on top of TRL's `GRPOTrainer`.

    `reward_funcs` are optional *extra* rewards (for example `"format"`, any built-in name of
    `trl_ppo_variants.rewards`, `"module:function"`, or a callable); the majority-vote reward is always the first
    column (`majority_vote`) of the reward table and gets weight 1 unless `reward_weights` has one weight per reward
    including it. The vote runs on the answers of whole groups gathered from every process, so a completion's reward
    does not depend on the process it was generated on. The policy loss is `GRPOTrainer`'s (set by `loss_type`).
    """

    _tag_names = ["trl", "trl-ppo-variants", "ttrl"]
    config_class = TTRLConfig

    def __init__(self, model, reward_funcs=None, args: TTRLConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        extra = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        # the vote is always the first reward; naming it (as a recipe may: reward_funcs: [majority_vote]) is a no-op
        extra = [f for f in extra if f != "majority_vote"]
        # our built-in names and module:function paths; any other string stays a reward-model id for TRL
        extra = [R.get_reward_function(f) if isinstance(f, str) and (f in R.REWARD_FUNCTIONS or ":" in f) else f
                 for f in extra]
        self._check_label_free(extra, args)
        self._vote = _MajorityVote(R.get_answer_extractor(args.answer_extractor))
        processing = kwargs.pop("reward_processing_classes", None)
        if isinstance(processing, (list, tuple)):
            processing = [None, *processing]
        elif processing is not None:
            processing = [None, processing]
        weights = args.reward_weights
        if weights is not None:
            check(len(weights) in (len(extra), len(extra) + 1), "reward_weights",
                  f"{len(extra)} weights (your reward functions; the vote gets 1.0) or {len(extra) + 1} (the vote "
                  "first)", weights)
            if len(weights) == len(extra):
                args.reward_weights = [1.0, *weights]
        try:
            super().__init__(model, [self._vote, *extra], args=args, reward_processing_classes=processing, **kwargs)
        finally:
            args.reward_weights = weights
        self.n_votes, self.n_train = args.n_votes, args.n_train
        if args.answer_equivalence == "math_verify":
            self._equal = lambda a, b: R.answers_equivalent(a, b, math_verify=True)
            self._merge = self._equal
        else:
            self._equal = lambda a, b: R.answers_equivalent(a, b, math_verify=False)
            self._merge = None
        self._vote_state = None

    @staticmethod
    def _check_label_free(extra: list, args: TTRLConfig) -> None:
        """Extra rewards are added to the vote's: one that reads dataset columns (supervision) is refused unless
        `allow_labelled_rewards`, and then named in a warning."""
        labelled = {}
        for func in extra:
            if callable(func) and not isinstance(func, torch.nn.Module):
                columns = R.required_columns(func)
                if columns:
                    labelled[getattr(func, "__name__", type(func).__name__)] = columns
        if not labelled:
            return
        described = ", ".join(f"'{name}' (reads {', '.join(cols)})" for name, cols in labelled.items())
        if not args.allow_labelled_rewards:
            raise ValueError(f"reward_funcs: expected label-free rewards for TTRL (its reward is the majority vote), "
                             f"got {described}, added to the vote's reward; remove them, or set "
                             "allow_labelled_rewards=True to train on the sum (then no longer label-free)")
        warnings.warn(f"TTRL: the rewards {described} read dataset columns (ground truth) and are added to the "
                      "majority-vote reward (allow_labelled_rewards=True): this run is not label-free", stacklevel=3)

    # ------------------------------------------------------------------------------------------ the vote
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._vote.last_answers = None
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        # gather_object concatenates in process order, the order of the rows in TRL's gathered reward table: every
        # group is whole and in sampling order, whatever the split over processes.
        answers = gather_object(self._vote.last_answers)
        classes = R.answer_classes(answers, group_size, equal=self._merge)
        labels, pseudo = R.majority_vote_rewards(classes, group_size, key=lambda k: k)
        rewards_per_func[:, 0] = torch.tensor(pseudo, dtype=rewards_per_func.dtype, device=rewards_per_func.device)

        truths = None
        column = self.args.label_column
        if column is not None and column in inputs[0]:
            truths = gather_object([x.get(column) for x in inputs])[::group_size]
        self._vote_state = {"answers": answers, "labels": labels, "pseudo": pseudo, "truths": truths}
        self._log_vote(mode, "votes", list(range(len(answers))), group_size)
        self._logs["extra"]["ttrl_label"].extend("" if labels[i // group_size] is None else labels[i // group_size]
                                                 for i in range(len(answers)))
        return rewards_per_func

    def _log_vote(self, mode: str, prefix: str, rows: list[int], group_size: int):
        """Pseudo-label quality over the given global rows (whole groups of `group_size`), logged as ttrl/<prefix>/."""
        state = self._vote_state
        full = self.num_generations if mode == "train" else self.num_generations_eval
        labels = state["labels"]
        pseudo = [state["pseudo"][i] for i in rows]
        true = label_ok = None
        if state["truths"] is not None:
            truths = state["truths"]
            true = [float(self._truth_equal(state["answers"][i], truths[i // full])) for i in rows]
            label_ok = [self._truth_equal(lab, t) for lab, t in zip(labels, truths)]
        stats = R.vote_statistics(pseudo, group_size, true, label_ok)
        stats["no_answer_frac"] = sum(state["answers"][i] is None for i in rows) / max(len(rows), 1)
        for name, value in stats.items():
            self._metrics[mode][f"ttrl/{prefix}/{name}"].append(value)

    def _truth_equal(self, answer, truth) -> bool:
        return truth is not None and self._equal(answer, str(truth))

    # ------------------------------------------------------------------------------------------ the train subset
    def select_rows(self, rewards_per_func, group_size, inputs):
        if not self.model.training or self.n_train == group_size:
            if self.model.training:
                self._log_vote("train", "train", list(range(rewards_per_func.shape[0])), group_size)
            return None
        num_groups = rewards_per_func.shape[0] // group_size
        if self.args.train_subset == "first":
            within = torch.arange(self.n_train).expand(num_groups, -1)
        else:
            # same seed on every process (seed, global step), so every process keeps the same rows
            gen = torch.Generator().manual_seed(int(self.args.seed) * 1_000_003 + int(self.state.global_step))
            within = torch.stack([torch.randperm(group_size, generator=gen)[: self.n_train].sort().values
                                  for _ in range(num_groups)])
        keep = (torch.arange(num_groups).unsqueeze(1) * group_size + within).reshape(-1)
        self._log_vote("train", "train", keep.tolist(), self.n_train)
        return keep.to(rewards_per_func.device)

    def kept_group_size(self, group_size):
        return self.n_train if self.model.training else group_size

    def compute_advantages(self, rewards, batch, group_size):
        if batch is not None and "kl_in_reward" in batch:  # KL-penalised reward, as ReMax and RLOO
            rewards = rewards - self.kl_in_reward_coef * batch["kl_in_reward"].sum(dim=1)
        return self.grpo_group_advantages(rewards, group_size)
