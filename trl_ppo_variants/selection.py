"""The one "keep some rows after scoring" step, shared by DAPO's dynamic sampling and TTRL's vote/train split.

Two layers:
- pure functions on gathered (global) tensors that decide *which* rows to keep (`group_spread_mask`, ...);
- `gather_rollout` / `concat_rollouts` / `localize_rollout`, which move a rollout batch (the dict TRL's
  `_generate_and_score_completions` returns) between the per-process view and the global view, so that selection is
  done once on the global batch and every process ends with the same number of rows (TRL's collectives hang when
  ranks disagree).

A rollout dict holds per-row tensors whose first dimension is the local batch size B. Prompt-aligned tensors are
left-padded, completion-aligned tensors right-padded; both are re-padded when batches are joined and re-trimmed when
rows are handed back to a process.
"""

from __future__ import annotations

import torch

# Keys TRL puts in the rollout dict, by how they are laid out.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")
COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
    "kl_in_reward",
)
UNSUPPORTED_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "num_images", "image_sizes")


# ----------------------------------------------------------------------------------------------- pure decisions
def group_spread_mask(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Which groups have a reward spread: sample std over the group's finite rewards > eps.

    Compared against `eps`, not `== 0`: float noise in summed rewards passes an exact test. A group with fewer than
    two finite rewards has no spread.

    Args:
        rewards: (N,) NaN for unscorable rows.
    Returns:
        (N // G,) bool.
    """
    grouped = rewards.view(-1, group_size)
    finite = ~torch.isnan(grouped)
    count = finite.sum(dim=1)
    mean = torch.nansum(grouped, dim=1) / count.clamp(min=1)
    sq = torch.where(finite, (grouped - mean.unsqueeze(1)) ** 2, torch.zeros_like(grouped)).sum(dim=1)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return (count >= 2) & (std > eps)


def group_rows(group_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the given groups, in order: (K,) -> (K * G,)."""
    return (group_idx.unsqueeze(1) * group_size + torch.arange(group_size, device=group_idx.device)).reshape(-1)


# ----------------------------------------------------------------------------------------------- distributed moves
def _row_keys(output: dict, num_rows: int) -> list[str]:
    for key in UNSUPPORTED_KEYS:
        if key in output:
            raise NotImplementedError(
                f"row selection does not support multimodal rollouts yet (found '{key}' in the batch)"
            )
    return [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == num_rows]


def _pad_value(key: str, pad_token_id: int):
    return pad_token_id if key in ("prompt_ids", "completion_ids") else (1 if key == "tool_mask" else 0)


def _pad_to(t: torch.Tensor, width: int, left: bool, value) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] >= width:
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


def gather_rollout(accelerator, output: dict, num_rows: int, pad_token_id: int) -> dict:
    """Per-process rollout dict (B rows) -> global dict (B * num_processes rows, process order), same on every rank.

    Widths are padded to the largest across processes before the gather (gathering unequal shapes hangs or returns
    garbage on gloo). Non-row entries are dropped; `num_items_in_batch` is recomputed by `localize_rollout`.
    """
    keys = _row_keys(output, num_rows)
    result = {}
    for key in keys:
        t = output[key]
        if t.dim() >= 2 and accelerator.num_processes > 1:
            width = int(accelerator.gather(torch.tensor([t.shape[1]], device=t.device)).max().item())
            t = _pad_to(t, width, left=key in PROMPT_KEYS, value=_pad_value(key, pad_token_id))
        result[key] = accelerator.gather(t.contiguous()) if accelerator.num_processes > 1 else t
    return result


def concat_rollouts(rollouts: list[dict], pad_token_id: int) -> dict:
    """Join global rollout dicts row-wise, re-padding prompt keys on the left and completion keys on the right."""
    if len(rollouts) == 1:
        return rollouts[0]
    keys = [k for k in rollouts[0] if all(k in r for r in rollouts)]
    result = {}
    for key in keys:
        parts = [r[key] for r in rollouts]
        if parts[0].dim() >= 2:
            width = max(p.shape[1] for p in parts)
            parts = [_pad_to(p, width, left=key in PROMPT_KEYS, value=_pad_value(key, pad_token_id)) for p in parts]
        result[key] = torch.cat(parts, dim=0)
    return result


def localize_rollout(accelerator, global_output: dict, keep: torch.Tensor) -> dict:
    """Keep the global rows `keep` (the same index tensor on every rank) and hand each process its contiguous share.

    `len(keep)` must be a multiple of the number of processes so that every rank gets the same row count. Padding
    columns that no local row uses are trimmed, and `num_items_in_batch` (the global number of loss tokens, which
    TRL's "dapo" loss divides by) is recomputed over the kept rows.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    if keep.numel() % world != 0:
        raise ValueError(f"cannot split {keep.numel()} kept rows evenly over {world} processes")
    share = keep.numel() // world
    local_idx = keep[rank * share : (rank + 1) * share]
    kept = {key: value[keep] for key, value in global_output.items()}
    loss_mask = kept["completion_mask"] * kept["tool_mask"] if "tool_mask" in kept else kept["completion_mask"]
    out = {key: value[rank * share : (rank + 1) * share] for key, value in kept.items()}
    del local_idx
    # trim columns that are padding for every local row
    if share > 0:
        t_used = int(out["completion_mask"].sum(dim=0).nonzero().max().item()) + 1 if out["completion_mask"].any() else 1
        p_used = out["prompt_mask"].shape[1] - (
            int(out["prompt_mask"].sum(dim=0).nonzero().min().item()) if out["prompt_mask"].any() else 0
        )
        for key, value in out.items():
            if value.dim() >= 2 and key in COMPLETION_KEYS and value.shape[1] > 1:
                out[key] = value[:, :t_used]
            elif value.dim() >= 2 and key in PROMPT_KEYS:
                out[key] = value[:, value.shape[1] - p_used :]
            elif key == "advantages" and value.dim() == 2:
                out[key] = value[:, :t_used]
    out["num_items_in_batch"] = loss_mask.sum()
    return out
