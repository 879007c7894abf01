"""Choosing prompts before (and while) generating their groups: dynamic sampling, SPEED screening, GRESO skipping.

One idea, one loop (`PromptSelection.generate`), run inside one `_generate_and_score_completions` call:

    choose prompts -> generate -> score -> keep some groups -> refill until the batch is full

- *Dynamic sampling* (DAPO, arXiv 2503.14476, Eq. 11): generate the G completions of every chosen prompt, keep the
  groups whose reward has a spread, refill with fresh prompts.
- *SPEED* (Zhang et al., "SPEED-RL: Faster Training of Reasoning Models via Online Curriculum Learning", arXiv
  2506.09016): generate only `N_init = screening_num_generations` completions of a new prompt first (screening); a
  prompt whose screening pass rate is strictly between 0 and 1 (a reward spread) is *accepted*, and its other
  `G - N_init` completions are generated in the next round, batched in the same `generate` call as the screening of
  the next candidates. The screening completions are part of the group (nothing generated for a kept prompt is thrown
  away), so the group has a spread by construction. The authors' code (github.com/Zanette-Labs/speed-rl) screens
  with 4 completions and completes with 20 (their 7B RLOO runs) or 12 (their default); the rule is the same.
- *GRESO* (Zheng et al., "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
  Rollouts", arXiv 2506.02177): before any generation, skip a prompt whose last `z` groups in a row had no spread
  with probability `1 - max(p^z, 0.01)`, where `p` is an exploration probability kept apart for the easy
  (all-correct) and the hard (all-wrong) prompts and adapted after every step towards a target share of no-spread
  groups among those generated (25%, a third of it easy, two thirds hard), by +-0.01 within [0.05, 0.95] from 0.5
  (the defaults of the authors' code, github.com/Infini-AI-Lab/GRESO). The per-prompt history is saved in
  checkpoints.

Every variant keeps DAPO's machinery: the rounds are sized from a keep-rate estimate (`selection.prompts_to_generate`;
with SPEED the estimate is the screening acceptance rate), the batch is assembled by `selection.GroupAccumulator`
(each process holds only its own rows; `rollout.redistribute_rows` moves them to the process that trains them),
and a step that reaches `max_generation_rounds` without a full batch trains on what it has (`exhausted` path).

Where the papers were silent or we chose:
- All the rounds of a step run inside one `_generate_and_score_completions` call, so every completion of a group is
  sampled from the same policy weights (TRL syncs vLLM weights only when the optimizer step changes). SPEED's code
  carries accepted prompts over to the next training step (their continuations then come from newer weights); we do
  not: an accepted prompt is completed in the same step or let go. With `steps_per_generation > 1` the whole
  generation batch (all its rounds) is sampled once from the weights of its first optimizer step, exactly as TRL's
  generation batch is; the later slices are trained off-policy as in TRL.
- A round mixes screenings (`N_init` rows a prompt) and completions (`G - N_init` rows) in one TRL call: TRL is
  called with `num_generations` set to `b = gcd(N_init, G)` for that call, every prompt's rows being `b`-row blocks,
  so that vLLM server mode (which asks for `num_generations` samples per unique prompt) stays correct; colocate
  mode and HF `generate` sample row by row anyway. TRL's `frac_reward_zero_std` of such a round (over `b`-row
  blocks) is replaced by the share of screenings without a spread.
- GRESO's history is keyed by the content of the data-set row (a hash of all its columns), not its index: a duplicate
  row shares its history (it is the same prompt with the same reward), several epochs accumulate on the same key, and
  a streaming data set works the same. A prompt is easy or hard by the sign of its group's common value (DAPO's
  convention: > 0 is all-correct). GRESO updates the history with the groups it generates; with SPEED a rejected
  screening (no spread among `N_init` samples) counts as a no-spread group. The exploration probabilities adapt only
  in steps that saw a prompt with a history (GRESO's code adapts from its second epoch on).
- Overlapped generation (`max_staleness >= 1`): a step's first round is planned when its request is queued, a
  step or more ahead (`PromptSelection.reserve`): sized from the keep-rate estimate of then, its refill prompts drawn
  then. The later rounds of a step are requested when they come, with the current policy: they depend on the first
  round's rewards. GRESO is not planned ahead (its skipping reads the history the steps in between write): every
  request of a GRESO step is made when it comes.
- Skipping is decided with a generator seeded from `seed` and the global step: identical on every process and
  reproduced on resume. A round that has drawn 100 candidates per prompt it needs stops skipping (a data set of only
  skippable prompts still trains).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import warnings
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object

from . import rollout, selection
from .errors import check

#: values of `VariantConfig.prompt_selection`
SELECTION_MODES = ("none", "dynamic_sampling", "speed", "greso", "speed+greso")

#: GRESO's floor on the probability of keeping a prompt (its code: `1 - max(p ** z, 0.01)` is the skip probability)
GRESO_MIN_KEEP_PROBABILITY = 0.01
#: a round stops skipping (GRESO) once it has drawn this many candidates per prompt it needs
GRESO_MAX_DRAWS_PER_PROMPT = 100
#: SPEED's screening size in the authors' runs (N_init = 4 with N = 16 or 24)
SPEED_SCREENING_SIZE = 4
#: buffer of the shuffled refill stream over an `IterableDataset`
STREAM_SHUFFLE_BUFFER = 1000


# ----------------------------------------------------------------------------------------------- config
@dataclass
class PromptSelectionFields:
    r"""
    Config fields of the trainers whose estimator uses groups (GRPO, RLOO, REINFORCE++-baseline, DAPO, process GRPO):
    the pre-generation selection of [`~trl_ppo_variants.screening`], turned on by `prompt_selection` (a field of
    every config, refused with a one-line reason by the others). The fields below tune it; DAPO's dynamic sampling is
    the same loop.

    Parameters:
        screening_num_generations (`int` or `None`, *optional*, defaults to `None`):
            SPEED's `N_init`: completions generated per new prompt to screen it, in `[2, num_generations)`. `None`:
            4 (SPEED's runs) when `num_generations >= 8`, else `num_generations // 2` (at least 2).
        filter_metric (`str`, *optional*, defaults to `"reward"`):
            What must vary within a group (or a screening) for it to be kept. `"reward"`: the weighted sum of the
            reward functions (DAPO: without its overlong shaping; process GRPO: the outcome rewards plus each step
            source's summed step rewards). Or the name of one reward function (its raw value).
        filter_std_eps (`float`, *optional*, defaults to `1e-6`):
            A group is kept when the sample std of its `filter_metric` is > this (not `== 0`: float noise).
        max_generation_rounds (`int`, *optional*, defaults to `10`):
            Generation rounds (`generate` calls) per step at most. `0` means unlimited, as in the DAPO paper, which
            loops forever on a data set where no group ever has a spread. When the limit is reached without a full
            batch, the step trains on the groups it has. SPEED needs at least 2 (screen, then complete).
        refill_num_prompts (`int`, *optional*):
            New prompts per refill round. `None`: sized from the keep-rate estimate to the groups still missing (see
            `shortfall_probability`). `refill_num_prompts * num_generations` must split evenly over the processes.
        keep_rate_init (`float`, *optional*, defaults to `1.0`):
            Keep-rate estimate (fraction of new prompts whose group, or screening, has a spread) before any has been
            scored. `1.0`: no over-sampling until a keep rate has been observed.
        keep_rate_smoothing (`float`, *optional*, defaults to `0.1`):
            Weight of the newest round in the keep-rate estimate, an exponentially weighted ratio of (prompts with a
            spread) / (prompts generated) over the rounds so far. Saved in checkpoints.
        shortfall_probability (`float`, *optional*, defaults to `0.2`):
            Each round is sized so that, if the keep rate were the estimate, the probability that it brings fewer
            groups with a spread than still needed is at most this (binomial tail).
        max_oversample_factor (`float`, *optional*, defaults to `2.0`):
            A round screens (or generates) at most this many times `generation_batch_size // num_generations` new
            prompts (it bounds the memory of one round).
        greso_exploration_init (`float`, *optional*, defaults to `0.5`):
            GRESO's initial exploration probabilities `p_easy` and `p_hard` (a prompt with `z` no-spread groups in a
            row is kept with probability `max(p ** z, 0.01)`). Saved in checkpoints.
        greso_exploration_min (`float`, *optional*, defaults to `0.05`):
            Lower bound of the exploration probabilities (GRESO's `min_p`).
        greso_exploration_max (`float`, *optional*, defaults to `0.95`):
            Upper bound of the exploration probabilities (GRESO's `max_p`).
        greso_exploration_step (`float`, *optional*, defaults to `0.01`):
            Change of an exploration probability after each step (GRESO's step).
        greso_target_zero_variance (`float`, *optional*, defaults to `0.25`):
            Target share of no-spread groups among those generated in a step; a third of it is the easy target, two
            thirds the hard one (GRESO explores hard prompts more, they are likelier to become useful). Above its
            target, a kind's exploration probability decreases (more skipping), below it increases.
    """

    screening_num_generations: int | None = field(
        default=None, metadata={"help": "SPEED's N_init: completions that screen a new prompt; None: 4 (SPEED's) "
                                        "for groups of 8 or more, else half the group."})
    filter_metric: str = field(
        default="reward",
        metadata={"help": "'reward' (weighted reward; DAPO: without overlong shaping) or a reward function name."},
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
    greso_exploration_init: float = field(
        default=0.5, metadata={"help": "GRESO: initial exploration probabilities p_easy and p_hard (paper: 0.5)."}
    )
    greso_exploration_min: float = field(
        default=0.05, metadata={"help": "GRESO: lower bound of the exploration probabilities (paper: 0.05)."}
    )
    greso_exploration_max: float = field(
        default=0.95, metadata={"help": "GRESO: upper bound of the exploration probabilities (paper: 0.95)."}
    )
    greso_exploration_step: float = field(
        default=0.01, metadata={"help": "GRESO: change of an exploration probability per step (paper: 0.01)."}
    )
    greso_target_zero_variance: float = field(
        default=0.25, metadata={"help": "GRESO: target share of no-spread groups per step, 1/3 easy + 2/3 hard "
                                        "(paper: 0.25)."})

    def prompt_selection_refused(self) -> str | None:
        return None

    def selection_mode(self) -> str:
        """The selection this config runs in training: one of `SELECTION_MODES` ("none": plain generation)."""
        return self.prompt_selection

    def screening_size(self) -> int:
        """SPEED's `N_init` for this config (`num_generations` when SPEED is off: whole groups)."""
        if "speed" not in self.selection_mode():
            return self.num_generations
        if self.screening_num_generations is not None:
            return self.screening_num_generations
        return default_screening_size(self.num_generations)

    def __post_init__(self):
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
        check(0.0 < self.greso_exploration_min <= self.greso_exploration_max <= 1.0, "greso_exploration_min",
              f"a number in (0, greso_exploration_max={self.greso_exploration_max}]", self.greso_exploration_min)
        check(self.greso_exploration_min <= self.greso_exploration_init <= self.greso_exploration_max,
              "greso_exploration_init", f"a number in [{self.greso_exploration_min}, {self.greso_exploration_max}]",
              self.greso_exploration_init)
        check(0.0 <= self.greso_exploration_step < 1.0, "greso_exploration_step", "a number in [0, 1)",
              self.greso_exploration_step)
        check(0.0 <= self.greso_target_zero_variance <= 1.0, "greso_target_zero_variance", "a number in [0, 1]",
              self.greso_target_zero_variance)
        super().__post_init__()
        if self.screening_num_generations is not None:
            check(isinstance(self.screening_num_generations, int)
                  and 2 <= self.screening_num_generations < self.num_generations, "screening_num_generations",
                  f"None or an integer in [2, num_generations={self.num_generations}) (a screening needs two samples "
                  "to show a spread and must leave some to complete)", self.screening_num_generations)
        if "speed" in self.selection_mode():
            check(self.num_generations >= 3, "num_generations",
                  f"an integer >= 3 with prompt_selection={self.prompt_selection!r} (SPEED screens with at least 2 "
                  "samples and completes the group with the others)", self.num_generations)
            check(self.max_generation_rounds != 1, "max_generation_rounds",
                  f"0 or an integer >= 2 with prompt_selection={self.prompt_selection!r} (screen, then complete)",
                  self.max_generation_rounds)


# ----------------------------------------------------------------------------------------------- pure rules
def default_screening_size(group_size: int) -> int:
    """SPEED's `N_init` when not set: the authors' 4 for groups of 8 or more, else half the group (at least 2)."""
    return SPEED_SCREENING_SIZE if group_size >= 2 * SPEED_SCREENING_SIZE else max(2, group_size // 2)


def plan_round(screen: int, complete: int, screen_size: int, group_size: int, world: int) -> tuple[int, int]:
    """How many prompts a round screens and completes: `(s, c)` with `c <= complete` as large as possible, then
    `s >= screen` as small as possible, such that the round's rows `s * screen_size + c * (group_size -
    screen_size)` split evenly over `world` processes (TRL gives every process the same number of rows). Completions
    that do not fit wait for the next round; a round with nothing to screen may screen a few extra prompts to make
    its rows divide. (0, 0) when there is nothing to do."""
    if screen == 0 and complete == 0:
        return 0, 0
    rest = group_size - screen_size
    for c in range(complete, -1, -1):
        for s in range(screen, screen + world + 1):
            if s + c > 0 and (s * screen_size + c * rest) % world == 0:
                return s, c
    return 0, 0


def greso_skip_probability(streak: int, p_easy: float, p_hard: float,
                           min_keep: float = GRESO_MIN_KEEP_PROBABILITY) -> float:
    """GRESO's probability of skipping a prompt before generation: `1 - max(p ** z, min_keep)`, with `z` the number
    of its most recent groups in a row without a spread and `p` the exploration probability of their kind.

    Args:
        streak: `+z` for `z` all-correct (easy) groups in a row, `-z` for all-wrong (hard) ones, 0 when the last
            group had a spread or the prompt was never generated.
    """
    if streak == 0:
        return 0.0
    p = p_easy if streak > 0 else p_hard
    return 1.0 - max(p ** abs(streak), min_keep)


def next_streak(streak: int, outcome: str) -> int:
    """The streak after one more group: `outcome` is `"spread"`, `"easy"` or `"hard"` (see `greso_skip_probability`)."""
    if outcome == "easy":
        return streak + 1 if streak > 0 else 1
    if outcome == "hard":
        return streak - 1 if streak < 0 else -1
    return 0


def update_exploration(p: float, observed: float, target: float, step: float, low: float, high: float) -> float:
    """GRESO's adaptation after a step: a share of no-spread groups of this kind at or above its target makes
    skipping likelier (`p - step`), below it rarer (`p + step`), within `[low, high]`."""
    return max(p - step, low) if observed >= target else min(p + step, high)


def content_repr(value) -> str:
    """`repr(value)`, with every image inside it (PIL, in a column or a message part) written as a hash of its pixels:
    an image's own repr names its memory address, which differs between processes and runs (GRESO's history would
    then never match, and the processes would disagree on what to skip). Values without images: their repr."""
    if not _holds_image(value):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {content_repr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(content_repr(v) for v in value) + "]"
    digest = hashlib.blake2b(value.tobytes(), digest_size=8)
    digest.update(repr((value.mode, value.size)).encode())
    return f"<image {digest.hexdigest()}>"


def _holds_image(value) -> bool:
    if isinstance(value, dict):
        return any(_holds_image(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_image(v) for v in value)
    return hasattr(value, "tobytes") and hasattr(value, "getpixel")  # a PIL image (no import of PIL needed)


def row_key(row: dict) -> str:
    """GRESO's history key of a data-set row: a hash of all its columns, images by their pixels (see the module
    docstring)."""
    text = repr(sorted((str(k), content_repr(v)) for k, v in row.items()))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def prompt_key(row: dict) -> str:
    """What makes two rows the same prompt for the refills' freshness check (DAPO's: the prompt itself, with its
    images: the same question about another image is another prompt)."""
    images = [row[c] for c in ("image", "images") if row.get(c) is not None]
    return content_repr(row.get("prompt")) + "".join(content_repr(i) for i in images)


# ----------------------------------------------------------------------------------------------- prompt sources
class IndexedPrompts:
    """Refill prompts of an indexable data set: a `selection.RefillSampler` over it."""

    def __init__(self, dataset, seed: int, shuffle: bool):
        self.dataset = dataset
        self.sampler = selection.RefillSampler(len(dataset), seed, shuffle=shuffle)

    def draw(self, k: int, seen: set) -> list[dict]:
        indices = self.sampler.draw(k, key=lambda i: prompt_key(self.dataset[int(i)]), seen=seen)
        return [dict(self.dataset[int(i)]) for i in indices]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class StreamPrompts:
    """Refill prompts of an `IterableDataset`: the next records of the stream itself, read by an iterator of its own
    (every process reads the same records: the stream must be deterministic, as TRL's own sharding of it requires).
    When the trainer shuffles (`shuffle_dataset`) and the stream can shuffle (`datasets.IterableDataset.shuffle`), that
    iterator reads it shuffled with `seed + RefillSampler.SEED_OFFSET` (a buffer of `STREAM_SHUFFLE_BUFFER` records),
    so it does not replay the dataloader's order; each pass is a new epoch (`set_epoch`). The position (epoch,
    records read) is the state; resuming skips the records already read."""

    def __init__(self, dataset, seed: int, shuffle: bool):
        self.dataset = dataset
        if shuffle and hasattr(dataset, "shuffle"):
            self.dataset = dataset.shuffle(seed=seed + selection.RefillSampler.SEED_OFFSET,
                                           buffer_size=STREAM_SHUFFLE_BUFFER)
        self.epoch, self.offset = 0, 0
        self.pass_length = None  # records per pass, once a pass has ended
        self._iterator = None

    def _open(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        self._iterator = itertools.islice(iter(self.dataset), self.offset, None)

    def _next(self) -> dict:
        if self._iterator is None:
            self._open()
        for attempt in range(2):
            try:
                row = next(self._iterator)
                self.offset += 1
                return dict(row)
            except StopIteration:
                if attempt == 0 and self.offset == 0:
                    break
                self.pass_length = self.offset
                self.epoch, self.offset = self.epoch + 1, 0
                self._open()
        raise ValueError("train_dataset: expected a stream with at least one record to refill from, got an empty one")

    def draw(self, k: int, seen: set) -> list[dict]:
        """Next `k` records, skipping prompts in `seen` (as `RefillSampler.draw`: it gives up skipping after one
        pass's worth of skips, or 1000 skips while the stream's length is unknown)."""
        return selection.draw_fresh(self._next, k, prompt_key, seen, skip_limit=lambda: self.pass_length or 1000)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "stream": True}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._iterator = None


# ----------------------------------------------------------------------------------------------- the loop
class PromptSelection:
    """The dynamic-batch loop of a trainer (see the module docstring); `generate(inputs)` replaces TRL's
    `_generate_and_score_completions` in training. Its state (refill position, keep-rate estimate, GRESO's history
    and exploration probabilities) travels in the trainer's checkpoints (`state_dict`)."""

    def __init__(self, trainer):
        self.trainer = trainer
        args = trainer.args
        self.mode = args.selection_mode()
        self.speed = "speed" in self.mode
        self.greso = "greso" in self.mode
        G, world = trainer.num_generations, trainer.accelerator.num_processes
        # the group size, kept: a round swaps the trainer's `num_generations` for its block size while TRL generates,
        # and the next batch's first round is planned during that generation (`reserve`)
        self.group_size = G
        self.screen_size = args.screening_size()
        self.block = math.gcd(self.screen_size, G)
        if args.refill_num_prompts is not None:
            check(args.refill_num_prompts * self.screen_size % world == 0, "refill_num_prompts",
                  f"a value whose rows (x {self.screen_size} completions per new prompt) split evenly over {world} "
                  "processes", args.refill_num_prompts)
        # new prompts per round come in multiples of this, so that a round's new rows split evenly over the processes
        self.prompt_multiple = world // math.gcd(self.screen_size, world)
        self.source = self._make_source(trainer)
        self.keep_rate_state = (0.0, 0.0)  # see `selection.update_keep_rate`; the same on every process
        self.history: dict[str, int] = {}  # GRESO: row key -> streak (see `greso_skip_probability`)
        self.p_easy = self.p_hard = float(args.greso_exploration_init)
        #: overlapped generation: micro-step -> the first round planned ahead for it (`reserve`)
        self.reserved: dict[int, dict] = {}
        self._warned_exhausted = False

    @staticmethod
    def _make_source(trainer):
        import datasets

        dataset = trainer.train_dataset
        shuffle = getattr(trainer, "shuffle_dataset", True)
        if isinstance(dataset, datasets.IterableDataset):
            return StreamPrompts(dataset, trainer.args.seed, shuffle)
        check(dataset is not None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"),
              "prompt_selection", "'none' without a train_dataset to refill from", trainer.args.selection_mode())
        if isinstance(dataset, datasets.Dataset):  # the columns the dataloader would yield (`remove_unused_columns`)
            dataset = trainer._remove_unused_columns(dataset, description="training")
        return IndexedPrompts(dataset, trainer.args.seed, shuffle)

    # -------------------------------------------------------------------------------- state
    @property
    def keep_rate(self) -> float:
        """The current keep-rate estimate (fraction of new prompts whose group, or screening, has a spread)."""
        return selection.keep_rate_estimate(self.keep_rate_state, self.trainer.args.keep_rate_init)

    def state_dict(self) -> dict:
        # a reserved first round is saved as its plan and where its prompts were drawn from, not as rows (rows may
        # hold images): a resumed run draws them again from there (`_reserved_prompts`)
        reserved = {str(k): {n: v for n, v in r.items() if n != "rows"} for k, r in self.reserved.items()}
        return {"source": self.source.state_dict(), "keep_rate": list(self.keep_rate_state),
                "history": dict(self.history), "exploration": [self.p_easy, self.p_hard], "reserved": reserved}

    def load_state_dict(self, state: dict) -> None:
        if "source" in state:
            self.source.load_state_dict(state["source"])
        if "keep_rate" in state:
            self.keep_rate_state = tuple(float(x) for x in state["keep_rate"])
        self.history = {str(k): int(v) for k, v in state.get("history", {}).items()}
        if "exploration" in state:
            self.p_easy, self.p_hard = (float(x) for x in state["exploration"])
        self.reserved = {int(k): dict(r) for k, r in state.get("reserved", {}).items()}

    # -------------------------------------------------------------------------------- the first round, planned ahead
    def plan_first_round(self) -> dict:
        """A step's first round as the keep-rate estimate of now sizes it: `first_round` new prompts (the batch's
        and refill prompts; every process sizes it alike and its rows split evenly) and the estimate `rate`."""
        t = self.trainer
        G, world = self.group_size, t.accelerator.num_processes
        target = t.args.generation_batch_size // G
        first = plan_round(max(target, self.round_prompts(target)), 0, self.screen_size, G, world)[0]
        return {"first_round": first, "rate": self.keep_rate}

    def is_the_batch(self, plan: dict) -> bool:
        """Whether a first round so planned is the dataloader's batch as TRL lays it out: whole groups of the
        batch's prompts only, nothing gathered (never with SPEED's screenings)."""
        G = self.group_size
        return not self.speed and plan["first_round"] == self.trainer.args.generation_batch_size // G

    def reserve(self, rows: list, step: int) -> tuple[list, int]:
        """Overlapped generation (`max_staleness >= 1`; not with GRESO, whose skipping reads the history of the
        steps in between): plan now the first round of the generation batch that micro-step `step` will generate
        (`rows`: this process's rows of it, read ahead), so that its request is queued while the steps before it
        train. The round is sized from the estimate of now and its refill prompts are drawn now; the plan is kept
        (`reserved`, and in checkpoints) and used when the batch comes. Every process calls it, in the same order
        (it gathers). Returns this process's rows of the round and the completions a prompt of its request."""
        plan = self.reserved.get(step)
        if plan is None:
            plan = self.reserved[step] = self.plan_first_round()
        if self.is_the_batch(plan):
            return rows, self.group_size
        heads = gather_object([dict(x) for x in rows])[:: self.group_size]
        chosen = self._reserved_prompts(plan, heads)
        return self._layout(list(enumerate(chosen)), [])[0], self.block

    def _reserved_prompts(self, plan: dict, heads: list) -> list[dict]:
        """The prompts of a reserved first round: the batch's (`heads`) and the refill prompts drawn for it, drawn
        once from the refill source (its position before is kept); after a resume, drawn again from that position
        with a copy of the source, so the resumed run's round is the uninterrupted one's."""
        if "rows" not in plan:
            seen = {prompt_key(x) for x in heads}
            count = plan["first_round"] - len(heads)
            if "source" in plan:
                source = self._make_source(self.trainer)
                source.load_state_dict(plan["source"])
            else:
                source = self.source
                plan["source"] = copy.deepcopy(source.state_dict())
            plan["rows"] = source.draw(count, seen)
        return heads + plan["rows"]

    # -------------------------------------------------------------------------------- choosing prompts
    def round_prompts(self, needed: int) -> int:
        """New prompts for a round that must bring `needed` more groups with a spread (`prompts_to_generate`)."""
        args = self.trainer.args
        target = args.generation_batch_size // self.group_size
        m = self.prompt_multiple
        cap = max(m, int(args.max_oversample_factor * target) // m * m)
        return selection.prompts_to_generate(needed, self.keep_rate, args.shortfall_probability, m, cap)

    def _skip(self, rows: list[dict], step: dict) -> list[dict]:
        """GRESO's pre-generation filter: the rows that survive (one seeded draw per row, in order)."""
        kept = []
        for row in rows:
            key = row_key(row)
            if key in self.history:
                step["had_history"] = True
            p = greso_skip_probability(self.history.get(key, 0), self.p_easy, self.p_hard)
            if float(torch.rand((), generator=step["rng"])) < p:
                step["skipped"] += 1
            else:
                kept.append(row)
        return kept

    def _draw(self, k: int, seen: set, step: dict) -> list[dict]:
        """`k` fresh prompts from the refill source, GRESO-filtered when it is on."""
        if not self.greso:
            return self.source.draw(k, seen)
        out, draws = [], 0
        while len(out) < k:
            batch = self.source.draw(k - len(out), seen)
            draws += len(batch)
            out += batch if draws > GRESO_MAX_DRAWS_PER_PROMPT * k else self._skip(batch, step)
        return out

    # -------------------------------------------------------------------------------- one round
    def _layout(self, screen: list, complete: list) -> tuple[list, list]:
        """This process's rows of a round and the round's segments: every screened prompt `screen_size` times, then
        every completed one `G - screen_size` times, the global list split in equal contiguous shares."""
        t = self.trainer
        G, world, rank = self.group_size, t.accelerator.num_processes, t.accelerator.process_index
        kind = "screen" if self.speed else "group"
        segments = [selection.Segment(key, kind, self.screen_size) for key, _ in screen]
        segments += [selection.Segment(key, "complete", G - self.screen_size) for key, _ in complete]
        rows = [row for (_, row), seg in zip(screen + complete, segments) for _ in range(seg.rows)]
        share = len(rows) // world
        return [dict(r) for r in rows[rank * share : (rank + 1) * share]], segments

    def _generate_round(self, round_inputs: list, segments: list | None) -> dict:
        """TRL's own generation and scoring of a round (its `num_generations` set to the round's block size)."""
        t = self.trainer
        # a round is a generation batch for `max_unscorable_batches`; its prompts are its segments' (rows / block
        # would count a screened prompt N_init / block times), named by TRL's micro-step of this generation batch
        # and their key within it, shared by a screening and its completion
        prompts = None if segments is None else [(t._step, segment.key) for segment in segments]
        saved, t.num_generations = t.num_generations, self.block
        try:
            output = t.score_rollout(round_inputs, prompts)
        finally:
            t.num_generations = saved
        return output

    # -------------------------------------------------------------------------------- the step
    def generate(self, inputs: list) -> dict:
        """One generation batch: rounds of generation until `generation_batch_size // num_generations` groups with
        a spread are held (or `max_generation_rounds` is reached), then advantages on the kept groups."""
        t, args = self.trainer, self.trainer.args
        G = t.num_generations
        world, rank = t.accelerator.num_processes, t.accelerator.process_index
        pad_id = t._tokenizer.pad_token_id
        target = args.generation_batch_size // G
        multiple = selection.group_multiple(G, world, args.steps_per_generation)
        acc = selection.GroupAccumulator(target, G, multiple, args.filter_std_eps, rank, world)
        metrics = t._metrics["train"]
        max_rounds = args.max_generation_rounds
        # overlapped generation planned (and queued) this step's first round ahead; else it is planned now
        for old in [k for k in self.reserved if k < t._step]:
            del self.reserved[old]  # planned for a batch that never came (the run stopped before it)
        plan = self.reserved.pop(t._step, None)
        reserved = plan is not None
        if not reserved:
            plan = self.plan_first_round()
        first_round, rate_used = plan["first_round"], plan["rate"]
        step = {"rng": torch.Generator().manual_seed(int(args.seed) * 1_000_003 + int(t.state.global_step)),
                "skipped": 0, "had_history": False, "easy": 0, "hard": 0}
        rows_of = {}  # key -> data-set row of every prompt started this step
        refill_prompts = 0
        generated_tokens = 0.0
        seen = None
        while True:
            if acc.rounds == 0:
                if not self.greso and self.is_the_batch(plan):
                    # the dataloader's batch as TRL laid it out: whole groups, nothing gathered
                    round_inputs, segments, screen, complete = inputs, None, [], []
                else:
                    everyone = gather_object([dict(x) for x in inputs])  # every process's rows, in order
                    heads = everyone[::G]
                    if reserved:
                        chosen = self._reserved_prompts(plan, heads)
                        seen = {prompt_key(x) for x in chosen}
                    else:
                        seen = {prompt_key(x) for x in heads}
                        chosen = self._skip(heads, step) if self.greso else heads
                        chosen += self._draw(first_round - len(chosen), seen, step)
                    screen, complete = list(enumerate(chosen)), []
            else:
                if seen is None:  # prompts of this step's first round, on every process
                    seen = set(gather_object(sorted({prompt_key(x) for x in inputs})))
                needed = target - acc.num_kept
                pending = acc.pending_keys()
                last = max_rounds and acc.rounds == max_rounds - 1
                wanted = needed - len(pending)
                count = 0
                if wanted > 0 and not (self.speed and last):  # a screening in the last round could not complete
                    count = args.refill_num_prompts or self.round_prompts(wanted)
                count, n_complete = plan_round(count, min(len(pending), needed), self.screen_size, G, world)
                if count == 0 and n_complete == 0:
                    break
                refill_prompts += count
                new = self._draw(count, seen, step)
                base = len(rows_of)
                screen = [(base + i, row) for i, row in enumerate(new)]
                complete = [(key, rows_of[key]) for key in pending[:n_complete]]
            if screen or complete:
                rows_of.update(screen)
                round_inputs, segments = self._layout(screen, complete)
            output = self._generate_round(round_inputs, segments)
            rewards_per_func = t._captured_rewards_per_func
            kl = t._reward_kl(output)
            if kl is not None:
                output["kl_in_reward"] = kl
            rows = rollout.row_entries(output, output["prompt_ids"].shape[0])
            lengths = metrics.get("completions/mean_length")
            if lengths:  # TRL's count of generated tokens (also those of truncated completions it may mask)
                generated_tokens += lengths[-1] * rewards_per_func.shape[0]
            else:
                generated_tokens += float(t.accelerator.reduce(rows["completion_mask"].sum(), reduction="sum"))
            result = acc.add_round(rows, rewards_per_func, t.filter_values(rewards_per_func), segments,
                                   t.selection_scores())
            del output, rows
            if self.block != G and metrics.get("frac_reward_zero_std"):  # TRL's value was over b-row blocks
                metrics["frac_reward_zero_std"].pop()
                if result.screened:
                    metrics["frac_reward_zero_std"].append(1.0 - result.with_spread / result.screened)
            self.keep_rate_state = selection.update_keep_rate(
                self.keep_rate_state, result.with_spread, result.screened, args.keep_rate_smoothing)
            self._record(result, rows_of, step)
            # every rank holds the same gathered rewards, hence takes the same decision here
            if acc.full or (max_rounds and acc.rounds >= max_rounds):
                break
        return self._finish(acc, generated_tokens, step, rate_used, first_round, refill_prompts, pad_id)

    def _record(self, result, rows_of: dict, step: dict) -> None:
        """GRESO's history and this step's counts of no-spread groups (the exploration targets)."""
        for key, outcome in result.outcomes:
            step["easy"] += outcome == "easy"
            step["hard"] += outcome == "hard"
            if self.greso and key in rows_of:  # (an informative prompt keeps its entry, at 0: it has a history)
                hkey = row_key(rows_of[key])
                self.history[hkey] = next_streak(self.history.get(hkey, 0), outcome)

    def _finish(self, acc, generated_tokens, step, rate_used, first_round, refill_prompts, pad_id) -> dict:
        t, args = self.trainer, self.trainer.args
        G = t.num_generations
        world, rank = t.accelerator.num_processes, t.accelerator.process_index
        target = args.generation_batch_size // G
        local, sources, rewards_per_func, positions, real_rows, exhausted = acc.finalize(pad_id)
        extras = {k: v[:real_rows] for k, v in acc.final_extras.items()}
        # trained (real-row) loss tokens, for the generated/trained ratio; placeholder rows have no signal
        is_real = (torch.arange(sources.numel(), device=sources.device) < real_rows)[sources == rank]
        tokens = rollout.loss_mask(local)
        trained_tokens = float(t.accelerator.reduce(tokens[is_real.to(tokens.device)].sum(), reduction="sum"))
        output = rollout.redistribute_rows(t.accelerator, local, sources, pad_id,
                                           pad_to_multiple_of=t.pad_to_multiple_of)
        share = sources.numel() // world
        global_batch = None
        if t.needs_global_batch or "kl_in_reward" in output:
            needed = {key: output[key] for key in t.global_batch_keys if key in output}
            global_batch = rollout.gather_rollout(t.accelerator, needed, share, pad_id)
            output.pop("kl_in_reward", None)
        advantages = torch.zeros(sources.numel(), device=rewards_per_func.device)
        if real_rows:  # placeholder groups of the exhaustion path stay at 0 and never enter the statistics
            t.use_selection_scores(extras)
            batch = None if global_batch is None else {k: v[:real_rows] for k, v in global_batch.items()}
            real = t._advantages_for(rewards_per_func[:real_rows], batch, G)
            if real.dim() == 2:
                advantages = real.new_zeros((sources.numel(), real.shape[1]))
            advantages[:real_rows] = real
        local_adv = advantages[rank * share : (rank + 1) * share]
        if local_adv.dim() == 2:
            local_adv = local_adv[:, : output["completion_mask"].shape[1]]
        output["advantages"] = local_adv
        mask = rollout.loss_mask(global_batch) if global_batch and "completion_mask" in global_batch else None
        t._log_advantages(advantages, acc.rows_seen, positions, mask)
        self._log(acc, generated_tokens, trained_tokens, real_rows, advantages.shape[0], exhausted, rate_used,
                  first_round, refill_prompts, step)
        if self.greso and step["had_history"] and acc.groups_generated:
            zero = args.greso_target_zero_variance
            lo, hi, dp = args.greso_exploration_min, args.greso_exploration_max, args.greso_exploration_step
            self.p_easy = update_exploration(self.p_easy, step["easy"] / acc.groups_generated, zero / 3, dp, lo, hi)
            self.p_hard = update_exploration(self.p_hard, step["hard"] / acc.groups_generated, 2 * zero / 3, dp, lo,
                                             hi)
        if exhausted and not self._warned_exhausted:
            self._warned_exhausted = True
            if t.accelerator.is_main_process:
                padded = (advantages.shape[0] - real_rows) // G
                warnings.warn(
                    f"{self.label()}: {acc.num_kept} of the {target} groups with a reward spread after {acc.rounds} "
                    f"generation rounds (max_generation_rounds={args.max_generation_rounds}, {acc.groups_generated} "
                    f"prompts generated, {acc.dropped_correct} all-correct and {acc.dropped_wrong} all-wrong "
                    f"dropped); training this step on {real_rows // G} groups"
                    + (f" plus {padded} zero-advantage placeholder groups" if padded else "")
                    + f". The data may be too easy or too hard; see the '{t.selection_metric_prefix}/exhausted' "
                    "metric. Warned once.",
                    stacklevel=3,
                )
        return output

    def label(self) -> str:
        algo = type(self.trainer).__name__.removesuffix("Trainer")
        names = {"dynamic_sampling": "dynamic sampling", "speed": "SPEED screening", "greso": "GRESO selection",
                 "speed+greso": "SPEED screening with GRESO selection"}
        return f"{algo} {names[self.mode]}"

    def _log(self, acc, generated_tokens, trained_tokens, real_rows, num_rows, exhausted, rate_used, first_round,
             refill_prompts, step) -> None:
        G = self.trainer.num_generations
        metrics = self.trainer._metrics["train"]
        p = self.trainer.selection_metric_prefix
        generated = max(acc.groups_generated, 1)
        values = {
            "rounds": acc.rounds,
            "groups_generated": acc.groups_generated,
            "groups_kept": real_rows // G,
            "frac_dropped_all_correct": acc.dropped_correct / generated,
            "frac_dropped_all_wrong": acc.dropped_wrong / generated,
            "exhausted": float(exhausted),
            "padded_groups": (num_rows - real_rows) // G,
            "keep_rate_estimate": rate_used,
            "first_round_prompts": first_round,
            "refill_prompts": refill_prompts,
            "prompts_per_round": (first_round + refill_prompts) / acc.rounds,
            "trimmed_groups": max(acc.groups_with_spread - real_rows // G, 0),
            # the names: new prompts that got completions (screened), those with a spread (accepted), those
            # skipped before any generation (GRESO)
            "prompts_screened": acc.groups_generated,
            "prompts_accepted": acc.groups_with_spread,
            "prompts_skipped": step["skipped"],
        }
        if trained_tokens > 0:  # a step trained only on placeholder groups has no ratio (NaN would spoil the mean)
            values["gen_tokens_per_trained_token"] = generated_tokens / trained_tokens
        if self.greso:
            values.update(greso_p_easy=self.p_easy, greso_p_hard=self.p_hard, greso_history_size=len(self.history))
        for name, value in values.items():
            metrics[f"{p}/{name}"].append(float(value))


# ----------------------------------------------------------------------------------------------- trainer side
class PromptSelectionMixin:
    """Trainer mixin of the group estimators: `args.selection_mode()` other than "none" runs `PromptSelection`
    instead of TRL's one-shot generation in training (evaluation is unchanged). Put it before `VariantTrainer` in the
    bases; the config must have `PromptSelectionFields`.

    Hooks a trainer may override: `filter_values` (what must vary within a group), `selection_scores` /
    `use_selection_scores` (further per-row scores its estimator reads, e.g. process rewards' steps), and
    `selection_metric_prefix` (DAPO keeps its `dapo/` metrics)."""

    #: prefix of the selection metrics (`<prefix>/rounds`, ...)
    selection_metric_prefix = "selection"

    def __init__(self, model, reward_funcs=None, args=None, **kwargs):
        super().__init__(model, reward_funcs, args=args, **kwargs)
        metric = self.args.filter_metric
        check(metric == "reward" or metric in self.reward_func_names, "filter_metric",
              f"'reward' or one of {self.reward_func_names}", metric)
        self.prompt_selection = PromptSelection(self) if self.args.selection_mode() != "none" else None

    def filter_values(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The selection's filter metric per row: (N, F) -> (N,), NaN where unscorable."""
        if self.args.filter_metric != "reward":
            return rewards_per_func[:, self.reward_func_names.index(self.args.filter_metric)]
        return self.total_rewards(rewards_per_func)

    def selection_scores(self) -> dict:
        """Gathered per-row tensors of the round just scored that the estimator reads besides the rewards."""
        return {}

    def use_selection_scores(self, scores: dict) -> None:
        """Hand the estimator `selection_scores` of the kept rows (in the batch's order) before its advantages."""

    def prefetches_generation(self) -> bool:
        if self.prompt_selection is None or not self.prompt_selection.greso:
            return super().prefetches_generation()
        return False  # GRESO's skipping reads the history the steps in between write

    def prefetch_rows(self, rows: list, step: int) -> tuple[list, int]:
        if self.prompt_selection is None:
            return super().prefetch_rows(rows, step)
        return self.prompt_selection.reserve(rows, step)

    def _generate_and_score_completions(self, inputs):
        if not (self.model.training and self.prompt_selection is not None):
            return super()._generate_and_score_completions(inputs)
        self.use_reference_beta()  # as the base does: reference log-probs iff needed
        return self.prompt_selection.generate(inputs)

    # The selection's state travels in the base class's per-process checkpoint state, written before the
    # checkpoint's completion marker: a run killed mid-save never leaves a "complete" checkpoint without it.
    def extra_state(self) -> dict:
        state = super().extra_state()
        if self.prompt_selection is not None:
            state["prompt_selection"] = self.prompt_selection.state_dict()
        return state

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        if self.prompt_selection is None:
            return
        if "prompt_selection" in state:
            self.prompt_selection.load_state_dict(state["prompt_selection"])
        elif "dapo_refill_sampler" in state:  # DAPO checkpoints written before the selection was shared
            self.prompt_selection.load_state_dict({"source": state["dapo_refill_sampler"],
                                                   **({"keep_rate": state["dapo_keep_rate"]}
                                                      if "dapo_keep_rate" in state else {})})


__all__ = [
    "PromptSelection",
    "PromptSelectionFields",
    "PromptSelectionMixin",
    "SELECTION_MODES",
    "greso_skip_probability",
    "next_streak",
    "plan_round",
    "update_exploration",
]
