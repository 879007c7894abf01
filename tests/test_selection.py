"""Row selection (`trl_ppo_variants/selection.py`): pure filters on hand-made rewards, and the accumulator that
assembles a batch of whole groups from generation rounds (screenings and their completions, several processes,
exhaustion, images carried with their rows). The moves of rows between processes are tested in tests/test_rollout.py."""

import pytest
import torch
from test_rollout import PAD, _Acc, _assert_same_layout, _trl_layout, _vlm_rollout

from trl_ppo_variants import rollout, selection


# ------------------------------------------------------------------------------------------------ pure decisions
def test_group_spread_mask_hand_made():
    rewards = torch.tensor(
        [
            1.0, 1.0, 1.0, 1.0,  # all correct: no spread
            0.0, 1.0, 0.0, 0.0,  # one correct: spread
            -1.0, -1.0, -1.0, -1.0,  # all wrong (paper's -1): no spread
            0.3, 0.1 + 0.2, 0.3, 0.3,  # equal up to float noise: an exact `std == 0` test would keep it
            float("nan"), 1.0, float("nan"), 0.0,  # two scorable rows that differ: spread
            float("nan"), 1.0, float("nan"), float("nan"),  # one scorable row: no spread
            float("nan"), float("nan"), float("nan"), float("nan"),
        ]
    )
    assert (0.1 + 0.2) != 0.3  # the noise is real
    assert selection.group_spread_mask(rewards, 4).tolist() == [False, True, False, False, True, False, False]
    # eps is a threshold on the sample std: [0, 0.01] has std 0.00707
    two = torch.tensor([0.0, 0.01])
    assert selection.group_spread_mask(two, 2, eps=0.007).tolist() == [True]
    assert selection.group_spread_mask(two, 2, eps=0.0071).tolist() == [False]


def test_group_spread_mask_rejects_ragged_batch():
    with pytest.raises(ValueError, match="multiple of group_size"):
        selection.group_spread_mask(torch.zeros(6), 4)


def test_group_rows():
    assert selection.group_rows(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert selection.group_rows(torch.tensor([], dtype=torch.long), 3).tolist() == []


@pytest.mark.parametrize(
    "G, world, spg, expected",
    [(4, 2, 1, 1), (4, 2, 4, 2), (3, 2, 1, 2), (2, 2, 4, 4), (16, 8, 16, 8), (5, 1, 1, 1), (6, 4, 3, 2)],
)
def test_group_multiple(G, world, spg, expected):
    m = selection.group_multiple(G, world, spg)
    assert m == expected
    assert (m * G) % (world * spg) == 0
    assert all((k * G) % (world * spg) != 0 for k in range(1, m))  # the smallest such


@pytest.mark.parametrize(
    "kept, multiple, expected",
    [(5, 2, (4, 0)), (6, 3, (6, 0)), (1, 2, (1, 1)), (0, 3, (0, 3)), (2, 4, (2, 2)), (7, 1, (7, 0))],
)
def test_exhausted_group_count(kept, multiple, expected):
    assert selection.exhausted_group_count(kept, multiple) == expected


# ------------------------------------------------------------------------------------------------ accumulator segments
def _numbered_round(values, first_row, world=1, rank=0, width=2):
    """A round whose completion_ids hold each row's number among the rows generated this step; this rank's share."""
    n = len(values)
    rows = torch.arange(first_row, first_row + n)
    rollout = {"prompt_ids": rows.unsqueeze(1).repeat(1, width), "prompt_mask": torch.ones(n, width, dtype=torch.long),
               "completion_ids": rows.unsqueeze(1).repeat(1, width),
               "completion_mask": torch.ones(n, width, dtype=torch.long)}
    share = n // world
    v = torch.tensor(values, dtype=torch.float)
    return {k: t[rank * share:(rank + 1) * share] for k, t in rollout.items()}, v.unsqueeze(1), v


SCREEN_ROUNDS = [  # G = 4, screening 2: (values, segments)
    ([1, 0, 1, 1, 0, 1, 0, 0],  # keys 0 (spread: accepted), 1 (all correct), 2 (accepted), 3 (all wrong)
     [selection.Segment(k, "screen", 2) for k in range(4)]),
    ([1, 1, 0, 1, 1, 1],  # completion of 0, screening of 4 (accepted), completion of 2
     [selection.Segment(0, "complete", 2), selection.Segment(4, "screen", 2), selection.Segment(2, "complete", 2)]),
]


def test_screening_and_completion_make_one_group_screening_rows_first():
    acc = selection.GroupAccumulator(target_groups=2, group_size=4)
    first = acc.add_round(*_numbered_round(SCREEN_ROUNDS[0][0], 0), segments=SCREEN_ROUNDS[0][1])
    assert first.accepted == [0, 2] and (first.screened, first.with_spread) == (4, 2)
    assert first.outcomes == [(0, "spread"), (1, "easy"), (2, "spread"), (3, "hard")]
    assert acc.num_kept == 0 and acc.pending_keys() == [0, 2]
    second = acc.add_round(*_numbered_round(SCREEN_ROUNDS[1][0], 8), segments=SCREEN_ROUNDS[1][1])
    assert second.accepted == [4] and acc.full and acc.pending_keys() == [4]
    batch, sources, rewards, positions, real_rows, exhausted = acc.finalize(pad_token_id=-1)
    assert not exhausted and real_rows == 8
    # group of key 0: its screening rows (0, 1), then its completion rows (8, 9); then key 2: (4, 5) + (12, 13)
    assert positions.tolist() == [0, 1, 8, 9, 4, 5, 12, 13]
    assert batch["completion_ids"][:, 0].tolist() == positions.tolist()
    assert rewards[:, 0].tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert (acc.groups_generated, acc.groups_with_spread, acc.dropped_correct, acc.dropped_wrong) == (5, 3, 1, 1)


def test_a_completion_without_its_screening_is_refused():
    acc = selection.GroupAccumulator(target_groups=1, group_size=4)
    with pytest.raises(ValueError, match="which no screening accepted"):
        acc.add_round(*_numbered_round([1, 0], 0), segments=[selection.Segment(7, "complete", 2)])


def test_screened_groups_split_over_two_processes_hold_only_local_rows():
    """4 rows per process in round 1, 3 in round 2 (the screening of key 4 spans both processes): every process
    agrees on the batch and holds exactly its own rows of it."""
    def run(world, rank):
        acc = selection.GroupAccumulator(target_groups=2, group_size=4, rank=rank, world=world)
        first = 0
        for values, segments in SCREEN_ROUNDS:
            acc.add_round(*_numbered_round(values, first, world, rank), segments=segments)
            first += len(values)
        return acc.finalize(pad_token_id=0)

    single = run(1, 0)
    ranks = [run(2, r) for r in range(2)]
    for part in (1, 2, 3, 4, 5):
        assert all(torch.equal(torch.as_tensor(r[part]), torch.as_tensor(ranks[0][part])) for r in ranks)
    assert torch.equal(ranks[0][3], single[3])
    sources, positions = ranks[0][1].tolist(), ranks[0][3].tolist()
    assert sources == [p // 4 if p < 8 else (p - 8) // 3 for p in positions]
    for rank in range(2):
        assert ranks[rank][0]["completion_ids"][:, 0].tolist() == [p for p, s in zip(positions, sources) if s == rank]


def test_exhausted_screening_pads_with_dropped_then_unfinished_rows():
    """The round limit hits before any group is whole: placeholder rows come from the dropped screenings, then from
    the accepted screenings never completed (never from nowhere), G rows per placeholder group."""
    acc = selection.GroupAccumulator(target_groups=2, group_size=4, multiple=1)
    acc.add_round(*_numbered_round(SCREEN_ROUNDS[0][0], 0), segments=SCREEN_ROUNDS[0][1])
    batch, sources, rewards, positions, real_rows, exhausted = acc.finalize(pad_token_id=0)
    assert exhausted and real_rows == 0
    assert positions.tolist() == [2, 3, 6, 7]  # the dropped screenings (keys 1 and 3) make one placeholder group
    acc = selection.GroupAccumulator(target_groups=2, group_size=4, multiple=2)
    acc.add_round(*_numbered_round(SCREEN_ROUNDS[0][0], 0), segments=SCREEN_ROUNDS[0][1])
    *_, positions, real_rows, exhausted = acc.finalize(pad_token_id=0)
    assert exhausted and positions.tolist() == [2, 3, 6, 7, 0, 1, 4, 5]  # then the unfinished accepted ones


def test_surplus_completions_are_trimmed_and_extras_follow_the_rows():
    acc = selection.GroupAccumulator(target_groups=1, group_size=4)
    steps = torch.arange(8.0).unsqueeze(1)
    acc.add_round(*_numbered_round(SCREEN_ROUNDS[0][0], 0), segments=SCREEN_ROUNDS[0][1], extras={"s": steps})
    acc.add_round(*_numbered_round([1, 1, 0, 0], 8), extras={"s": torch.full((4, 3), 5.0)},
                  segments=[selection.Segment(0, "complete", 2), selection.Segment(2, "complete", 2)])
    *_, positions, real_rows, _ = acc.finalize(pad_token_id=0)
    assert positions.tolist() == [0, 1, 8, 9] and acc.trimmed == 1
    extras = acc.final_extras["s"]
    assert extras.shape == (4, 3) and extras[:2, 0].tolist() == [0.0, 1.0] and torch.isnan(extras[0, 1])
    assert extras[2:].tolist() == [[5.0] * 3] * 2


def test_accumulated_rounds_keep_images_with_rows():
    """DAPO's GroupAccumulator over two rounds (one without images): the kept groups' rows carry their images."""
    rows_a, a = _vlm_rollout("qwen2_vl", [1, 2, 1, 1], seed=3)
    rows_b, b = _vlm_rollout("qwen2_vl", [0, 0, 1, 2], seed=4)
    acc = selection.GroupAccumulator(target_groups=2, group_size=2)
    acc.add_round(rollout.row_entries(a, 4), torch.tensor([[1.0], [1.0], [0.0], [1.0]]),
                  torch.tensor([1.0, 1.0, 0.0, 1.0]))  # group 0 has no spread, group 1 has
    acc.add_round(rollout.row_entries(b, 4), torch.tensor([[0.0], [1.0], [0.0], [0.0]]),
                  torch.tensor([0.0, 1.0, 0.0, 0.0]))
    local, sources, *_ = acc.finalize(PAD)
    out = rollout.redistribute_rows(_Acc(None, 0, 1), local, sources, PAD)
    _assert_same_layout(out, _trl_layout("qwen2_vl", [rows_a[2], rows_a[3], rows_b[0], rows_b[1]]), "qwen2_vl")
