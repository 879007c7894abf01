"""The one "keep some rows after scoring" step, shared by DAPO's dynamic sampling and TTRL's vote/train split.

Two layers:
- pure functions on gathered (global) tensors that decide *which* rows to keep (`group_spread_mask`, `group_rows`,
  `group_multiple`, `exhausted_group_count`);
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
"""

from __future__ import annotations

import math

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
# Multimodal entries are not row-aligned (pixel_values is per patch) or span prompt and completion (token_type_ids).
UNSUPPORTED_KEYS = (
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


# ----------------------------------------------------------------------------------------------- distributed moves
def _row_keys(output: dict, num_rows: int) -> list[str]:
    for key in UNSUPPORTED_KEYS:
        if key in output:
            raise NotImplementedError(
                f"row selection does not support multimodal rollouts yet (found '{key}' in the batch)"
            )
    keys = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == num_rows]
    for key in keys:
        if output[key].dim() >= 2 and key not in PROMPT_KEYS + COMPLETION_KEYS:
            raise NotImplementedError(
                f"row selection does not know how '{key}' is aligned (shape {tuple(output[key].shape)}); "
                "add it to PROMPT_KEYS or COMPLETION_KEYS in trl_ppo_variants/selection.py"
            )
    return keys


def row_entries(output: dict, num_rows: int) -> dict:
    """The per-row tensors of a rollout dict (B = `num_rows` rows); refuses entries whose alignment is unknown."""
    return {key: output[key] for key in _row_keys(output, num_rows)}


def _pad_value(key: str, pad_token_id: int):
    return pad_token_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)


def _pad_to(t: torch.Tensor, width: int, left: bool, value) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] >= width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


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
    """Pad every 2-D+ row tensor to the widest of its key across processes (one collective for all the widths):
    collectives on unequal shapes hang or return garbage on gloo."""
    wide = [k for k in rows if rows[k].dim() >= 2]
    if not wide:
        return dict(rows)
    local = torch.tensor([rows[k].shape[1] for k in wide], device=rows[wide[0]].device, dtype=torch.long)
    widths = dict(zip(wide, accelerator.gather(local).view(-1, len(wide)).max(dim=0).values.tolist()))
    return {key: _pad_to(t, int(widths[key]), left=key in PROMPT_KEYS, value=_pad_value(key, pad_token_id))
            if key in widths else t for key, t in rows.items()}


def concat_rollouts(rollouts: list[dict], pad_token_id: int) -> dict:
    """Join rollout dicts row-wise, re-padding prompt keys on the left and completion keys on the right.

    Keys missing from some of the rollouts are dropped (they cannot be filled in)."""
    if len(rollouts) == 1:
        return dict(rollouts[0])
    keys = [k for k in rollouts[0] if all(k in r for r in rollouts)]
    result = {}
    for key in keys:
        parts = [r[key] for r in rollouts]
        if parts[0].dim() >= 2:
            width = max(p.shape[1] for p in parts)
            parts = [_pad_to(p, width, left=key in PROMPT_KEYS, value=_pad_value(key, pad_token_id)) for p in parts]
        result[key] = torch.cat(parts, dim=0)
    return result


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
        if value.dim() >= 2 and key in COMPLETION_KEYS and value.shape[1] == c_mask.shape[1]:
            out[key] = value[:, :t_used]
        elif value.dim() >= 2 and key in PROMPT_KEYS:
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
    rows (TRL's "dapo" loss divides by it). No process ever holds the global batch: one all-to-all per key moves each
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
    keys = _row_keys(local, num_local)
    if any(local[k].shape[0] != num_local for k in keys) or "completion_mask" not in keys:
        raise ValueError(f"process {rank} holds {num_local} rows of the batch but its rollout does not")
    local_tokens = loss_mask(local).sum()
    if world == 1:
        out = trim_padding({k: local[k] for k in keys}, pad_to_multiple_of)
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
    out = trim_padding(out, pad_to_multiple_of)
    out["num_items_in_batch"] = accelerator.reduce(local_tokens, reduction="sum")
    return out
