"""The one "keep some rows after scoring" step, shared by dynamic sampling (DAPO's, and the pre-generation selection of
`screening.py`: SPEED, GRESO) and TTRL's vote/train split.

Layers:
- pure functions on gathered (global) tensors that decide *which* rows to keep (`group_spread_mask`, `group_rows`,
  `group_multiple`, `exhausted_group_count`), and the sizing of a generation round from a keep-rate estimate
  (`update_keep_rate`, `keep_rate_estimate`, `prompts_to_generate`);
- `GroupAccumulator` (pure: no process group), which assembles one batch of whole groups from successive generation
  rounds, and `RefillSampler`, the seeded, resumable stream of data-set indices those rounds refill from;
- `redistribute_rows`, which hands every process its equal share of the selected rows, moving only rows between
  processes (one all-to-all per key): the decision is taken once on gathered rewards, identically on every rank, and
  every process ends with the same number of rows (TRL's collectives hang when ranks disagree);
- `gather_rollout` / `concat_rollouts`, which build the global view of (some entries of) a rollout batch (the dict
  TRL's `_generate_and_score_completions` returns) for estimators that need the whole batch (token-level whitening,
  KL in the reward), and join rollouts of several rounds.

A rollout dict holds per-row tensors whose first dimension is the local batch size B. Prompt-aligned tensors are
left-padded, completion-aligned tensors right-padded; both are re-padded when batches are joined and re-trimmed when
rows are handed back to a process. Any other per-row tensor of two or more dimensions is refused (its alignment is
unknown, so padding it would silently corrupt it).

Image inputs (vision-language models) are not row-aligned in TRL's layout: pixel_values is per patch (Qwen, with
image_grid_thw), per image (Gemma3, LLaVA), per tile (LFM2-VL, InternVL) or padded per row (Idefics), a prompt may have
0 or several images (num_images), token_type_ids / mm_token_type_ids span prompt and completion. `row_entries` packs
them into dense per-row entries (`pack_multimodal`), which every move above treats like any row tensor (a round or a
process without images gets rows without images; rows whose entries differ in size, LLaVA-NeXT's tiles of square and
2:1 images, are zero-padded in every dimension, and their per-row extents cut the padding again), and
`redistribute_rows` hands them back in TRL's layout (`unpack_multimodal`). A forward's chunks of rows take their own
images from the same packing (`image_chunks`: none for a chunk without an image). An image input of a layout TRL 1.16
does not produce is refused with its name.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

# Keys TRL puts in the rollout dict, by how they are laid out.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",  # (B, T), or (B, 1) for sequence-level importance sampling: never re-padded then
    "tool_mask",
    "kl_in_reward",
    "advantages",  # (B,) in TRL; (B, T) for token-level estimators
    "old_values",  # PPO/VAPO: the critic's rollout-time values, (B, T)
    "returns",  # PPO/VAPO: value targets, (B, T)
    "value_mask",  # PPO/VAPO: tokens with a value target, (B, T)
)
# TRL 1.16's image inputs of a rollout (`GRPOTrainer._generate_and_score_completions`), which its
# `_get_per_token_logps_and_entropies` slices per chunk of rows. Most are not row-aligned (pixel_values is per patch,
# image or tile); `row_entries` packs them into dense per-row tensors (`pack_multimodal`) so that rows and their
# images move together, and `redistribute_rows` hands them back in TRL's layout (`unpack_multimodal`).
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "num_images",
    "image_sizes",
    "spatial_shapes",
    "num_tiles",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
#: fragments of the names of image (or video) inputs: an entry so named that `MULTIMODAL_KEYS` does not list has a
#: layout this module does not know, and is refused rather than dropped
MULTIMODAL_NAME_PARTS = ("pixel", "image", "video", "grid_thw", "tile", "spatial", "token_type", "patch")
#: per-row counts TRL keeps as Python lists (one int per row)
COUNT_KEYS = ("num_images", "num_tiles")
#: per-token inputs spanning prompt and completion, (B, P + C): packed as a prompt and a completion part
SPANNING_KEYS = ("token_type_ids", "mm_token_type_ids")
#: prefix of the packed entries (never a TRL name: a rollout holds one layout or the other)
PACKED = "mm:"
# ----------------------------------------------------------------------------------------------- pure decisions
def group_spread_mask(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Which groups have a reward spread: sample std over the group's finite rewards > eps.

    DAPO's dynamic-sampling filter (arXiv 2503.14476, Eq. 11: keep groups with 0 < #correct < G). Compared against
    `eps`, not `== 0`: float noise in summed rewards passes an exact test. A group with fewer than two finite rewards
    has no spread.

    Args:
        rewards: (N,) NaN for unscorable rows; N a multiple of `group_size`.
    Returns:
        (N // G,) bool.
    """
    if rewards.dim() != 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards must be (N,) with N a multiple of group_size={group_size}, got {tuple(rewards.shape)}")
    grouped = rewards.reshape(-1, group_size).double()  # float64: the std of near-equal floats is what is tested
    finite = ~torch.isnan(grouped)
    count = finite.sum(dim=1)
    mean = torch.nansum(grouped, dim=1) / count.clamp(min=1)
    sq = torch.where(finite, (grouped - mean.unsqueeze(1)) ** 2, torch.zeros_like(grouped)).sum(dim=1)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return (count >= 2) & (std > eps)


def group_rows(group_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the given groups, in order: (K,) -> (K * G,)."""
    group_idx = group_idx.long()
    return (group_idx.unsqueeze(1) * group_size + torch.arange(group_size, device=group_idx.device)).reshape(-1)


def group_multiple(group_size: int, num_processes: int, steps_per_generation: int = 1) -> int:
    """Smallest number of groups m whose rows split evenly over the processes *and* then over TRL's
    `steps_per_generation` slices (TRL's `split_tensor_dict` silently drops a remainder): `m * G` must be a multiple of
    `num_processes * steps_per_generation`."""
    unit = num_processes * steps_per_generation
    return unit // math.gcd(group_size, unit)


def exhausted_group_count(num_kept: int, multiple: int) -> tuple[int, int]:
    """How many groups to train on when a batch could not be filled: `(num_real, num_pad)`.

    The real groups are rounded *down* to a multiple of `multiple` (never duplicated, never invented). When that
    leaves none, `multiple - num_kept` placeholder groups are padded in (trained with advantage 0: they only keep every
    process's row count equal and the step alive), so `num_real + num_pad == multiple`.
    """
    if multiple < 1 or num_kept < 0:
        raise ValueError(f"expected multiple >= 1 and num_kept >= 0, got {multiple} and {num_kept}")
    num_real = (num_kept // multiple) * multiple
    if num_real > 0:
        return num_real, 0
    return num_kept, multiple - num_kept


# ----------------------------------------------------------------------------------------------- round sizing
def update_keep_rate(state: tuple[float, float], with_spread: int, generated: int,
                     smoothing: float) -> tuple[float, float]:
    """One round into the keep-rate estimator: exponentially weighted sums of (groups with a spread, groups
    generated), `s <- (1 - a) s + a x`. `state` starts at (0, 0). Counts, not per-round rates, are averaged: a round
    of many groups says more than a round of few. (With SPEED screening the counts are prompts accepted and prompts
    screened.)"""
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
def draw_fresh(next_item, k: int, key, seen: set, skip_limit) -> list:
    """The next `k` items of `next_item()`, skipping those whose `key(item)` is in `seen` and adding the drawn keys to
    `seen`, so that a refill brings fresh prompts. Skipping stops once `skip_limit()` items were skipped (one pass over
    the data: a data set with fewer distinct prompts than a step needs), so it always returns `k` items; the limit is
    read at every skip, as a stream learns its length only when a pass ends."""
    out, skipped = [], 0
    while len(out) < k:
        item = next_item()
        item_key = key(item)
        if item_key in seen and skipped < skip_limit():
            skipped += 1
            continue
        seen.add(item_key)
        out.append(item)
    return out


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
        if key is None or seen is None:
            return [self._next() for _ in range(k)]
        return draw_fresh(self._next, k, key, seen, skip_limit=lambda: self.num_rows)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "offset": self.offset, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            warnings.warn(f"refill sampler: the checkpoint was saved for a data set of {state['num_rows']} rows, "
                          f"this one has {self.num_rows}; restoring the position anyway", stacklevel=2)
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


# ----------------------------------------------------------------------------------------------- batch assembly
class Segment(NamedTuple):
    """A run of consecutive rows of one prompt in a generation round.

    `kind`: `"group"` (a whole group of G rows: dynamic sampling), `"screen"` (the first rows of a prompt's group,
    SPEED's screening) or `"complete"` (the rest of the group of a prompt accepted by its screening). `key` names the
    prompt within the step (a screening and its completion share it)."""

    key: int
    kind: str
    rows: int


class RoundResult(NamedTuple):
    """What one round told: `accepted` (keys of the screenings with a spread, in order), `outcomes` ((key, outcome)
    for every "group" and "screen" segment: `"spread"`, `"easy"` (no spread, common value > 0) or `"hard"`),
    `screened` / `with_spread` (how many such segments, and how many had a spread: the keep-rate counts)."""

    accepted: list
    outcomes: list
    screened: int
    with_spread: int


class GroupAccumulator:
    """Assembles one batch of whole groups from successive generation rounds (pure: no process group).

    Each round is scored globally (rows in TRL's layout: the N rows of a round split into equal contiguous shares in
    process order) and described by its `Segment`s (default: whole groups of `G` rows). A "group" segment whose
    filter values have a spread (`group_spread_mask`) is kept; a "screen" segment with a spread is *accepted*: its
    rows are held until the "complete" segment of the same key arrives (in a later round of the same step), and the
    two make one group, screening rows first, which is kept (it has a spread: its screening rows do). Groups are kept
    in the order they become whole until `target_groups` are held; later ones are trimmed (the surplus). Every rank
    takes the same decisions from the same gathered rewards, but holds only *its own* rows of the held groups
    (`rank` of `world`), so no process ever stores the global rollout. A few dropped rows are remembered as
    placeholders for the exhaustion path (`exhausted_group_count`). Real rows are never duplicated.

    `extras`: further per-row tensors of a round, gathered (the same on every rank; e.g. a process reward's step
    rewards), carried along with the rewards; after `finalize`, `final_extras` holds them for the batch's rows
    (padded along dim 1 to the widest round, with NaN for floating tensors and 0 otherwise).
    """

    def __init__(self, target_groups: int, group_size: int, multiple: int = 1, eps: float = 1e-6, rank: int = 0,
                 world: int = 1):
        self.target, self.G, self.multiple, self.eps = target_groups, group_size, multiple, eps
        self.rank, self.world = rank, world
        # per held part of a round: this rank's rows, and for every held row (all ranks) its gathered rewards and
        # extras, its position among the rows generated this step and the process holding it
        self._parts = []
        self._kept = []  # groups kept: lists of row references (part, index in part)
        self._pending = {}  # key -> references of an accepted screening waiting for its completion
        self._spare = []  # references of dropped rows (placeholders)
        self.num_kept = self.rounds = self.rows_seen = 0
        self.groups_generated = self.groups_with_spread = self.dropped_correct = self.dropped_wrong = 0
        self.trimmed = 0
        self.final_extras = {}

    @property
    def full(self) -> bool:
        return self.num_kept >= self.target

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pending_keys(self) -> list:
        """Keys of the accepted screenings waiting for their completion, in the order they were accepted."""
        return list(self._pending)

    def add_round(self, rollout: dict, rewards_per_func: torch.Tensor, filter_values: torch.Tensor,
                  segments: list | None = None, extras: dict | None = None) -> RoundResult:
        """rollout: this process's rows, (N / world, ...) tensors; rewards_per_func: (N, F), filter_values: (N,) and
        extras: (N, ...) tensors, gathered over the processes; segments: the round's layout (default: N / G whole
        groups keyed 0, 1, ...)."""
        G, n = self.G, filter_values.shape[0]
        if n % self.world or any(v.shape[0] != n // self.world for v in rollout.values()):
            raise ValueError(f"a round of {n} rows must be split evenly over {self.world} processes")
        if segments is None:
            if n % G:
                raise ValueError(f"a round of whole groups needs a multiple of {G} rows, got {n}")
            segments = [Segment(i, "group", G) for i in range(n // G)]
        if sum(s.rows for s in segments) != n:
            raise ValueError(f"the segments of a round cover {sum(s.rows for s in segments)} rows, the round has {n}")
        self.rounds += 1
        room = self.target - self.num_kept
        spare_rows = len(self._spare)
        kept_now, accepted, outcomes, spare_now = [], [], [], []  # kept_now: (key, rows of this round)
        screened_rows = {}
        spread_count = screened = start = 0
        for seg in segments:
            rows = list(range(start, start + seg.rows))
            start += seg.rows
            if seg.kind == "complete":
                if seg.key not in self._pending:
                    raise ValueError(f"completion of prompt {seg.key}, which no screening accepted")
                if len(kept_now) < room:
                    kept_now.append((seg.key, rows))
                else:  # the batch is full: its screening rows are let go
                    self._pending.pop(seg.key)
                    self.trimmed += 1
                continue
            if seg.kind not in ("group", "screen"):
                raise ValueError(f"unknown segment kind {seg.kind!r}")
            values = filter_values[rows[0] : rows[-1] + 1]
            screened += 1
            if bool(group_spread_mask(values, seg.rows, self.eps)[0]):
                spread_count += 1
                outcomes.append((seg.key, "spread"))
                if seg.kind == "screen":
                    accepted.append(seg.key)
                    screened_rows[seg.key] = rows
                elif len(kept_now) < room:
                    kept_now.append((seg.key, rows))
                else:
                    self.trimmed += 1
                continue
            value = torch.nanmean(values.double())
            # the paper's accuracy reward is +1 / -1 (0 / 1 in many data sets): a constant group above 0 is all-correct
            easy = bool(value > 0)
            self.dropped_correct += int(easy)
            self.dropped_wrong += int(not easy)
            outcomes.append((seg.key, "easy" if easy else "hard"))
            if spare_rows < self.multiple * G:
                take = rows[: self.multiple * G - spare_rows]
                spare_now.extend(take)
                spare_rows += len(take)
        self.groups_generated += screened
        self.groups_with_spread += spread_count

        # only the rows still needed are held (the round's other rows are let go with it)
        held = sorted({r for _, rows in kept_now for r in rows} | {r for rows in screened_rows.values() for r in rows}
                      | set(spare_now))
        part_id = len(self._parts)
        index = {row: j for j, row in enumerate(held)}
        self._hold(held, rollout, rewards_per_func, extras)
        for key in accepted:
            self._pending[key] = [(part_id, index[r]) for r in screened_rows[key]]
        for key, rows in kept_now:
            refs = [(part_id, index[r]) for r in rows]
            if key in self._pending and key not in screened_rows:  # a completion: the screening rows come first
                refs = self._pending.pop(key) + refs
            self._kept.append(refs)
            self.num_kept += 1
        self._spare.extend((part_id, index[r]) for r in spare_now)
        self.rows_seen += n
        return RoundResult(accepted, outcomes, screened, spread_count)

    def _hold(self, rows: list[int], rollout: dict, rewards_per_func: torch.Tensor, extras: dict | None) -> None:
        device = rewards_per_func.device
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        per_rank = rewards_per_func.shape[0] // self.world
        sources = torch.div(rows_t, per_rank, rounding_mode="floor")
        local = rows_t[sources == self.rank] - self.rank * per_rank
        part = {
            "rows": rows_t,
            "sources": sources,
            "rewards": rewards_per_func[rows_t],
            "positions": rows_t + self.rows_seen,
            "extras": {k: v[rows_t.to(v.device)] for k, v in (extras or {}).items()},
            "local": {k: v[local.to(v.device)] for k, v in rollout.items()},
            # index within `local` of every held row of this rank (-1 for the other ranks' rows)
            "local_index": torch.where(sources == self.rank, torch.cumsum(sources == self.rank, 0) - 1, -1),
        }
        self._parts.append(part)

    def finalize(self, pad_token_id: int):
        """-> (local_batch, sources, rewards_per_func, positions, num_real_rows, exhausted).

        The batch holds `num_real_rows` rows of kept groups followed by placeholder rows (exhaustion with too few
        groups). `sources`, `rewards_per_func` and `positions` (the index of every row among all the rows generated
        this step) describe all its rows, on every rank; `local_batch` holds this rank's rows of it, in order, ready
        for `selection.redistribute_rows`. Placeholder rows come from dropped rows, then from accepted screenings
        never completed, and only when those run out from kept rows again (they are trained with advantage 0)."""
        exhausted = not self.full
        num_real, num_pad = (self.target, 0) if not exhausted else exhausted_group_count(self.num_kept, self.multiple)
        refs = [r for group in self._kept[:num_real] for r in group]
        real_rows = len(refs)
        if num_pad:
            pool = self._spare + [r for p in self._pending.values() for r in p] + [r for g in self._kept for r in g]
            refs += [pool[i % len(pool)] for i in range(num_pad * self.G)]

        def pick(field):
            return torch.cat([self._parts[p][field][j : j + 1] for p, j in refs]) if refs else None

        sources, rewards, positions = pick("sources"), pick("rewards"), pick("positions")
        self.final_extras = {}
        for key in (self._parts[0]["extras"] if self._parts else {}):
            width = max((p["extras"][key].shape[1] for p in self._parts if p["extras"][key].dim() >= 2), default=0)
            rows = []
            for p, j in refs:
                t = self._parts[p]["extras"][key][j : j + 1]
                if t.dim() >= 2 and t.shape[1] < width:
                    fill = float("nan") if t.is_floating_point() else 0
                    t = torch.cat([t, t.new_full((1, width - t.shape[1], *t.shape[2:]), fill)], dim=1)
                rows.append(t)
            self.final_extras[key] = torch.cat(rows)
        # this rank's rows, in the batch's order
        offsets, total = [], 0
        for p in self._parts:
            offsets.append(total)
            total += next(iter(p["local"].values())).shape[0] if p["local"] else 0
        joined = concat_rollouts([p["local"] for p in self._parts], pad_token_id)
        chosen = [offsets[p] + int(self._parts[p]["local_index"][j]) for p, j in refs
                  if int(self._parts[p]["sources"][j]) == self.rank]
        device = next(iter(joined.values())).device
        local = {k: v[torch.tensor(chosen, dtype=torch.long, device=device)] for k, v in joined.items()}
        return local, sources, rewards, positions, real_rows, exhausted


# ----------------------------------------------------------------------------------------------- image inputs
def multimodal_layout(batch: dict, num_rows: int) -> dict[str, str]:
    """What the first dimension of each image input of a rollout (B = `num_rows` rows) counts, read the way TRL's
    `_get_per_token_logps_and_entropies` slices them: `"patch"` (Qwen's pixel_values: the patches of the row's images,
    `image_grid_thw.prod(-1)` each), `"image"` (image_grid_thw, image_sizes, image_position_ids, and pixel_values
    when it has one entry per image: Gemma3, LLaVA), `"tile"` (LFM2-VL's and InternVL's tiles, `num_tiles` per row),
    `"row"` (pixel_values and pixel_attention_mask padded to one entry per row: Idefics, SmolVLM), `"token"`
    (token_type_ids, mm_token_type_ids: (B, P + C)) or `"count"` (num_images, num_tiles: a list of B ints).

    A layout it cannot tell (an unknown image input, counts that do not add up) raises a one-line
    NotImplementedError naming the entry.
    """
    for key in batch:
        if key not in MULTIMODAL_KEYS and not key.startswith(PACKED) and any(
                part in key for part in MULTIMODAL_NAME_PARTS):
            raise NotImplementedError(f"row selection does not know the multimodal input '{key}' (it handles "
                                      f"{', '.join(MULTIMODAL_KEYS)})")
    present = [k for k in MULTIMODAL_KEYS if batch.get(k) is not None]
    if not present:
        return {}
    layout = {k: "count" for k in COUNT_KEYS if k in present}
    layout.update({k: "token" for k in SPANNING_KEYS if k in present})
    num_images = batch.get("num_images")
    images = sum(num_images) if num_images is not None else None
    pixels = batch.get("pixel_values")
    if pixels is not None:
        if "image_grid_thw" in batch:
            layout.update(pixel_values="patch", image_grid_thw="image")
        elif "image_position_ids" in batch:
            layout.update(pixel_values="image", image_position_ids="image")
        elif "spatial_shapes" in batch:
            layout.update(pixel_values="tile", pixel_attention_mask="tile", spatial_shapes="tile")
        elif "num_tiles" in batch:
            layout.update(pixel_values="tile")
        elif images is not None and pixels.shape[0] == images:
            layout.update(pixel_values="image")
        elif pixels.shape[0] == num_rows:
            layout.update(pixel_values="row")
        else:
            raise NotImplementedError(f"row selection does not know how 'pixel_values' (shape {tuple(pixels.shape)}) "
                                      f"maps to the {num_rows} rows (num_images={num_images})")
    if "pixel_attention_mask" in present and "pixel_attention_mask" not in layout:
        layout["pixel_attention_mask"] = "row"
    if "image_sizes" in present:
        layout["image_sizes"] = "image"
    for key in present:
        unit = layout.get(key)
        if unit is None:  # image_grid_thw without pixel_values, ...
            raise NotImplementedError(f"row selection does not know how '{key}' is laid out without the inputs it "
                                      "belongs to (pixel_values)")
        if unit in ("image", "patch") and num_images is None:
            raise NotImplementedError(f"row selection needs 'num_images' to split '{key}' per row")
        if unit == "tile" and batch.get("num_tiles") is None:
            raise NotImplementedError(f"row selection needs 'num_tiles' to split '{key}' per row")
    return layout


def image_inputs(output: dict) -> dict:
    """The image inputs of a rollout (TRL's layout), as keyword arguments of TRL's
    `_get_per_token_logps_and_entropies`, which slices them per chunk of rows ({} for a text-only rollout)."""
    return {key: output[key] for key in MULTIMODAL_KEYS if output.get(key) is not None}


def _items_per_row(batch: dict, unit: str) -> torch.Tensor:
    """(B,) how many entries of a `unit`-indexed input (`multimodal_layout`) each row has."""
    if unit == "image":
        return torch.tensor(batch["num_images"], dtype=torch.long)
    if unit == "tile":
        return torch.tensor(batch["num_tiles"], dtype=torch.long)
    per_image = batch["image_grid_thw"].prod(dim=-1).cpu()  # patch: the patches of each of the row's images
    return torch.stack([part.sum() for part in torch.split(per_image, list(batch["num_images"]))]) if len(
        batch["num_images"]) else torch.zeros(0, dtype=torch.long)


def pack_multimodal(batch: dict, num_rows: int) -> dict:
    """A rollout's image inputs (TRL's layout) -> dense per-row entries named `mm:<key>`; other entries unchanged.

    An input indexed by patch, image or tile, (M, ...) with row i owning `n_i` consecutive entries, becomes
    `mm:<key>` (B, max n_i, ...), zero-padded on the right, and `mm:<key>:count` (B,) = n_i; a per-row input
    (Idefics) stays (B, N, ...) (padding more images with zeros is the processor's own padding); both get
    `mm:<key>:extent` (B, k), the sizes of the dimensions after those (`_add_extent`); a per-token input
    (B, P + C) is split into `mm:<key>:prompt` (B, P), left-aligned with the prompt, and `mm:<key>:completion` (B, C);
    `num_images` / `num_tiles` become (B,) tensors. Rows of the packed dict can then be indexed (`take_rows`), joined
    and moved between processes like any row entry, and `unpack_multimodal` restores TRL's layout.

    Image inputs without a rollout around them (no `prompt_ids` / `completion_ids`: a chunk's inputs, the processor's
    `multimodal_fields` of ReMax's prompts) keep a per-token input whole, `mm:<key>` (B, L) or a list of B per-row
    token lists (the processor's, unpadded): its rows can be taken, not joined with rows of another width.
    """
    layout = multimodal_layout(batch, num_rows)
    if not layout:
        return dict(batch)
    out = {k: v for k, v in batch.items() if k not in layout}
    prompt_width = batch["prompt_ids"].shape[1] if "prompt_ids" in batch else None
    completion_width = batch["completion_ids"].shape[1] if "completion_ids" in batch else None
    # the counts and extents live with the rows' tensors: the moves between processes send them all alike (NCCL
    # takes no CPU tensor)
    device = next((v.device for k, v in batch.items() if k in layout and isinstance(v, torch.Tensor)), None)
    for key, unit in layout.items():
        value = batch[key]
        if unit == "count":
            if len(value) != num_rows:
                raise NotImplementedError(f"'{key}' has {len(value)} entries for {num_rows} rows")
            out[PACKED + key] = torch.tensor(list(value), dtype=torch.long, device=device)
        elif unit == "token" and prompt_width is None and completion_width is None:
            if len(value) != num_rows:
                raise NotImplementedError(f"'{key}' has {len(value)} rows, expected {num_rows}")
            out[PACKED + key] = value
        elif unit == "token":
            if prompt_width is None or completion_width is None or value.shape[:2] != (
                    num_rows, prompt_width + completion_width):
                raise NotImplementedError(f"'{key}' (shape {tuple(value.shape)}) is not aligned with prompt_ids + "
                                          f"completion_ids ({num_rows} rows of {prompt_width} + {completion_width})")
            out[f"{PACKED}{key}:prompt"] = value[:, :prompt_width]
            out[f"{PACKED}{key}:completion"] = value[:, prompt_width:]
        elif unit == "row":
            if value.shape[0] != num_rows:
                raise NotImplementedError(f"'{key}' (shape {tuple(value.shape)}) has no entry per row ({num_rows})")
            out[PACKED + key] = value
            _add_extent(out, key, value.shape[2:], num_rows, device)
        else:
            counts = _items_per_row(batch, unit).to(value.device)
            if int(counts.sum()) != value.shape[0] or counts.numel() != num_rows:
                raise NotImplementedError(f"'{key}' has {value.shape[0]} entries, its rows' {unit}s add up to "
                                          f"{int(counts.sum())}")
            width = int(counts.max()) if counts.numel() else 0
            packed = value.new_zeros((num_rows, width, *value.shape[1:]))
            packed[torch.arange(width, device=value.device) < counts.unsqueeze(1)] = value  # row-major: in order
            out[PACKED + key] = packed
            out[f"{PACKED}{key}:count"] = counts
            _add_extent(out, key, value.shape[1:], num_rows, device)
    return out


def _add_extent(out: dict, key: str, sizes: torch.Size, num_rows: int, device: torch.device) -> None:
    """`mm:<key>:extent` (B, k): the sizes of each row's entries of `key` beyond the row and entry dimensions (an
    image's tiles, a tile's patches, an image's height and width, as the processor padded them for the row's batch).
    Joining rows of batches with other sizes pads them (zeros: LLaVA-NeXT's tiles beyond its `image_sizes`, Idefics'
    pixels beyond its `pixel_attention_mask`); the extents let `unpack_multimodal` cut the entries of the rows it
    holds back to the largest of their own, so that no padding the rows' own batches did not have reaches the model."""
    if len(sizes):
        out[f"{PACKED}{key}:extent"] = torch.tensor(list(sizes), dtype=torch.long, device=device).repeat(num_rows, 1)


def unpack_multimodal(rows: dict) -> dict:
    """Inverse of `pack_multimodal`: TRL's layout for the rows held (entries of rows without images drop out). When
    no row holds an image, every image input is left out, as TRL leaves them out of an image-less batch."""
    packed = [k for k in rows if k.startswith(PACKED)]
    if not packed:
        return rows
    out = {k: v for k, v in rows.items() if not k.startswith(PACKED)}
    counts = [rows[PACKED + k] for k in COUNT_KEYS if PACKED + k in rows]
    if counts and not any(bool(c.any()) for c in counts):
        return out
    for key in packed:
        name = key[len(PACKED):]
        value = rows[key]
        if name in COUNT_KEYS:
            out[name] = [int(n) for n in value.tolist()]
        elif name.endswith(":prompt"):
            base = name.removesuffix(":prompt")
            out[base] = torch.cat([value, rows[f"{PACKED}{base}:completion"]], dim=1)
        elif name.endswith((":completion", ":count", ":extent")):
            continue
        elif isinstance(value, list):  # per-row token lists (`pack_multimodal` without a rollout)
            out[name] = value
        elif f"{key}:count" in rows:
            counts = rows[f"{key}:count"].to(value.device)
            flat = value[torch.arange(value.shape[1], device=value.device) < counts.unsqueeze(1)]
            if flat.shape[0]:
                out[name] = _cut_to_extent(flat, rows.get(f"{key}:extent"), counts > 0)
        elif value.shape[0] and value.shape[1]:  # per-row (B, N, ...)
            out[name] = _cut_to_extent(value, rows.get(f"{key}:extent"), None, first=2)
    return out


def _cut_to_extent(value: torch.Tensor, extent: torch.Tensor | None, holding: torch.Tensor | None,
                   first: int = 1) -> torch.Tensor:
    """`value` with its dimensions from `first` on cut to the largest `extent` (B, k) of the rows `holding` (B,) bool
    (all when None): the padding that joining rows of other batches added goes again (`_add_extent`)."""
    if extent is None or not extent.numel():
        return value
    extent = extent if holding is None else extent[holding.to(extent.device)]
    if not extent.shape[0]:
        return value
    sizes = extent.max(dim=0).values.tolist()
    return value[(slice(None),) * first + tuple(slice(0, int(n)) for n in sizes)]


def take_rows(packed: dict, rows, num_rows: int) -> dict:
    """The rows `rows` (indices into B = `num_rows`, any order, repeats allowed) of a dict of per-row entries
    (`pack_multimodal`'s): tensors (B, ...) are indexed, lists of B per-row items picked; anything else raises a
    one-line ValueError naming the entry."""
    rows = list(rows)
    out = {}
    for key, value in packed.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_rows:
            out[key] = value[torch.tensor(rows, dtype=torch.long, device=value.device)]
        elif isinstance(value, list) and len(value) == num_rows:
            out[key] = [value[i] for i in rows]
        else:
            size = tuple(value.shape) if isinstance(value, torch.Tensor) else len(value) if hasattr(
                value, "__len__") else "no length"
            raise ValueError(f"{key}: expected one entry per row ({num_rows}), got {type(value).__name__} ({size})")
    return out


def image_rows(fields: dict, rows, num_rows: int) -> dict:
    """The image inputs `fields` (TRL's layout, B = `num_rows` rows) of the rows `rows` (any order, repeats allowed),
    in TRL's layout: `unpack_multimodal(take_rows(pack_multimodal(...)))`. A set of rows without any image gets
    no image input at all (as TRL gives a text-only batch). To take several sets of rows of one batch (chunks), pack
    once and call `take_rows` and `unpack_multimodal` per set."""
    return unpack_multimodal(take_rows(pack_multimodal(fields, num_rows), rows, num_rows))


def _chunk_bounds(num_rows: int, batch_size: int | None) -> list[tuple[int, int]]:
    size = max(batch_size or num_rows, 1)
    return [(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def has_image_less_chunk(fields: dict, num_rows: int, batch_size: int | None = None) -> bool:
    """Whether a batch with image inputs `fields` (TRL's layout, `None` entries ignored) has a chunk of `batch_size`
    rows (`image_chunks`) without any image, by the per-row counts (`num_images`, `num_tiles`; True when there are
    none to tell by). False for a batch without image inputs."""
    if not any(fields.get(key) is not None for key in MULTIMODAL_KEYS if key not in COUNT_KEYS):
        return False
    counts = [fields[key] for key in COUNT_KEYS if fields.get(key) is not None]
    return not counts or any(not any(any(c[start:end]) for c in counts)
                             for start, end in _chunk_bounds(num_rows, batch_size))


def image_chunks(fields: dict, num_rows: int, batch_size: int | None = None) -> list[tuple[int, int, dict]]:
    """Consecutive chunks `(start, end, image_inputs)` of `batch_size` rows (all `num_rows` rows in one when None or
    0) of a batch whose image inputs `fields` are in TRL's layout (`None` entries ignored), each chunk with its own
    rows' image inputs in TRL's layout, the chunk's forward pass takes.

    A chunk without any image gets no image input at all, as TRL gives a text-only batch: TRL's own slicing (its
    `_get_per_token_logps_and_entropies` chunks, its micro-batch split in `_prepare_inputs`) gives such a chunk empty
    image tensors, which the vision towers refuse (Gemma3's SigLIP: "cannot reshape tensor of 0 elements", Qwen2.5-VL:
    "torch.cat(): expected a non-empty list"). One chunk holding an image gets `fields` as they are; several chunks
    are taken from one packing (`pack_multimodal`, then `take_rows` / `unpack_multimodal` per chunk).
    """
    fields = {key: value for key, value in fields.items() if value is not None}
    bounds = _chunk_bounds(num_rows, batch_size)
    if not any(key in MULTIMODAL_KEYS for key in fields):
        return [(start, end, {}) for start, end in bounds]
    if len(bounds) == 1 and not has_image_less_chunk(fields, num_rows):
        return [(0, num_rows, fields)]
    packed = pack_multimodal(fields, num_rows)
    return [(start, end, unpack_multimodal(take_rows(packed, range(start, end), num_rows))) for start, end in bounds]


def _empty_rows_like(key: str, template: torch.Tensor, part: dict) -> torch.Tensor:
    """A packed entry `key` for the rows of a rollout `part` that has none (a round whose prompts had no image): no
    images, zero token types, shaped and typed like `template` (the entry of another part)."""
    rows = part["completion_mask"].shape[0] if "completion_mask" in part else next(iter(part.values())).shape[0]
    if key.endswith(":prompt"):
        return template.new_zeros((rows, part["prompt_ids"].shape[1]))
    if key.endswith(":completion"):
        return template.new_zeros((rows, part["completion_ids"].shape[1]))
    return template.new_zeros((rows, *((0, *template.shape[2:]) if template.dim() >= 2 else ())))


def _is_prompt_key(key: str) -> bool:
    return key in PROMPT_KEYS or (key.startswith(PACKED) and key.endswith(":prompt"))


def _is_completion_key(key: str) -> bool:
    return key in COMPLETION_KEYS or (key.startswith(PACKED) and key.endswith(":completion"))


# ----------------------------------------------------------------------------------------------- distributed moves
def _row_keys(output: dict, num_rows: int) -> list[str]:
    for key in MULTIMODAL_KEYS:
        if output.get(key) is not None:
            raise NotImplementedError(f"'{key}' is in TRL's multimodal layout, not per row: take the rows with "
                                      "selection.row_entries first")
    multimodal_layout(output, num_rows)  # refuses unknown image inputs instead of dropping them
    keys = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == num_rows]
    for key in keys:
        if output[key].dim() >= 2 and not (_is_prompt_key(key) or _is_completion_key(key) or key.startswith(PACKED)):
            raise NotImplementedError(
                f"row selection does not know how '{key}' is aligned (shape {tuple(output[key].shape)}); "
                "add it to PROMPT_KEYS or COMPLETION_KEYS in trl_ppo_variants/selection.py"
            )
    return keys


def row_entries(output: dict, num_rows: int) -> dict:
    """The per-row tensors of a rollout dict (B = `num_rows` rows), image inputs packed per row
    (`pack_multimodal`); refuses entries whose alignment is unknown."""
    packed = pack_multimodal(output, num_rows)
    return {key: packed[key] for key in _row_keys(packed, num_rows)}


def _pad_value(key: str, pad_token_id: int):
    return pad_token_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)


def _pad_to(t: torch.Tensor, sizes, left: bool, value) -> torch.Tensor:
    """`t` (B, ...) padded with `value` to `sizes` (its sizes after dimension 0, none smaller than `t`'s): dimension 1
    on the left when `left` (prompt-aligned keys), on the right otherwise, every further dimension (a packed image
    entry's tiles, patches, height, width) on the right."""
    sizes = tuple(int(n) for n in sizes)
    if t.dim() < 2 or tuple(t.shape[1:]) == sizes:
        return t
    out = t.new_full((t.shape[0], *sizes), value)
    width = t.shape[1]
    columns = slice(sizes[0] - width, sizes[0]) if left else slice(0, width)
    out[(slice(None), columns, *(slice(0, n) for n in t.shape[2:]))] = t
    return out


def _widest(shapes) -> list[int]:
    """The largest size of every dimension after dimension 0 among tensors of one key (equal numbers of dimensions)."""
    shapes = [tuple(s[1:]) for s in shapes]
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"cannot join entries of different numbers of dimensions: shapes {shapes}")
    return [max(sizes) for sizes in zip(*shapes)]


def gather_rollout(accelerator, output: dict, num_rows: int, pad_token_id: int) -> dict:
    """Per-process rollout dict (B rows) -> global dict (B * num_processes rows, process order), same on every rank.

    Every rank must call it with the same keys and the same `num_rows`. Widths are padded to the largest across
    processes before the gather (gathering unequal shapes hangs or returns garbage on gloo). Non-row entries are
    dropped (`num_items_in_batch` is recomputed by `redistribute_rows`).
    """
    keys = _row_keys(output, num_rows)
    if accelerator.num_processes == 1:
        return {key: output[key] for key in keys}
    padded = _pad_to_widest(accelerator, {key: output[key] for key in keys}, pad_token_id)
    return {key: accelerator.gather(t.contiguous()) for key, t in padded.items()}


def _pad_to_widest(accelerator, rows: dict, pad_token_id: int) -> dict:
    """Pad every 2-D+ row tensor to the widest of its key across processes in every dimension after the rows' (one
    collective for all the sizes): collectives on unequal shapes hang or return garbage on gloo. Besides the widths,
    packed image entries can differ in their further dimensions (LLaVA-NeXT's tiles per image, by aspect ratio)."""
    wide = [k for k in rows if rows[k].dim() >= 2]
    if not wide:
        return dict(rows)
    local = torch.tensor([n for k in wide for n in rows[k].shape[1:]], device=rows[wide[0]].device, dtype=torch.long)
    widest = accelerator.gather(local).view(-1, local.numel()).max(dim=0).values.tolist()
    sizes, start = {}, 0
    for key in wide:
        sizes[key] = widest[start:start + rows[key].dim() - 1]
        start += rows[key].dim() - 1
    return {key: _pad_to(t, sizes[key], left=_is_prompt_key(key), value=_pad_value(key, pad_token_id))
            if key in sizes else t for key, t in rows.items()}


def concat_rollouts(rollouts: list[dict], pad_token_id: int) -> dict:
    """Join rollout dicts row-wise, re-padding prompt keys on the left and completion keys on the right (packed image
    inputs, `pack_multimodal`, on the right with zeros in every dimension: no image, no tile, no pixel; their
    extents say what is padding).

    Keys missing from some of the rollouts are dropped (they cannot be filled in), except packed image inputs: a
    rollout without them (a round of prompts without images) gets rows without images."""
    if len(rollouts) == 1:
        return dict(rollouts[0])
    rollouts = _with_every_packed_key(rollouts)
    keys = [k for k in rollouts[0] if all(k in r for r in rollouts)]
    result = {}
    for key in keys:
        parts = [r[key] for r in rollouts]
        if parts[0].dim() >= 2:
            sizes = _widest(p.shape for p in parts)
            parts = [_pad_to(p, sizes, left=_is_prompt_key(key), value=_pad_value(key, pad_token_id)) for p in parts]
        result[key] = torch.cat(parts, dim=0)
    return result


def _with_every_packed_key(rollouts: list[dict]) -> list[dict]:
    """The rollouts, each given the packed image entries that only others have (rows without images)."""
    templates = {}
    for r in rollouts:
        templates.update({k: v for k, v in r.items() if k.startswith(PACKED) and k not in templates})
    if all(k in r for r in rollouts for k in templates):
        return rollouts
    return [{**r, **{k: _empty_rows_like(k, t, r) for k, t in templates.items() if k not in r}} for r in rollouts]


def _round_up(n: int, multiple: int | None, limit: int) -> int:
    if multiple:
        n = -(-n // multiple) * multiple
    return min(n, limit)


def trim_padding(out: dict, pad_to_multiple_of: int | None = None) -> dict:
    """Trim the padding columns that no row of `out` uses: completion keys on the right, prompt keys on the left,
    widths kept a multiple of `pad_to_multiple_of` when given (as TRL pads)."""
    if out["completion_mask"].shape[0] == 0:
        return out
    c_mask, p_mask = out["completion_mask"], out["prompt_mask"]
    cols = c_mask.sum(dim=0).nonzero()
    t_used = _round_up(int(cols.max().item()) + 1 if cols.numel() else 1, pad_to_multiple_of, c_mask.shape[1])
    cols = p_mask.sum(dim=0).nonzero()
    p_used = _round_up(p_mask.shape[1] - int(cols.min().item()) if cols.numel() else 1, pad_to_multiple_of,
                       p_mask.shape[1])
    for key, value in out.items():
        if value.dim() >= 2 and _is_completion_key(key) and value.shape[1] == c_mask.shape[1]:
            out[key] = value[:, :t_used]
        elif value.dim() >= 2 and _is_prompt_key(key):
            out[key] = value[:, value.shape[1] - p_used :]
    return out


def loss_mask(rows: dict) -> torch.Tensor:
    """The tokens TRL's loss counts: (B, T) completion mask, times the tool mask when tools are used."""
    return rows["completion_mask"] * rows["tool_mask"] if "tool_mask" in rows else rows["completion_mask"]


def _exchange(accelerator, dst: torch.Tensor, src: torch.Tensor, dst_splits: list[int], src_splits: list[int]) -> None:
    """All-to-all of rows: process r sends `src_splits[q]` consecutive rows of `src` to process q and receives
    `dst_splits[q]` rows from process q into `dst`, in process order."""
    import torch.distributed as dist

    dist.all_to_all_single(dst, src, output_split_sizes=dst_splits, input_split_sizes=src_splits)


def redistribute_rows(
    accelerator, local: dict, sources: torch.Tensor, pad_token_id: int, pad_to_multiple_of: int | None = None
) -> dict:
    """Hand each process its contiguous share of a batch whose rows are spread over the processes, moving only rows.

    The batch has K rows in a global order; row p lives on process `sources[p]`. `sources` (K,) is the same on every
    rank; `local` holds this process's rows of the batch, in that order (per-row tensors of its own widths). Process
    r ends with rows [r * K / W, (r + 1) * K / W), with the padding columns no local row uses trimmed (widths kept a
    multiple of `pad_to_multiple_of` when given, as TRL pads) and `num_items_in_batch` set to the loss tokens of all K
    rows (TRL's "dapo" loss divides by it). Image inputs come packed per row (`row_entries`) and leave in TRL's layout
    (`unpack_multimodal`). No process ever holds the global batch: one all-to-all per key moves each
    row straight to its destination (widths are first padded to the widest across processes, one small gather).

    Args:
        local: row tensors with L rows, L = (sources == rank).sum(); the same keys on every rank.
        sources: (K,) long, K a multiple of the number of processes W.
    Returns:
        dict of (K / W, ...) row tensors, plus `num_items_in_batch` (loss tokens of all K rows).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    total = sources.numel()
    if total % world != 0:
        raise ValueError(f"cannot split {total} kept rows evenly over {world} processes")
    share = total // world
    num_local = int((sources == rank).sum())
    if world > 1:  # a process whose rows have no image input still moves (empty) entries of it: same keys everywhere
        local = _with_agreed_packed_keys(accelerator, local)
    keys = _row_keys(local, num_local)
    if any(local[k].shape[0] != num_local for k in keys) or "completion_mask" not in keys:
        raise ValueError(f"process {rank} holds {num_local} rows of the batch but its rollout does not")
    local_tokens = loss_mask(local).sum()
    if world == 1:
        out = unpack_multimodal(trim_padding({k: local[k] for k in keys}, pad_to_multiple_of))
        out["num_items_in_batch"] = local_tokens
        return out

    sources = sources.to("cpu")
    dest = torch.arange(total) // max(share, 1)
    mine = dest == rank
    # local rows are in global order and `dest` grows with it: they are already grouped by destination
    send = torch.bincount(dest[sources == rank], minlength=world).tolist()
    recv = torch.bincount(sources[mine], minlength=world).tolist()
    # rows arrive grouped by source process; `order` puts them back in global order
    slots = torch.arange(total)[mine]
    order = torch.argsort(sources[mine] * total + slots).to(local["completion_mask"].device)

    out = {}
    for key, t in _pad_to_widest(accelerator, {k: local[k] for k in keys}, pad_token_id).items():
        received = t.new_empty((share, *t.shape[1:]))
        _exchange(accelerator, received, t.contiguous(), recv, send)
        placed = torch.empty_like(received)
        placed[order] = received
        out[key] = placed
    out = unpack_multimodal(trim_padding(out, pad_to_multiple_of))
    out["num_items_in_batch"] = accelerator.reduce(local_tokens, reduction="sum")
    return out


def _gather_objects(accelerator, obj) -> list:
    """Every process's `obj`, in process order (accelerate's `gather_object`; replaced in tests)."""
    from accelerate.utils import gather_object

    return gather_object([obj])


def _with_agreed_packed_keys(accelerator, rows: dict) -> dict:
    """`rows` with the packed image entries any process holds (empty: no image) so that every process moves the same
    keys (a collective on keys some process lacks hangs). Only the (trailing shape, dtype) of each entry travels: the
    trailing sizes are one process's, `_pad_to_widest` then pads every dimension to the widest of all."""
    spec = {k: (tuple(v.shape[2:]), v.dim(), str(v.dtype).removeprefix("torch."))
            for k, v in rows.items() if k.startswith(PACKED)}
    union = {}
    for other in _gather_objects(accelerator, spec):
        union.update({k: s for k, s in other.items() if k not in union})
    missing = {k: s for k, s in union.items() if k not in rows}
    if not missing:
        return rows
    device = rows["completion_mask"].device
    templates = {k: torch.zeros((1, 1, *tail) if dim >= 2 else (1,), dtype=getattr(torch, dtype), device=device)
                 for k, (tail, dim, dtype) in missing.items()}
    return {**rows, **{k: _empty_rows_like(k, t, rows) for k, t in templates.items()}}
