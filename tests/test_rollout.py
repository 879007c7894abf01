"""The rows of a rollout batch and their moves (`trl_ppo_variants/rollout.py`): gather / concat / redistribute with
simulated processes (threads with a real all-gather rendezvous), trimming, the loss mask, and every row keeping its
own image inputs (per-row packing of each VLM family's layout, forward chunks, LLaVA-NeXT's tiles; one test with two
real processes)."""

import threading

import pytest
import torch
from launcher import accelerate_launch

from trl_ppo_variants import rollout

PAD = 0


# ------------------------------------------------------------------------------------------------ simulated world
class _World:
    """An all-gather between threads: each rank's tensors are concatenated in rank order."""

    def __init__(self, n):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n, timeout=20)

    def gather(self, rank, t):
        self.slots[rank] = t
        self.barrier.wait()
        out = torch.cat(list(self.slots), dim=0)
        self.barrier.wait()
        return out


    def all_to_all(self, rank, dst, src, dst_splits, src_splits):
        self.slots[rank] = (src, src_splits)
        self.barrier.wait()
        parts = []
        for q in range(self.n):
            q_src, q_splits = self.slots[q]
            start = sum(q_splits[:rank])
            assert q_splits[rank] == dst_splits[q], "send and receive counts disagree"
            parts.append(q_src[start : start + q_splits[rank]])
        dst.copy_(torch.cat(parts, dim=0))
        self.barrier.wait()

    def gather_objects(self, rank, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _Acc:
    def __init__(self, world, rank, n):
        self.world, self.process_index, self.num_processes = world, rank, n

    def gather(self, t):
        return self.world.gather(self.process_index, t) if self.num_processes > 1 else t

    def reduce(self, t, reduction="sum"):
        assert reduction == "sum"
        return self.gather(t.reshape(1)).sum() if self.num_processes > 1 else t


@pytest.fixture
def threaded_exchange(monkeypatch):
    """`rollout._exchange` (torch.distributed.all_to_all_single) between the simulated ranks."""
    monkeypatch.setattr(rollout, "_exchange", lambda acc, dst, src, dst_splits, src_splits: acc.world.all_to_all(
        acc.process_index, dst, src, dst_splits, src_splits))


def _run_ranks(n, fn):
    world, results, errors = _World(n), [None] * n, []

    def target(rank):
        try:
            results[rank] = fn(_Acc(world, rank, n))
        except Exception as e:  # surfaced below
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def _rollout(prompt_lens, completion_lens, first_id=1):
    """Rows with left-padded prompts and right-padded completions; token ids are unique and non-zero."""
    P, T = max(prompt_lens), max(completion_lens)
    B = len(prompt_lens)
    out = {
        "prompt_ids": torch.full((B, P), PAD), "prompt_mask": torch.zeros(B, P, dtype=torch.long),
        "completion_ids": torch.full((B, T), PAD), "completion_mask": torch.zeros(B, T, dtype=torch.long),
        "old_per_token_logps": torch.zeros(B, T), "importance_sampling_ratio": torch.ones(B, 1),
        "advantages": torch.arange(B, dtype=torch.float) + first_id,
        "num_items_in_batch": torch.tensor(123),
    }
    nxt = first_id
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        out["prompt_ids"][i, P - p:] = torch.arange(nxt, nxt + p)
        out["prompt_mask"][i, P - p:] = 1
        nxt += p
        out["completion_ids"][i, :c] = torch.arange(nxt, nxt + c)
        out["completion_mask"][i, :c] = 1
        out["old_per_token_logps"][i, :c] = -torch.arange(1, c + 1, dtype=torch.float)
        nxt += c
    return out


def _strip(row_ids, row_mask):
    return row_ids[row_mask.bool()].tolist()


def test_gather_rollout_two_ranks_pads_to_widest_and_agrees():
    local = [_rollout([2, 3], [1, 3], first_id=1), _rollout([4, 1], [5, 2], first_id=100)]
    results = _run_ranks(2, lambda acc: rollout.gather_rollout(acc, local[acc.process_index], 2, PAD))
    g0, g1 = results
    for key in g0:
        assert torch.equal(g0[key], g1[key]), key
    assert "num_items_in_batch" not in g0  # not a row entry
    assert g0["prompt_ids"].shape == (4, 4) and g0["completion_ids"].shape == (4, 5)
    assert g0["importance_sampling_ratio"].shape == (4, 1)  # (B, 1) stays (B, 1)
    # rank 0's rows were re-padded: prompts on the left, completions on the right, and keep their tokens
    for r, rank in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        src = local[rank]
        i = r % 2
        assert _strip(g0["prompt_ids"][r], g0["prompt_mask"][r]) == _strip(src["prompt_ids"][i], src["prompt_mask"][i])
        assert _strip(g0["completion_ids"][r], g0["completion_mask"][r]) == _strip(
            src["completion_ids"][i], src["completion_mask"][i])
    assert g0["prompt_ids"][0].tolist() == [PAD, PAD, 1, 2] and g0["prompt_mask"][0].tolist() == [0, 0, 1, 1]
    assert g0["completion_ids"][0].tolist() == [3, PAD, PAD, PAD, PAD]
    assert g0["old_per_token_logps"][1].tolist() == [-1, -2, -3, 0, 0]


def test_concat_rollouts_repads_and_drops_partial_keys():
    a, b = _rollout([1], [2], 1), _rollout([3, 2], [4, 1], 50)
    b["sampling_per_token_logps"] = torch.zeros_like(b["old_per_token_logps"])
    a.pop("num_items_in_batch")
    b.pop("num_items_in_batch")
    joined = rollout.concat_rollouts([a, b], PAD)
    assert "sampling_per_token_logps" not in joined  # only in some rounds: cannot be filled in
    assert joined["prompt_ids"].shape == (3, 3) and joined["completion_ids"].shape == (3, 4)
    assert joined["prompt_ids"][0].tolist() == [PAD, PAD, 1]
    assert joined["completion_ids"][0].tolist() == [2, 3, PAD, PAD]
    assert joined["advantages"].tolist() == [1.0, 50.0, 51.0]


def _localize(acc, g, keep, pad_to_multiple_of=None):
    """The reference for `redistribute_rows`, through the global batch it avoids: keep the rows `keep` of the global
    batch `g` and hand each simulated process its contiguous share, trimmed; the loss tokens of all kept rows."""
    share = keep.numel() // acc.num_processes
    n = g["completion_mask"].shape[0]
    kept = {k: v[keep] for k, v in g.items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n}
    rank = acc.process_index
    out = rollout.trim_padding({k: v[rank * share : (rank + 1) * share] for k, v in kept.items()},
                               pad_to_multiple_of)
    out["num_items_in_batch"] = rollout.loss_mask(kept).sum()
    return out


def test_redistribute_rows_splits_trims_and_counts_tokens(threaded_exchange):
    g = _rollout([1, 4, 2, 1], [1, 2, 5, 1], 1)
    g.pop("num_items_in_batch")
    keep, sources = torch.tensor([3, 0, 2, 1]), torch.tensor([0, 1, 1, 0])  # batch row p lives on sources[p]

    def step(acc, pad=None):
        local = {k: v[keep[sources == acc.process_index]] for k, v in g.items()}
        return rollout.redistribute_rows(acc, local, sources, PAD, pad_to_multiple_of=pad)

    r0, r1 = _run_ranks(2, step)
    # each rank gets its contiguous share of the batch, in order
    assert r0["advantages"].tolist() == [4.0, 1.0] and r1["advantages"].tolist() == [3.0, 2.0]
    # rank 0 holds rows 3 and 0 (prompts of 1, completions of 1): trimmed to width 1 / 1
    assert r0["prompt_ids"].shape == (2, 1) and r0["completion_ids"].shape == (2, 1)
    assert r0["old_per_token_logps"].shape == (2, 1) and r0["importance_sampling_ratio"].shape == (2, 1)
    assert r1["prompt_ids"].shape == (2, 4) and r1["completion_ids"].shape == (2, 5)
    # the loss normaliser is global: 1 + 2 + 5 + 1 tokens, the same on both ranks
    assert r0["num_items_in_batch"].item() == 9 and r1["num_items_in_batch"].item() == 9
    # widths stay a multiple of pad_to_multiple_of when asked (as TRL pads)
    r0, _ = _run_ranks(2, lambda acc: step(acc, pad=4))
    assert r0["prompt_ids"].shape == (2, 4) and r0["completion_ids"].shape == (2, 4)


def test_redistribute_rows_counts_only_loss_tokens(threaded_exchange):
    g = _rollout([1, 1], [3, 3], 1)
    g.pop("num_items_in_batch")
    g["tool_mask"] = torch.tensor([[1, 0, 1]] * 2)
    out = _run_ranks(1, lambda acc: rollout.redistribute_rows(acc, g, torch.zeros(2, dtype=torch.long), PAD))[0]
    assert out["num_items_in_batch"].item() == 4  # 2 rows x 2 model tokens


def test_gather_rollout_round_trip_through_redistribute(threaded_exchange):
    local = [_rollout([2, 3, 1], [1, 3, 2], 1), _rollout([4, 1, 2], [5, 2, 1], 100)]
    sources = torch.tensor([0, 0, 0, 1, 1, 1])

    def step(acc):
        g = rollout.gather_rollout(acc, local[acc.process_index], 3, PAD)
        assert g["completion_ids"].shape == (6, 5)  # padded to the widest process
        rows = {k: v for k, v in local[acc.process_index].items() if k != "num_items_in_batch"}
        return rollout.redistribute_rows(acc, rows, sources, PAD)

    for rank, out in enumerate(_run_ranks(2, step)):
        src = local[rank]
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_per_token_logps"):
            assert torch.equal(out[key], src[key]), key
        assert out["num_items_in_batch"].item() == 14


def test_unknown_or_multimodal_keys_are_refused():
    g = _rollout([1, 1], [1, 1], 1)
    acc = _Acc(None, 0, 1)
    with pytest.raises(NotImplementedError, match="how 'mystery' is aligned"):
        rollout.gather_rollout(acc, {**g, "mystery": torch.zeros(2, 3)}, 2, PAD)
    with pytest.raises(NotImplementedError, match="multimodal"):
        rollout.gather_rollout(acc, {**g, "pixel_values": torch.zeros(7, 3), "num_images": [3, 4]}, 2, PAD)
    # a per-row scalar of unknown meaning is fine: it is moved like the rows
    assert rollout.gather_rollout(acc, {**g, "score": torch.ones(2)}, 2, PAD)["score"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------------------------------------ redistribute_rows
def _own_widths(rows):
    """The rows as a process would hold them: trimmed to the widths its own rows use."""
    p_used = int(rows["prompt_mask"].sum(dim=1).max()) if rows["prompt_mask"].numel() else 1
    c_used = int(rows["completion_mask"].sum(dim=1).max()) if rows["completion_mask"].numel() else 1
    out = {}
    for key, value in rows.items():
        if key in rollout.PROMPT_KEYS:
            out[key] = value[:, value.shape[1] - max(p_used, 1):]
        elif key in ("completion_ids", "completion_mask", "old_per_token_logps", "tool_mask"):
            out[key] = value[:, : max(c_used, 1)]
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("world,sources", [
    (2, [0, 0, 1, 0, 1, 1]),  # rank 0 sends one row to rank 1 and receives one from it
    (2, [1, 1, 1, 0, 0, 0]),  # every row changes process
    (3, [2, 0, 0, 1, 2, 2, 1, 0, 1]),
    (2, [0, 0, 0, 0]),  # rank 1 holds no row of the batch
])
def test_redistribute_rows_equals_gather_then_localize(threaded_exchange, world, sources):
    K = len(sources)
    torch.manual_seed(K + world)
    g = _rollout(torch.randint(1, 5, (K,)).tolist(), torch.randint(1, 6, (K,)).tolist(), 1)
    g.pop("num_items_in_batch")
    tools = torch.randint(0, 2, g["completion_ids"].shape)
    g["tool_mask"] = torch.where(g["completion_mask"].bool(), tools, torch.ones_like(tools))  # 1 on padding, as TRL
    src = torch.tensor(sources)
    expected = _run_ranks(world, lambda acc: _localize(acc, g, torch.arange(K)))

    def step(acc):
        local = _own_widths({k: v[src == acc.process_index] for k, v in g.items()})
        return rollout.redistribute_rows(acc, local, src, PAD)

    for rank, (got, want) in enumerate(zip(_run_ranks(world, step), expected)):
        assert sorted(got) == sorted(want), rank
        for key in want:
            assert torch.equal(got[key], want[key]), f"rank {rank}: {key}"


def test_redistribute_rows_one_process_and_uneven_split(threaded_exchange):
    g = _rollout([2, 1, 3, 1], [1, 4, 2, 1], 1)
    g.pop("num_items_in_batch")
    got = _run_ranks(1, lambda acc: rollout.redistribute_rows(acc, dict(g), torch.zeros(4, dtype=torch.long), PAD))
    want = _run_ranks(1, lambda acc: _localize(acc, g, torch.arange(4)))
    assert sorted(got[0]) == sorted(want[0]) and all(torch.equal(got[0][k], want[0][k]) for k in want[0])
    with pytest.raises(ValueError, match="evenly over 2 processes"):
        rollout.redistribute_rows(_Acc(None, 0, 2), g, torch.tensor([0, 0, 1]), PAD)
    with pytest.raises(ValueError, match="process 0 holds 3 rows of the batch but its rollout does not"):
        rollout.redistribute_rows(_Acc(None, 0, 2), g, torch.tensor([0, 0, 0, 1]), PAD)
    empty = {k: v[:0] for k, v in g.items()}  # no row selected anywhere: every process gets an empty batch
    none = torch.zeros(0, dtype=torch.long)
    for out in _run_ranks(2, lambda acc: rollout.redistribute_rows(acc, empty, none, PAD)):
        assert out["completion_ids"].shape[0] == 0 and out["num_items_in_batch"].item() == 0


# ------------------------------------------------------------------------------------------------ image inputs
# Each family's layout as TRL 1.16 puts it in a rollout (GRPOTrainer._generate_and_score_completions): built from
# per-row ground truth whose every pixel names its row, so that a row separated from its images is seen.
FAMILIES = ("qwen2_vl", "gemma3", "llava_next", "gemma4", "lfm2_vl", "internvl", "idefics")


def _row_truth(family, row, n_images, gen):
    """One row's prompt/completion and image inputs; every pixel value encodes (row, image, entry)."""
    prompt = torch.randint(1, 50, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen) + 1000 * row
    completion = torch.randint(1, 50, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)
    # which prompt tokens are image tokens (none without an image)
    types = (torch.rand(prompt.shape, generator=gen) < 0.5).long() * (n_images > 0)
    truth = {"prompt": prompt, "completion": completion, "types": types, "images": [], "extra": []}
    for i in range(n_images):
        if family == "qwen2_vl":
            grid = torch.tensor([1, 2, int(torch.randint(1, 4, (1,), generator=gen)) * 2])
            entries = int(grid.prod())
            truth["extra"].append(grid)
        elif family in ("lfm2_vl", "internvl"):
            entries = int(torch.randint(1, 4, (1,), generator=gen))  # tiles of this image
        else:
            entries = 1
        pixels = torch.arange(entries, dtype=torch.float).view(-1, 1, 1) + 100 * i + 10_000 * (row + 1)
        truth["images"].append(pixels.expand(entries, 3, 2).clone())
        if family == "llava_next":
            truth["extra"].append(torch.tensor([32 + row, 16 + i]))
        if family == "gemma4":
            truth["extra"].append(torch.tensor([row * 10 + i, 7]))
    return truth


def _trl_layout(family, rows):
    """The rollout dict TRL builds for these rows (prompts left-padded, completions right-padded)."""
    B = len(rows)
    P = max(r["prompt"].numel() for r in rows)
    C = max(r["completion"].numel() for r in rows)
    out = {"prompt_ids": torch.zeros(B, P, dtype=torch.long), "prompt_mask": torch.zeros(B, P, dtype=torch.long),
           "completion_ids": torch.zeros(B, C, dtype=torch.long),
           "completion_mask": torch.zeros(B, C, dtype=torch.long), "advantages": torch.arange(B, dtype=torch.float)}
    types = torch.zeros(B, P + C, dtype=torch.long)
    for i, r in enumerate(rows):
        p, c = r["prompt"].numel(), r["completion"].numel()
        out["prompt_ids"][i, P - p:], out["prompt_mask"][i, P - p:] = r["prompt"], 1
        out["completion_ids"][i, :c], out["completion_mask"][i, :c] = r["completion"], 1
        types[i, P - p: P] = r["types"]
    images = [img for r in rows for img in r["images"]]
    if not images:  # TRL leaves every image input out of a batch without images
        return out
    out["num_images"] = [len(r["images"]) for r in rows]
    if family == "idefics":  # one entry per row, padded to the most images of a row with zero images
        n = max(out["num_images"])
        out["pixel_values"] = torch.zeros(B, n, 3, 2)
        out["pixel_attention_mask"] = torch.zeros(B, n, 2, dtype=torch.bool)
        for i, r in enumerate(rows):
            for j, img in enumerate(r["images"]):
                out["pixel_values"][i, j], out["pixel_attention_mask"][i, j] = img[0], True
        return out
    out["pixel_values"] = torch.cat(images)
    extra = [e for r in rows for e in r["extra"]]
    if family == "qwen2_vl":
        out["image_grid_thw"] = torch.stack(extra)
        out["mm_token_type_ids"] = types
    elif family == "gemma3":
        out["token_type_ids"] = types
    elif family == "llava_next":
        out["image_sizes"] = torch.stack(extra)
    elif family == "gemma4":
        out["image_position_ids"] = torch.stack(extra)
    elif family in ("lfm2_vl", "internvl"):
        out["num_tiles"] = [sum(img.shape[0] for img in r["images"]) for r in rows]
        if family == "lfm2_vl":
            tiles = out["pixel_values"].shape[0]
            out["spatial_shapes"] = out["pixel_values"][:, 0, :2].long()  # per tile, names its row too
            out["pixel_attention_mask"] = out["pixel_values"][:, :, 0] > 0
            assert out["spatial_shapes"].shape[0] == tiles
    return out


def _vlm_rollout(family, num_images, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = [_row_truth(family, i, n, gen) for i, n in enumerate(num_images)]
    return rows, _trl_layout(family, rows)


def _assert_same_layout(got, want, family):
    want = {k: v for k, v in want.items() if k != "advantages"}
    got = {k: v for k, v in got.items() if k in want or k in rollout.MULTIMODAL_KEYS}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, list):
            assert got[key] == value, key
        elif family == "idefics" and key in ("pixel_values", "pixel_attention_mask"):
            width = value.shape[1]  # the moves may keep wider (zero) padding of images: the same rows otherwise
            assert not got[key][:, width:].any() and torch.equal(got[key][:, :width], value), key
        else:
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_selected_rows_keep_their_own_images(family):
    """A permutation and a subset of rows, through row_entries -> index -> redistribute_rows (one process): each kept
    row comes back with exactly its images (and image-token types), in TRL's layout; a row without an image too."""
    num_images = [1, 0, 2, 1, 3, 1]
    rows, batch = _vlm_rollout(family, num_images)
    for keep in ([5, 3, 0, 1, 4, 2], [2, 4], [1, 3], [1]):
        picked = rollout.row_entries(batch, len(rows))
        picked = {k: v[torch.tensor(keep)] for k, v in picked.items() if k != "advantages"}
        got = rollout.redistribute_rows(_Acc(None, 0, 1), picked, torch.zeros(len(keep), dtype=torch.long), PAD)
        _assert_same_layout(got, _trl_layout(family, [rows[i] for i in keep]), family)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_chunks_give_rows_without_images_no_image_inputs(family):
    """A forward's chunks of rows (TRL's reference / old log-prob chunks, the critic's): each chunk gets its own rows'
    image inputs in TRL's layout, and a chunk without any image none at all (TRL's slicing gives it empty image
    tensors). A micro-batch of TRL's split without an image (empty tensors, zero counts) gets none either."""
    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

    rows, batch = _vlm_rollout(family, [1, 0, 0, 0, 2, 1])
    fields = rollout.image_inputs(batch)
    chunks = rollout.image_chunks(fields, len(rows), batch_size=2)
    assert [(start, end) for start, end, _ in chunks] == [(0, 2), (2, 4), (4, 6)]
    assert chunks[1][2] == {}
    for start, end, images in (chunks[0], chunks[2]):
        expected = rollout.image_inputs(_trl_layout(family, rows[start:end]))
        # per-token types keep the batch's columns (the chunk's input_ids are the batch's rows)
        expected.update({key: fields[key][start:end] for key in rollout.SPANNING_KEYS if key in fields})
        _assert_same_layout(images, expected, family)
    assert rollout.image_chunks(fields, len(rows)) == [(0, 6, fields)]  # one chunk with images: as it is
    per_row = split_pixel_values_by_grid(fields)  # TRL's micro-batch of rows 1 and 2
    micro = unsplit_pixel_values_by_grid({key: value[1:3] for key, value in per_row.items()})
    assert micro.get("pixel_values") is not None
    assert rollout.image_chunks(micro, 2) == [(0, 2, {})]
    assert rollout.image_chunks(micro, 2, batch_size=1) == [(0, 1, {}), (1, 2, {})]
    # the trainer leaves TRL's own slicing alone where every chunk holds an image
    assert rollout.has_image_less_chunk(fields, 6, 2) and rollout.has_image_less_chunk(micro, 2)
    assert not rollout.has_image_less_chunk(fields, 6) and not rollout.has_image_less_chunk(fields, 6, 4)
    assert not rollout.has_image_less_chunk({"pixel_values": None, "num_images": None}, 6, 2)  # no image input


def test_misaligned_images_are_detected():
    """The check above fails if images are kept in their old order: the helper is not vacuous."""
    rows, batch = _vlm_rollout("qwen2_vl", [1, 2, 1])
    swapped = _trl_layout("qwen2_vl", [rows[2], rows[1], rows[0]])
    swapped["pixel_values"] = batch["pixel_values"]  # the rows permuted, their images not
    with pytest.raises(AssertionError):
        _assert_same_layout(swapped, _trl_layout("qwen2_vl", [rows[2], rows[1], rows[0]]), "qwen2_vl")


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "idefics"])
def test_rounds_with_and_without_images_join(family):
    """concat_rollouts (DAPO's rounds) of a round with images and one whose prompts had none (TRL then leaves every
    image input out): the image-less rows get no images, the others keep theirs."""
    rows_a, a = _vlm_rollout(family, [2, 1], seed=1)
    rows_b, b = _vlm_rollout(family, [0, 0, 0], seed=2)
    assert "pixel_values" not in b
    joined = rollout.concat_rollouts([rollout.row_entries(a, 2), rollout.row_entries(b, 3)], PAD)
    out = rollout.redistribute_rows(_Acc(None, 0, 1), joined, torch.zeros(5, dtype=torch.long), PAD)
    _assert_same_layout(out, _trl_layout(family, rows_a + rows_b), family)
    order = torch.tensor([3, 1, 4])  # only image-less rows but one
    out = rollout.redistribute_rows(_Acc(None, 0, 1), {k: v[order] for k, v in joined.items()},
                                    torch.zeros(3, dtype=torch.long), PAD)
    _assert_same_layout(out, _trl_layout(family, [(rows_a + rows_b)[i] for i in order]), family)
    only_plain = {k: v[torch.tensor([2, 4])] for k, v in joined.items()}
    out = rollout.redistribute_rows(_Acc(None, 0, 1), only_plain, torch.zeros(2, dtype=torch.long), PAD)
    assert not set(out) & set(rollout.MULTIMODAL_KEYS)  # as TRL leaves them out


def test_two_processes_move_rows_with_their_images(threaded_exchange, monkeypatch):
    """Rows change process with their images; rank 1's rollout has no image at all (its entries are agreed on)."""
    rows0, r0 = _vlm_rollout("qwen2_vl", [1, 2, 0], seed=5)
    rows1, r1 = _vlm_rollout("qwen2_vl", [0, 0, 0], seed=6)
    local = [rollout.row_entries(r0, 3), rollout.row_entries(r1, 3)]
    monkeypatch.setattr(rollout, "_gather_objects", lambda acc, obj: acc.world.gather_objects(acc.process_index,
                                                                                                  obj))
    sources = torch.tensor([1, 0, 1, 0, 0, 1])  # batch: rows1[0], rows0[0], rows1[1], rows0[1], rows0[2], rows1[2]
    held = [[0, 1, 2], [0, 1, 2]]  # each rank's rows of the batch, in batch order

    def step(acc):
        mine = local[acc.process_index]
        return rollout.redistribute_rows(acc, {k: v[torch.tensor(held[acc.process_index])]
                                               for k, v in mine.items()}, sources, PAD)

    out0, out1 = _run_ranks(2, step)
    _assert_same_layout(out0, _trl_layout("qwen2_vl", [rows1[0], rows0[0], rows1[1]]), "qwen2_vl")
    _assert_same_layout(out1, _trl_layout("qwen2_vl", [rows0[1], rows0[2], rows1[2]]), "qwen2_vl")


def tiled_rollout(tiles, row_ids, widest=None):
    """LLaVA-NeXT's layout of rows whose images have `tiles[i]` tiles each (a list per row, empty: no image):
    pixel_values (images, T, 1, 2), T the most tiles of the batch (`widest` when given: the processor pads every
    image's tiles to its batch's most with zeros), each real tile valued by its (row id, image, tile), and
    image_sizes naming each image's tile count (the model reads it to drop the padded tiles). Token ids name the row
    too."""
    ids = torch.tensor(row_ids).unsqueeze(1) * 10 + 1000
    batch = {"prompt_ids": ids + torch.tensor([1, 2]), "prompt_mask": torch.ones(len(tiles), 2, dtype=torch.long),
               "completion_ids": ids + torch.tensor([3, 4]), "completion_mask": torch.ones(len(tiles), 2,
                                                                                       dtype=torch.long),
               "advantages": torch.tensor(row_ids, dtype=torch.float)}
    images = [(row, i, n) for row, counts in zip(row_ids, tiles) for i, n in enumerate(counts)]
    if not images:
        return batch
    widest = widest or max(n for _, _, n in images)
    pixels = torch.zeros(len(images), widest, 1, 2)
    for j, (row, i, n) in enumerate(images):
        pixels[j, :n] = (10_000 * (row + 1) + 100 * i + torch.arange(1.0, n + 1)).view(n, 1, 1)
    return {**batch, "pixel_values": pixels, "image_sizes": torch.tensor([[n, row] for row, _, n in images]),
            "num_images": [len(counts) for counts in tiles]}


def _assert_same_images(got, want):
    assert sorted(k for k in got if k in rollout.MULTIMODAL_KEYS) == sorted(
        k for k in want if k in rollout.MULTIMODAL_KEYS)
    for key in ("pixel_values", "image_sizes"):
        if key in want:
            assert got[key].shape == want[key].shape and torch.equal(got[key], want[key]), key
    assert got.get("num_images") == want.get("num_images")


#: two generation rounds: square images (LLaVA-NeXT: a base view and 1 tile) then mostly 2:1 ones (2 tiles), whose
#: batch pads its square image to 3 entries too
ROUND_A = ([[2], [], [2, 2]], [0, 1, 2])
ROUND_B = ([[3], [3, 2]], [3, 4])


def test_rounds_with_other_tile_counts_join_and_rows_keep_their_own_tiles():
    """DAPO's rounds of LLaVA-NeXT rows with 2 and 3 tiles an image (`concat_rollouts` padded only the widths:
    "Sizes of tensors must match except in dimension 0"): every row keeps its own tiles and image sizes, in TRL's
    layout for the rows held: a batch of square-image rows gets its 2 tiles back (the joining's padding cut by the
    rows' extents), a mixed batch pads them with zero tiles as the processor would."""
    a, b = tiled_rollout(*ROUND_A), tiled_rollout(*ROUND_B)
    assert a["pixel_values"].shape[1:] != b["pixel_values"].shape[1:]
    joined = rollout.concat_rollouts([rollout.row_entries(a, 3), rollout.row_entries(b, 2)], PAD)
    one = _Acc(None, 0, 1)
    for keep in ([0, 1, 2, 3, 4], [2, 0], [4, 1], [3], [1]):
        picked = {k: v[torch.tensor(keep)] for k, v in joined.items() if k != "advantages"}
        out = rollout.redistribute_rows(one, picked, torch.zeros(len(keep), dtype=torch.long), PAD)
        rows = [(ROUND_A[0] + ROUND_B[0])[i] for i in keep]
        widest = max([2] + [3 for i in keep if i >= 3])  # round B's rows keep their batch's 3 tiles
        _assert_same_images(out, tiled_rollout(rows, keep, widest))


def test_two_processes_with_other_tile_counts_move_rows_with_their_tiles(threaded_exchange, monkeypatch):
    """Rank 0 holds square-image rows (2 tiles), rank 1 2:1 ones (3 tiles): the exchange pads every dimension to the
    widest of the processes (it padded only the widths: the tile dimensions differed), every row arrives with its
    own tiles, and a rank holding only square-image rows gets them with 2 tiles."""
    monkeypatch.setattr(rollout, "_gather_objects", lambda acc, obj: acc.world.gather_objects(acc.process_index,
                                                                                                  obj))
    local = [rollout.row_entries(tiled_rollout(*ROUND_A), 3),
             rollout.row_entries(tiled_rollout([[3], [3, 2], []], [3, 4, 5]), 3)]
    sources = torch.tensor([1, 0, 1, 0, 0, 1])  # batch: ids 3, 0, 4, 1, 2, 5

    def step(acc):
        return rollout.redistribute_rows(acc, local[acc.process_index], sources, PAD)

    out0, out1 = _run_ranks(2, step)
    _assert_same_images(out0, tiled_rollout([[3], [2], [3, 2]], [3, 0, 4], 3))
    _assert_same_images(out1, tiled_rollout([[], [2, 2], []], [1, 2, 5], 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_real_processes_with_other_tile_counts_agree_and_keep_each_rows_pixels(machines):
    """The exchange under `accelerate launch` (gloo, 2 CPU processes), rank 0 with square-image rows (2 entries an
    image), rank 1 with 2:1 ones (3): gloo refused the mismatched sizes ("Received data size doesn't match expected
    size"); now every row arrives with its own pixels, a rank without images takes part, the ranks' global views
    agree (tests/scripts/tiles_2proc.py)."""
    accelerate_launch("tiles_2proc.py", marker="TILES-2PROC-OK", timeout=240, machines=machines)


def test_unknown_multimodal_layouts_are_refused_naming_the_key():
    _, batch = _vlm_rollout("qwen2_vl", [1, 1])
    with pytest.raises(NotImplementedError, match="'pixel_values_videos'"):
        rollout.row_entries({**batch, "pixel_values_videos": torch.zeros(4, 3)}, 2)
    with pytest.raises(NotImplementedError, match="'pixel_values'"):  # neither per image nor per row
        rollout.row_entries({"num_images": [1, 1], **{k: v for k, v in batch.items() if k not in (
            "image_grid_thw", "mm_token_type_ids", "pixel_values")}, "pixel_values": torch.zeros(5, 3)}, 2)
    with pytest.raises(NotImplementedError, match="'mm_token_type_ids'"):
        rollout.row_entries({**batch, "mm_token_type_ids": torch.zeros(2, 3)}, 2)
    with pytest.raises(NotImplementedError, match="'pixel_values'.*row_entries"):  # unpacked into the moves
        rollout.gather_rollout(_Acc(None, 0, 1), batch, 2, PAD)
