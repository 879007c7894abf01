"""Which rows a step trains on, and the assembly of its batch from successive generation rounds: dynamic sampling
(DAPO's, and the pre-generation prompt selection of `screening.py`: SPEED, GRESO).

Layers:
- pure functions on gathered (global) tensors that decide *which* rows to keep (`group_spread_mask`, `group_rows`,
  `group_multiple`, `exhausted_group_count`), and the sizing of a generation round from a keep-rate estimate
  (`update_keep_rate`, `keep_rate_estimate`, `prompts_to_generate`);
- `GroupAccumulator` (pure: no process group), which assembles one batch of whole groups from successive generation
  rounds, and `RefillSampler`, the seeded, resumable stream of data-set indices those rounds refill from.

The decision is taken once on gathered rewards, identically on every rank, and every process ends with the same number
of rows (TRL's collectives hang when ranks disagree). Moving the kept rows, their image inputs with them, to the
process that trains them is `rollout.py`'s (`rollout.redistribute_rows`), as it is for TTRL's vote/train split
(`VariantTrainer.select_rows`).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from .rollout import concat_rollouts


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
        for `rollout.redistribute_rows`. Placeholder rows come from dropped rows, then from accepted screenings
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
