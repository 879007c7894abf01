"""The rows of a rollout batch (the dict TRL's `_generate_and_score_completions` returns) and how they move: per-row
image packing, the global view of a batch, joining rounds, handing rows to the processes that train them, and the loss
mask. Used by every estimator, whether or not it selects rows (`selection.py` decides which rows to keep).

- `redistribute_rows` hands every process its equal share of a batch whose rows are spread over the processes,
  moving only rows between processes (one all-to-all per key); every process ends with the same number of rows
  (TRL's collectives hang when ranks disagree);
- `gather_rollout` / `concat_rollouts` build the global view of (some entries of) a rollout batch for estimators that
  need the whole batch (token-level whitening, KL in the reward), and join rollouts of several rounds;
- `trim_padding` drops the padding columns no row uses, `loss_mask` is the tokens TRL's loss counts.

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
            raise NotImplementedError(f"per-row packing does not know the multimodal input '{key}' (it handles "
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
            raise NotImplementedError(f"per-row packing does not know how 'pixel_values' (shape {tuple(pixels.shape)}) "
                                      f"maps to the {num_rows} rows (num_images={num_images})")
    if "pixel_attention_mask" in present and "pixel_attention_mask" not in layout:
        layout["pixel_attention_mask"] = "row"
    if "image_sizes" in present:
        layout["image_sizes"] = "image"
    for key in present:
        unit = layout.get(key)
        if unit is None:  # image_grid_thw without pixel_values, ...
            raise NotImplementedError(f"per-row packing does not know how '{key}' is laid out without the inputs it "
                                      "belongs to (pixel_values)")
        if unit in ("image", "patch") and num_images is None:
            raise NotImplementedError(f"per-row packing needs 'num_images' to split '{key}' per row")
        if unit == "tile" and batch.get("num_tiles") is None:
            raise NotImplementedError(f"per-row packing needs 'num_tiles' to split '{key}' per row")
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
                                      "rollout.row_entries first")
    multimodal_layout(output, num_rows)  # refuses unknown image inputs instead of dropping them
    keys = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == num_rows]
    for key in keys:
        if output[key].dim() >= 2 and not (_is_prompt_key(key) or _is_completion_key(key) or key.startswith(PACKED)):
            raise NotImplementedError(
                f"moving rollout rows does not know how '{key}' is aligned (shape {tuple(output[key].shape)}); "
                "add it to PROMPT_KEYS or COMPLETION_KEYS in trl_ppo_variants/rollout.py"
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
