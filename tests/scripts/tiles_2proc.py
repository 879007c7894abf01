"""2 processes (gloo, launched by tests/test_rollout.py with `accelerate launch --num_processes 2`) whose rows'
images have different tile counts (LLaVA-NeXT: a square image 2 entries, a 2:1 one 3): rank 0 holds square-image
rows, rank 1 2:1 ones (and a row without an image). Rows move between the processes with `redistribute_rows` (the
exchange pads every dimension to the widest of the processes: it padded only the widths, and the tile dimensions
disagreed), in three cases: rows cross both ways, rank 1 holds no image at all (its entries agreed on from rank 0's),
and the global view (`gather_rollout`). Checks on every rank: each row arrives with its own pixels and image sizes
in TRL's layout for the rows held (no padding their own batch did not have), and the ranks agree on the global view
and on which rows each holds.

Prints "TILES-2PROC-OK" on the main process when every check passed.
"""

from _common import main_then_finish  # first: offline, one torch thread, tests/ on the path
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from test_rollout import PAD, ROUND_A, tiled_rollout

from trl_ppo_variants import rollout

#: rank 1's rows: 2:1 images (3 entries), one padded by its batch, and a row without an image
ROUND_B = ([[3], [3, 2], []], [3, 4, 5])
TEXT_ONLY = ([[], [], []], [6, 7, 8])


def check(got: dict, tiles: list, row_ids: list, widest: int, where: str) -> None:
    want = tiled_rollout(tiles, row_ids, widest)
    for key in ("prompt_ids", "completion_ids", "pixel_values", "image_sizes"):
        if key in want:
            assert key in got and got[key].shape == want[key].shape and torch.equal(got[key], want[key]), (
                f"{where}: {key} {tuple(got[key].shape) if key in got else None} != {tuple(want[key].shape)}")
        else:
            assert key not in got, f"{where}: {key} in a batch without images"
    assert got.get("num_images") == want.get("num_images"), where


def main() -> None:
    acc = Accelerator()
    rank = acc.process_index
    assert acc.num_processes == 2, "launch with --num_processes 2"
    truth = {row: tiles for tiles_ids in (ROUND_A, ROUND_B, TEXT_ONLY) for row, tiles in zip(tiles_ids[1], tiles_ids[0])}

    # rows cross both ways: the batch is ids 3, 0, 4 | 1, 2, 5 (process order), rank 0 holds 0, 1, 2
    local = rollout.row_entries(tiled_rollout(*(ROUND_A if rank == 0 else ROUND_B)), 3)
    sources = torch.tensor([1, 0, 1, 0, 0, 1])
    out = rollout.redistribute_rows(acc, local, sources, PAD)
    mine = [[3, 0, 4], [1, 2, 5]][rank]
    check(out, [truth[i] for i in mine], mine, [3, 2][rank], f"crossing, rank {rank}")

    # rank 1 without any image: its rows get rank 0's entries (empty), rank 0's rows keep their 2 entries
    local = rollout.row_entries(tiled_rollout(*(ROUND_A if rank == 0 else TEXT_ONLY)), 3)
    out = rollout.redistribute_rows(acc, local, torch.tensor([1, 0, 0, 1, 0, 1]), PAD)
    mine = [[6, 0, 1], [7, 2, 8]][rank]
    check(out, [truth[i] for i in mine], mine, 2, f"one rank without images, rank {rank}")

    # the global view is the same on both ranks, every row with its own pixels (padded to 3 entries)
    local = rollout.row_entries(tiled_rollout(*(ROUND_A if rank == 0 else ROUND_B)), 3)
    view = rollout.unpack_multimodal(rollout.gather_rollout(acc, local, 3, PAD))
    everyone = [0, 1, 2, 3, 4, 5]
    check(view, [truth[i] for i in everyone], everyone, 3, f"global view, rank {rank}")
    shared = gather_object([{k: v for k, v in view.items() if isinstance(v, torch.Tensor)}])
    assert all(torch.equal(shared[0][k], shared[1][k]) for k in shared[0]), "the ranks' global views differ"

    acc.wait_for_everyone()
    if acc.is_main_process:
        print("TILES-2PROC-OK", flush=True)


if __name__ == "__main__":
    main_then_finish(main)
