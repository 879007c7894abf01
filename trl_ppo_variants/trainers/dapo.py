"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., arXiv 2503.14476)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer
from trl.rewards import get_soft_overlong_punishment

from .. import selection
from .base import VariantConfig, VariantTrainer, check

OVERLONG_REWARD_NAME = "soft_overlong_punishment_reward"  # the __name__ of TRL's soft overlong punishment


@dataclass
class DAPOConfig(VariantConfig):
    r"""
    Configuration for [`DAPOTrainer`]: [`~trl.GRPOConfig`] with DAPO's defaults (arXiv 2503.14476) and its two
    data-side techniques, dynamic sampling and overlong reward shaping.

    Parameters:
        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower clip range (Clip-Higher, Eq. 10: `epsilon_low`).
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clip range (Clip-Higher: decoupled from `epsilon`).
        beta (`float`, *optional*, defaults to `0.0`):
            KL loss coefficient; DAPO removes the KL term.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Token-level policy-gradient loss (Eq. 12): sum over every token of the batch / number of tokens. With
            several optimizer steps per rollout (`steps_per_generation > gradient_accumulation_steps`, the paper's
            16 updates), each step is divided by its own tokens (`token_level_normalizer="optimizer_step"`).
        multi_objective_aggregation (`str`, *optional*, defaults to `"sum_then_normalize"`):
            As in [`~trl.GRPOConfig`]; `"normalize_then_sum"` (GDPO) normalises each reward function within its group
            (the overlong shaping term included), sums them with `reward_weights` and normalises over the batch.
        dynamic_sampling (`bool`, *optional*, defaults to `True`):
            Drop the groups whose `filter_metric` has no spread (all completions equally right or wrong) and refill
            the batch with groups of fresh prompts until it holds as many groups as a generation batch
            (`generation_batch_size // num_generations`). Training only; evaluation is plain GRPO.
        filter_metric (`str`, *optional*, defaults to `"reward"`):
            What must vary within a group for it to be kept. `"reward"`: the weighted sum of the task reward
            functions, *without* the overlong shaping term (the paper filters on accuracy, before shaping). Or the
            name of one reward function (its raw value), e.g. `"accuracy_reward"`.
        filter_std_eps (`float`, *optional*, defaults to `1e-6`):
            A group is kept when the sample std of its `filter_metric` is > this (not `== 0`: float noise).
        max_generation_rounds (`int`, *optional*, defaults to `10`):
            Generation rounds per step at most (the first round plus refills). `0` means unlimited, as in the paper,
            which loops forever on a data set where no group ever has a spread. When the limit is reached without a
            full batch, the step trains on the groups it has (see [`DAPOTrainer`]).
        refill_num_prompts (`int`, *optional*):
            Prompts drawn per refill round. `None`: sized from the keep-rate estimate to the groups still missing
            (see `shortfall_probability`). `refill_num_prompts * num_generations` must split evenly over the
            processes.
        keep_rate_init (`float`, *optional*, defaults to `1.0`):
            Keep-rate estimate (fraction of generated groups with a spread) before any group has been scored. `1.0`:
            no over-sampling until a keep rate has been observed.
        keep_rate_smoothing (`float`, *optional*, defaults to `0.1`):
            Weight of the newest generation round in the keep-rate estimate, an exponentially weighted ratio of
            (groups with a spread) / (groups generated) over the rounds so far (about the last `1 / smoothing`
            rounds). Saved in checkpoints.
        shortfall_probability (`float`, *optional*, defaults to `0.2`):
            Each round is sized so that, if the keep rate were the estimate, the probability that it brings fewer
            groups with a spread than still needed is at most this (binomial tail). The first round over-samples
            the dataloader's batch with refill prompts in the same generation call; each refill is sized to the
            groups still missing. Smaller: fewer rounds, more surplus generated and trimmed.
        max_oversample_factor (`float`, *optional*, defaults to `2.0`):
            A round generates at most this many times `generation_batch_size // num_generations` prompts (it bounds
            the memory of one round: up to this many generation batches on each process). `1.0`: the first round is
            the dataloader's batch only.
        overlong_penalty (`bool`, *optional*, defaults to `True`):
            Add the soft overlong punishment (Eq. 13, `trl.rewards.get_soft_overlong_punishment` with
            `L_max = max_completion_length`) to each completion's reward (weight 1) for its advantage. It is DAPO's
            shaping, not one of the user's reward functions: `reward_funcs`, `reward_func_names`,
            `reward_processing_classes`, `reward_weights` and the logged `reward` stay the user's (as with
            `trl.GRPOTrainer`); the shaping is logged as `dapo/overlong_penalty` (its mean over the generated
            completions) and `dapo/frac_overlong_penalized` (the share it lowers).
        overlong_cache_length (`int`, *optional*):
            `L_cache` of Eq. 13, in tokens, in `[0, max_completion_length)`. `None`: 20% of `max_completion_length`
            (rounded down), the paper's 4096 / 20480.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range (Clip-Higher epsilon_low)."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip range (Clip-Higher)."})
    beta: float = field(default=0.0, metadata={"help": "KL loss coefficient; DAPO uses none."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level loss: sum over tokens / number of tokens."})
    dynamic_sampling: bool = field(
        default=True, metadata={"help": "Drop groups without reward spread and refill the batch with fresh prompts."}
    )
    filter_metric: str = field(
        default="reward",
        metadata={"help": "'reward' (weighted task reward, without overlong shaping) or a reward function name."},
    )
    filter_std_eps: float = field(
        default=1e-6, metadata={"help": "Keep a group when the std of its filter metric is > this."}
    )
    max_generation_rounds: int = field(
        default=10, metadata={"help": "Generation rounds per step at most (first + refills); 0 = unlimited."}
    )
    refill_num_prompts: int | None = field(
        default=None, metadata={"help": "Prompts per refill round; None = sized from the keep-rate estimate."}
    )
    keep_rate_init: float = field(
        default=1.0, metadata={"help": "Keep-rate estimate before any observation (1.0: no over-sampling yet)."}
    )
    keep_rate_smoothing: float = field(
        default=0.1, metadata={"help": "Weight of the newest round in the exponentially weighted keep-rate estimate."}
    )
    shortfall_probability: float = field(
        default=0.2,
        metadata={"help": "Size each round so that P(fewer groups with spread than needed) <= this at the estimate."},
    )
    max_oversample_factor: float = field(
        default=2.0, metadata={"help": "A round generates at most this many generation batches' worth of prompts."}
    )
    overlong_penalty: bool = field(
        default=True, metadata={"help": "Add the soft overlong punishment (DAPO Eq. 13) to the reward."}
    )
    overlong_cache_length: int | None = field(
        default=None, metadata={"help": "L_cache in tokens; None = 20% of max_completion_length."}
    )

    multi_objective_aggregations = ("sum_then_normalize", "normalize_then_sum")

    def __post_init__(self):
        super().__post_init__()
        check(self.filter_std_eps >= 0, "filter_std_eps", "a number >= 0", self.filter_std_eps)
        check(isinstance(self.max_generation_rounds, int) and self.max_generation_rounds >= 0,
              "max_generation_rounds", "an integer >= 0 (0 = unlimited)", self.max_generation_rounds)
        if self.refill_num_prompts is not None:
            check(isinstance(self.refill_num_prompts, int) and self.refill_num_prompts >= 1, "refill_num_prompts",
                  "None or an integer >= 1", self.refill_num_prompts)
        check(0.0 < self.keep_rate_init <= 1.0, "keep_rate_init", "a number in (0, 1]", self.keep_rate_init)
        check(0.0 < self.keep_rate_smoothing <= 1.0, "keep_rate_smoothing", "a number in (0, 1]",
              self.keep_rate_smoothing)
        check(0.0 < self.shortfall_probability < 1.0, "shortfall_probability", "a number in (0, 1)",
              self.shortfall_probability)
        check(self.max_oversample_factor >= 1.0, "max_oversample_factor", "a number >= 1",
              self.max_oversample_factor)
        check(isinstance(self.filter_metric, str) and self.filter_metric != "", "filter_metric",
              "'reward' or the name of a reward function", self.filter_metric)
        check(self.kl_in_reward_coef == 0, "kl_in_reward_coef",
              "0 (DAPO has no KL in the reward; use beta for a KL loss term)", self.kl_in_reward_coef)
        if self.overlong_penalty:
            check(isinstance(self.max_completion_length, int) and self.max_completion_length >= 1,
                  "max_completion_length", "an integer >= 1 when overlong_penalty is on", self.max_completion_length)
            if self.overlong_cache_length is not None:
                check(isinstance(self.overlong_cache_length, int)
                      and 0 <= self.overlong_cache_length < self.max_completion_length,
                      "overlong_cache_length", f"None or an integer in [0, {self.max_completion_length})",
                      self.overlong_cache_length)

    @property
    def effective_overlong_cache_length(self) -> int:
        """`L_cache` in tokens: the configured one, else 20% of `max_completion_length` (paper: 4096 / 20480)."""
        if self.overlong_cache_length is not None:
            return self.overlong_cache_length
        return self.max_completion_length // 5


# ----------------------------------------------------------------------------------------------- round sizing
def update_keep_rate(state: tuple[float, float], with_spread: int, generated: int,
                     smoothing: float) -> tuple[float, float]:
    """One round into the keep-rate estimator: exponentially weighted sums of (groups with a spread, groups
    generated), `s <- (1 - a) s + a x`. `state` starts at (0, 0). Counts, not per-round rates, are averaged: a round
    of many groups says more than a round of few."""
    kept, total = state
    return (1 - smoothing) * kept + smoothing * with_spread, (1 - smoothing) * total + smoothing * generated


def keep_rate_estimate(state: tuple[float, float], initial: float) -> float:
    """The estimated fraction of groups with a spread: the ratio of the weighted sums, `initial` before any group.
    (The ratio needs no bias correction: both sums carry the same weights.)"""
    kept, total = state
    return kept / total if total > 0 else initial


def binomial_at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in float64 (log-space terms)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p >= 1.0:
        return 1.0
    if p <= 0.0:
        return 0.0
    j = torch.arange(k, n + 1, dtype=torch.float64)
    log_terms = (math.lgamma(n + 1) - torch.lgamma(j + 1) - torch.lgamma(n - j + 1)
                 + j * math.log(p) + (n - j) * math.log1p(-p))
    return min(1.0, torch.logsumexp(log_terms, dim=0).exp().item())


def prompts_to_generate(needed: int, keep_rate: float, shortfall_probability: float, multiple: int, cap: int) -> int:
    """How many prompts a round generates to bring `needed` groups with a spread: the smallest multiple of
    `multiple` (so that its rows split evenly over the processes) `n >= needed` with
    `P(Binomial(n, keep_rate) >= needed) >= 1 - shortfall_probability`, at most `cap` (a multiple of `multiple`;
    returned when no `n <= cap` is enough). 0 when nothing is needed.

    With G completions per prompt, each prompt's group has a spread with probability `keep_rate`, independently; the
    binomial tail is then the probability that the round suffices. E.g. 4 groups needed at keep rate 0.85: 5 prompts
    suffice with probability 0.835, 6 with 0.953.
    """
    if needed <= 0:
        return 0
    lo = -(-needed // multiple)  # in units of `multiple`
    hi = max(cap // multiple, lo)
    if binomial_at_least(needed, hi * multiple, keep_rate) < 1 - shortfall_probability:
        return hi * multiple
    while lo < hi:  # the tail grows with n: bisect for the smallest n that is enough
        mid = (lo + hi) // 2
        if binomial_at_least(needed, mid * multiple, keep_rate) >= 1 - shortfall_probability:
            hi = mid
        else:
            lo = mid + 1
    return lo * multiple


# ----------------------------------------------------------------------------------------------- refill prompts
class RefillSampler:
    """Seeded, resumable stream of dataset indices for the refill rounds of dynamic sampling.

    Independent of TRL's `RepeatSampler` (whose position the `Trainer` owns): epoch `e` is a permutation seeded with
    `seed` and `e` (offset so it never replays the main sampler's order), walked in order. The position (epoch,
    offset) is all the state: `state_dict` / `load_state_dict` save and restore it with checkpoints.

    `draw` skips prompts whose key is in `seen` (the prompts already sampled in this step), so a refill brings
    *fresh* prompts; it gives up skipping after one data set's worth of skips (a data set with fewer distinct prompts
    than a step needs), so it always returns `k` indices.
    """

    SEED_OFFSET = 1_000_003

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError("dynamic sampling needs a non-empty train_dataset")
        self.num_rows, self.seed, self.shuffle = num_rows, int(seed), shuffle
        self.epoch, self.offset = 0, 0
        self._perm_epoch, self._perm = None, None

    def _order(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.SEED_OFFSET * (self.epoch + 1))
                self._perm = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._perm = list(range(self.num_rows))
            self._perm_epoch = self.epoch
        return self._perm

    def _next(self) -> int:
        if self.offset >= self.num_rows:
            self.epoch, self.offset = self.epoch + 1, 0
        index = self._order()[self.offset]
        self.offset += 1
        return index

    def draw(self, k: int, key=None, seen: set | None = None) -> list[int]:
        """Next `k` indices, skipping those with `key(index) in seen` (and adding the drawn keys to `seen`)."""
        out, skipped = [], 0
        while len(out) < k:
            index = self._next()
            if key is not None and seen is not None:
                k_ = key(index)
                if k_ in seen and skipped < self.num_rows:
                    skipped += 1
                    continue
                seen.add(k_)
            out.append(index)
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            warnings.warn(f"DAPO refill sampler: the checkpoint was saved for a data set of {state['num_rows']} rows, "
                          f"this one has {self.num_rows}; restoring the position anyway", stacklevel=2)
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


# ----------------------------------------------------------------------------------------------- batch assembly
class GroupAccumulator:
    """Assembles one dynamic-sampling batch from successive generation rounds (pure: no process group).

    Each round is scored globally (rows in TRL's layout: the `G` completions of a prompt consecutive, the N rows of a
    round split into equal contiguous shares in process order) and the groups with a spread are kept in order until
    `target_groups` are held; the surplus of the last round is trimmed. Every rank takes the same decisions from the
    same gathered rewards, but holds only *its own* rows of the kept groups (`rank` of `world`), so no process ever
    stores the global rollout. A few dropped groups are remembered as placeholders for the exhaustion path
    (`selection.exhausted_group_count`). Nothing is ever duplicated.
    """

    def __init__(self, target_groups: int, group_size: int, multiple: int = 1, eps: float = 1e-6, rank: int = 0,
                 world: int = 1):
        self.target, self.G, self.multiple, self.eps = target_groups, group_size, multiple, eps
        self.rank, self.world = rank, world
        # per kind ("kept", "spare"): this rank's row tensors, and for every row of the kind (all ranks) its gathered
        # rewards, its position among the rows generated this step and the process holding it
        self._parts = {"kept": [], "spare": []}
        self._rewards = {"kept": [], "spare": []}
        self._positions = {"kept": [], "spare": []}
        self._sources = {"kept": [], "spare": []}
        self.num_kept = self.num_spare = 0
        self.rounds = self.groups_generated = self.groups_with_spread = self.dropped_correct = self.dropped_wrong = 0
        self.rows_seen = 0

    @property
    def full(self) -> bool:
        return self.num_kept >= self.target

    def _hold(self, kind: str, groups: torch.Tensor, rollout: dict, rewards_per_func: torch.Tensor) -> None:
        rows = selection.group_rows(groups, self.G).to(rewards_per_func.device)
        per_rank = rewards_per_func.shape[0] // self.world
        sources = torch.div(rows, per_rank, rounding_mode="floor")
        local = rows[sources == self.rank] - self.rank * per_rank
        self._parts[kind].append({k: v[local.to(v.device)] for k, v in rollout.items()})
        self._rewards[kind].append(rewards_per_func[rows])
        self._positions[kind].append(rows + self.rows_seen)
        self._sources[kind].append(sources)

    def add_round(self, rollout: dict, rewards_per_func: torch.Tensor, filter_values: torch.Tensor) -> None:
        """rollout: this process's rows, (N / world, ...) tensors; rewards_per_func: (N, F) and filter_values: (N,),
        gathered over the processes."""
        G, n = self.G, filter_values.shape[0]
        if n % self.world or any(v.shape[0] != n // self.world for v in rollout.values()):
            raise ValueError(f"a round of {n} rows must be split evenly over {self.world} processes")
        spread = selection.group_spread_mask(filter_values, G, self.eps)
        self.rounds += 1
        self.groups_generated += spread.numel()
        self.groups_with_spread += int(spread.sum())
        dropped = ~spread
        value = torch.nanmean(filter_values.reshape(-1, G).double(), dim=1)
        # paper's accuracy reward is +1 / -1 (0 / 1 in many data sets): a constant group above 0 is all-correct
        self.dropped_correct += int((dropped & (value > 0)).sum())
        self.dropped_wrong += int((dropped & (value <= 0)).sum())

        take = spread.nonzero().squeeze(1)[: max(self.target - self.num_kept, 0)]
        if take.numel():
            self._hold("kept", take, rollout, rewards_per_func)
            self.num_kept += take.numel()
        if self.num_spare < self.multiple:
            spare = dropped.nonzero().squeeze(1)[: self.multiple - self.num_spare]
            if spare.numel():
                self._hold("spare", spare, rollout, rewards_per_func)
                self.num_spare += spare.numel()
        self.rows_seen += n

    def finalize(self, pad_token_id: int):
        """-> (local_batch, sources, rewards_per_func, positions, num_real_rows, exhausted).

        The batch holds `num_real_rows` rows of kept groups followed by placeholder rows (exhaustion with too few
        groups). `sources`, `rewards_per_func` and `positions` (the index of every row among all the rows generated
        this step) describe all its rows, on every rank; `local_batch` holds this rank's rows of it, in order, ready
        for `selection.redistribute_rows`."""
        exhausted = not self.full
        num_real, num_pad = (self.target, 0) if not exhausted else selection.exhausted_group_count(
            self.num_kept, self.multiple)
        kinds = ["kept", "spare"] if num_pad else ["kept"]
        parts = [p for kind in kinds for p in self._parts[kind]]
        rewards = torch.cat([r for kind in kinds for r in self._rewards[kind]])
        positions = torch.cat([p for kind in kinds for p in self._positions[kind]])
        sources = torch.cat([s for kind in kinds for s in self._sources[kind]])
        local = selection.concat_rollouts(parts, pad_token_id)
        # kept groups past num_real (rounding down on exhaustion) are dropped; spare groups past num_pad too
        real_rows, pad_rows, kept_rows = num_real * self.G, num_pad * self.G, self.num_kept * self.G
        index = torch.cat([torch.arange(real_rows), kept_rows + torch.arange(pad_rows)]).to(positions.device)
        # this rank's rows are numbered in order of appearance among all rows: keep those `index` selects
        local_number = torch.cumsum(sources == self.rank, dim=0) - 1
        chosen = index[sources[index] == self.rank]
        local = {k: v[local_number[chosen].to(v.device)] for k, v in local.items()}
        return local, sources[index], rewards[index], positions[index], real_rows, exhausted


# ----------------------------------------------------------------------------------------------- trainer
class DAPOTrainer(VariantTrainer):
    """DAPO (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476) on top of
    TRL's `GRPOTrainer`: GRPO advantages without KL, with

    1. Clip-Higher (`epsilon=0.2`, `epsilon_high=0.28`) and the token-level loss (`loss_type="dapo"`): TRL's;
    2. overlong reward shaping (Eq. 13): `trl.rewards.get_soft_overlong_punishment(max_completion_length,
       L_cache)` added to each completion's reward for its advantage (weight 1, also when `reward_weights` is given),
       outside TRL's reward list: it is an extra column of the reward table the advantages are computed from
       (`_captured_rewards_per_func`), not a reward function, so every TRL reward API behaves as with
       `trl.GRPOTrainer`, and the dynamic-sampling filter never sees it;
    3. dynamic sampling (Eq. 11): after scoring, the groups whose `filter_metric` has std <= `filter_std_eps` are
       dropped and fresh prompts (a seeded `RefillSampler` over the train data set, whose position is saved in
       checkpoints and restored on resume) are generated and scored until the batch holds
       `generation_batch_size // num_generations` groups; the surplus of the last round is trimmed. Advantages are
       GRPO's over the kept groups (`scale_rewards` as configured).

    **Round sizing** (not in the paper, whose refills are whole generation batches; verl over-samples with a fixed
    `gen_batch_size`): a keep-rate estimate (an exponentially weighted ratio of groups with a spread to groups
    generated, updated after every round, identical on every process, saved in checkpoints) sizes each round with
    `prompts_to_generate`: the first round is the dataloader's batch plus enough refill prompts, in the same
    generation call, that it suffices with probability `1 - shortfall_probability`; a refill is sized the same way
    to the groups still missing, not to a whole generation batch. On the toy benchmark (`bench/suite.py`, keep rate
    0.63) it took the rounds per step from 1.87 to 1.23 for 1.97 generated tokens per trained token instead of 1.81:
    at keep rate p no sizing generates fewer than 1/p prompts per trained prompt, and fewer rounds cost some trimmed
    surplus (`shortfall_probability` trades one for the other). The learning per step is unchanged.

    Every process decides from the gathered rewards (identical everywhere), so all agree on the number of rounds;
    the kept groups are then split evenly over the processes (a group may span two of them, as in TRL).
    TRL's `_prepare_inputs` shuffles and splits the batch into `steps_per_generation` slices as usual, and reuses it
    for `num_iterations` passes.

    **Exhaustion** (`max_generation_rounds` reached without a full batch): the step trains on the kept groups,
    rounded down to a multiple of `selection.group_multiple(G, num_processes, steps_per_generation)` so that every
    process and every slice gets the same number of rows. If that leaves none, the kept groups are padded with
    dropped (no-spread) groups up to that multiple, trained with advantage 0 (a no-signal step, exactly what GRPO
    does on an all-equal batch). A warning with the numbers is issued once, and `dapo/exhausted` logs 1.

    Metrics (per generation step): `dapo/rounds`, `dapo/groups_generated`, `dapo/groups_kept` (with spread, trained),
    `dapo/frac_dropped_all_correct` and `dapo/frac_dropped_all_wrong` (of the generated groups; a no-spread group
    counts as correct when its common value is > 0), `dapo/gen_tokens_per_trained_token` (completion tokens generated
    in all rounds / loss tokens of the kept groups), `dapo/exhausted`, `dapo/padded_groups`,
    `dapo/keep_rate_estimate` (the estimate that sized the step's first round), `dapo/first_round_prompts`,
    `dapo/refill_prompts` (all refills of the step), `dapo/prompts_per_round` and `dapo/trimmed_groups` (groups
    with a spread generated but not trained: the surplus). TRL's own metrics (`reward`, `completions/*`) average
    over every round generated.

    **Generation backends**: refill rounds call TRL's own `_generate_and_score_completions` with refill prompts laid
    out exactly as TRL's `RepeatSampler` lays them out (each prompt `num_generations` times consecutively, split
    evenly over the processes), so they use whatever backend TRL uses: HF `generate`, transformers continuous
    batching, vLLM colocate or server (vLLM weights are synced once per optimizer step, so every round of a step samples
    from the same policy). Only HF `generate` is tested here (CPU); vLLM colocate/server and DeepSpeed/FSDP are
    untested. Not supported: multimodal rollouts and `IterableDataset` train sets with dynamic sampling (clear error).

    **Memory**: only rewards are gathered (by TRL); each process keeps its own rows of the kept groups across rounds,
    and `selection.redistribute_rows` then moves rows straight to the process that trains them (one all-to-all per
    key). No process holds the global rollout: the peak is about one local round (at most `max_oversample_factor`
    local generation batches) plus the local kept rows (a global copy of 512 x 16 rows of 20k tokens would be about
    3.4 GB on every GPU). The over-sampled first round gathers the dataloader's *inputs* (prompt rows, not
    rollouts) of every process, to lay the round out as TRL's sampler would.
    """

    _tag_names = ["trl", "trl-ppo-variants", "dapo"]
    config_class = DAPOConfig

    def __init__(self, model, reward_funcs=None, args: DAPOConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        self._overlong_func = None
        if args.overlong_penalty:
            funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            names = [getattr(f, "__name__", None) for f in funcs]
            check(OVERLONG_REWARD_NAME not in names, "overlong_penalty",
                  f"False when reward_funcs already holds {OVERLONG_REWARD_NAME}", True)
            self._overlong_func = get_soft_overlong_punishment(
                args.max_completion_length, args.effective_overlong_cache_length)
        super().__init__(model, reward_funcs, args=args, **kwargs)

        # the reward table the advantages read is TRL's columns (the user's reward functions, then any
        # environment-owned rewards) plus, with the shaping on, one last column: the shaping
        self._overlong_index = len(self.reward_funcs) if self._overlong_func is not None else None
        self._task_columns = list(range(len(self.reward_funcs)))
        if args.filter_metric == "reward":
            check(len(self._task_columns) > 0, "filter_metric",
                  "a reward function name when the only reward is the overlong shaping", args.filter_metric)
        else:
            check(args.filter_metric in self.reward_func_names, "filter_metric",
                  f"'reward' or one of {self.reward_func_names}", args.filter_metric)

        self._refill_sampler = None
        self._refill_dataset = None
        self._warned_exhausted = False
        self._keep_rate_state = (0.0, 0.0)  # see `update_keep_rate`; the same on every process
        if args.dynamic_sampling:
            # dynamic sampling never builds the global rollout (memory), so a per-token estimator cannot run on it
            check(not self.needs_global_batch, "dynamic_sampling",
                  f"False for {type(self).__name__}, whose advantages need the global batch", True)
            world = self.accelerator.num_processes
            G = self.num_generations
            if args.refill_num_prompts is not None:
                check(args.refill_num_prompts * G % world == 0, "refill_num_prompts",
                      f"a value whose rows (x num_generations={G}) split evenly over {world} processes",
                      args.refill_num_prompts)
            # prompts per round come in multiples of this, so that a round's rows split evenly over the processes
            self._prompt_multiple = world // math.gcd(G, world)
            dataset = self.train_dataset
            check(dataset is not None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"),
                  "dynamic_sampling", "False with an IterableDataset or no train_dataset (refills need indexing)",
                  True)
            self._refill_sampler = RefillSampler(len(dataset), args.seed, shuffle=self.shuffle_dataset)

    # -------------------------------------------------------------------------------------------- advantages
    def compute_advantages(self, rewards, batch, group_size):
        return self.grpo_group_advantages(rewards, group_size)

    def scorable_columns(self):
        return self._task_columns  # the overlong shaping scores every completion: it says nothing about the task

    def reward_column_weights(self) -> torch.Tensor:
        weights = super().reward_column_weights()
        if self._overlong_index is None:
            return weights
        return torch.cat([weights, torch.ones(1, dtype=weights.dtype, device=weights.device)])

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (the user's columns, returned to TRL as they are) plus the overlong shaping as an extra
        column of the captured table (gathered in the same global row order), NaN on the rows no reward function
        scored: a completion without a task reward is unscorable, its shaping alone is no reward."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._overlong_func is None:
            return rewards_per_func
        local = torch.tensor(self._overlong_func(completion_ids=completion_ids_list), dtype=rewards_per_func.dtype,
                             device=rewards_per_func.device)
        shaping = self.accelerator.gather(local)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["dapo/overlong_penalty"].append(shaping.mean().item())
        self._metrics[mode]["dapo/frac_overlong_penalized"].append((shaping < 0).float().mean().item())
        shaping = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, shaping)
        self._captured_rewards_per_func = torch.cat([self._captured_rewards_per_func, shaping.unsqueeze(1)], dim=1)
        return rewards_per_func

    def filter_values(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The dynamic-sampling filter metric per row: (N, F) -> (N,), NaN where unscorable."""
        if self.args.filter_metric != "reward":
            return rewards_per_func[:, self.reward_func_names.index(self.args.filter_metric)]
        sub = rewards_per_func[:, self._task_columns]
        weights = self.reward_weights.to(sub.device)[self._task_columns]
        values = (sub * weights.unsqueeze(0)).nansum(dim=1)
        values[torch.isnan(sub).all(dim=1)] = float("nan")
        return values

    # -------------------------------------------------------------------------------------------- dynamic sampling
    def _refill_source(self):
        """The train data set with the columns the dataloader would yield (TRL's `remove_unused_columns`)."""
        if self._refill_dataset is None:
            import datasets

            dataset = self.train_dataset
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            self._refill_dataset = dataset
        return self._refill_dataset

    def _refill_rows(self, indices: list[int], head: list[dict] = ()) -> list[dict]:
        """This process's share of a round's inputs, laid out like TRL's RepeatSampler: the global rows are `head`
        (rows already in that layout: the dataloader's batch of every process, in process order), then each refill
        prompt G times consecutively; the global list is split into equal contiguous shares in process order."""
        source = self._refill_source()
        G, world, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        per_rank = (len(head) + len(indices) * G) // world
        return [dict(head[j]) if j < len(head) else dict(source[int(indices[(j - len(head)) // G])])
                for j in range(rank * per_rank, (rank + 1) * per_rank)]

    @property
    def keep_rate(self) -> float:
        """The current keep-rate estimate (fraction of generated groups with a spread)."""
        return keep_rate_estimate(self._keep_rate_state, self.args.keep_rate_init)

    def _round_prompts(self, needed: int) -> int:
        """Prompts for a round that must bring `needed` more groups with a spread (see `prompts_to_generate`)."""
        target = self.args.generation_batch_size // self.num_generations
        m = self._prompt_multiple
        cap = max(m, int(self.args.max_oversample_factor * target) // m * m)
        return prompts_to_generate(needed, self.keep_rate, self.args.shortfall_probability, m, cap)

    def _prompt_key(self, index: int) -> str:
        return repr(self._refill_source()[int(index)]["prompt"])

    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self.args.dynamic_sampling):
            return super()._generate_and_score_completions(inputs)
        self.beta = 1.0 if self.needs_reference else 0.0  # as the base does: reference log-probs iff needed
        G = self.num_generations
        world = self.accelerator.num_processes
        pad_id = self._tokenizer.pad_token_id
        target = self.args.generation_batch_size // G
        multiple = selection.group_multiple(G, world, self.args.steps_per_generation)
        acc = GroupAccumulator(target, G, multiple, self.args.filter_std_eps, self.accelerator.process_index, world)
        metrics = self._metrics["train"]
        generated_tokens = 0.0
        max_rounds = self.args.max_generation_rounds
        rate_used = self.keep_rate
        # First round: the dataloader's batch, over-sampled with refill prompts in the same generation call when
        # the keep-rate estimate says the batch alone would likely fall short. Every process sizes it from the same
        # estimate, hence identically.
        first_round = max(target, self._round_prompts(target))
        seen = None
        round_inputs = inputs
        if first_round > target:
            everyone = gather_object([dict(x) for x in inputs])  # the dataloader's batch of every process, in order
            seen = {repr(x["prompt"]) for x in everyone}
            indices = self._refill_sampler.draw(first_round - target, key=self._prompt_key, seen=seen)
            round_inputs = self._refill_rows(indices, head=everyone)
        refill_prompts = 0
        while True:
            output = GRPOTrainer._generate_and_score_completions(self, round_inputs)
            rewards_per_func = self._captured_rewards_per_func
            self.track_scorable(rewards_per_func)  # each round is a generation batch (max_unscorable_batches)
            rows = selection.row_entries(output, output["prompt_ids"].shape[0])
            lengths = metrics.get("completions/mean_length")
            if lengths:  # TRL's count of generated tokens (also those of truncated completions it may mask)
                generated_tokens += lengths[-1] * rewards_per_func.shape[0]
            else:
                generated_tokens += float(self.accelerator.reduce(rows["completion_mask"].sum(), reduction="sum"))
            spread_before, generated_before = acc.groups_with_spread, acc.groups_generated
            acc.add_round(rows, rewards_per_func, self.filter_values(rewards_per_func))
            self._keep_rate_state = update_keep_rate(
                self._keep_rate_state, acc.groups_with_spread - spread_before, acc.groups_generated - generated_before,
                self.args.keep_rate_smoothing)
            del output, rows
            # every rank holds the same gathered rewards, hence takes the same decision here
            if acc.full or (max_rounds and acc.rounds >= max_rounds):
                break
            if seen is None:  # prompts of this step's first round, on every process
                seen = set(gather_object(sorted({repr(x["prompt"]) for x in inputs})))
            count = self.args.refill_num_prompts or self._round_prompts(target - acc.num_kept)
            refill_prompts += count
            indices = self._refill_sampler.draw(count, key=self._prompt_key, seen=seen)
            round_inputs = self._refill_rows(indices)

        local, sources, rewards_per_func, positions, real_rows, exhausted = acc.finalize(pad_id)
        rewards = self.total_rewards(rewards_per_func)
        advantages = torch.zeros_like(rewards)
        if real_rows:  # placeholder groups of the exhaustion path stay at 0 and never enter the statistics
            self.advantage_rewards_per_func = rewards_per_func[:real_rows]
            advantages[:real_rows] = self.compute_advantages(rewards[:real_rows], None, G)
            self.advantage_rewards_per_func = None
        if not torch.isfinite(advantages).all():
            raise FloatingPointError(f"{type(self).__name__}.compute_advantages returned non-finite advantages")
        # trained (real-row) loss tokens, for the generated/trained ratio; placeholder rows have no signal
        rank = self.accelerator.process_index
        is_real = (torch.arange(sources.numel(), device=sources.device) < real_rows)[sources == rank]
        tokens = selection.loss_mask(local)
        trained_tokens = float(self.accelerator.reduce(tokens[is_real.to(tokens.device)].sum(), reduction="sum"))
        output = selection.redistribute_rows(self.accelerator, local, sources, pad_id,
                                             pad_to_multiple_of=self.pad_to_multiple_of)
        share = advantages.shape[0] // world
        output["advantages"] = advantages[rank * share : (rank + 1) * share]
        self._log_advantages(advantages, acc.rows_seen, positions)

        metrics["dapo/rounds"].append(float(acc.rounds))
        metrics["dapo/groups_generated"].append(float(acc.groups_generated))
        metrics["dapo/groups_kept"].append(float(real_rows // G))
        metrics["dapo/frac_dropped_all_correct"].append(acc.dropped_correct / acc.groups_generated)
        metrics["dapo/frac_dropped_all_wrong"].append(acc.dropped_wrong / acc.groups_generated)
        metrics["dapo/gen_tokens_per_trained_token"].append(
            generated_tokens / trained_tokens if trained_tokens > 0 else float("nan"))
        metrics["dapo/exhausted"].append(float(exhausted))
        metrics["dapo/padded_groups"].append(float((advantages.shape[0] - real_rows) // G))
        metrics["dapo/keep_rate_estimate"].append(rate_used)
        metrics["dapo/first_round_prompts"].append(float(first_round))
        metrics["dapo/refill_prompts"].append(float(refill_prompts))
        metrics["dapo/prompts_per_round"].append((first_round + refill_prompts) / acc.rounds)
        metrics["dapo/trimmed_groups"].append(float(max(acc.groups_with_spread - target, 0)))
        if exhausted and not self._warned_exhausted:
            self._warned_exhausted = True
            if self.accelerator.is_main_process:
                warnings.warn(
                    f"DAPO dynamic sampling: {acc.num_kept} of the {target} groups with a reward spread after "
                    f"{acc.rounds} generation rounds (max_generation_rounds={max_rounds}, {acc.groups_generated} "
                    f"groups generated, {acc.dropped_correct} all-correct and {acc.dropped_wrong} all-wrong dropped); "
                    f"training this step on {real_rows // G} groups"
                    + (f" plus {(advantages.shape[0] - real_rows) // G} zero-advantage placeholder groups"
                       if advantages.shape[0] > real_rows else "")
                    + ". The data may be too easy or too hard; see the 'dapo/exhausted' metric. Warned once.",
                    stacklevel=2,
                )
        return output

    # -------------------------------------------------------------------------------------------- checkpoints
    # The refill position travels in the base class's per-process checkpoint state, written before the checkpoint's
    # completion marker: a run killed mid-save never leaves a "complete" checkpoint without it.
    def extra_state(self) -> dict:
        state = super().extra_state()
        if self._refill_sampler is not None:
            state["dapo_refill_sampler"] = self._refill_sampler.state_dict()
            state["dapo_keep_rate"] = list(self._keep_rate_state)
        return state

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        if self._refill_sampler is not None and "dapo_refill_sampler" in state:
            self._refill_sampler.load_state_dict(state["dapo_refill_sampler"])
        if self._refill_sampler is not None and "dapo_keep_rate" in state:  # absent from older checkpoints
            self._keep_rate_state = tuple(float(x) for x in state["dapo_keep_rate"])
