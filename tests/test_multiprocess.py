"""Two processes on CPU (gloo) with groups split across ranks: REINFORCE++ and RLOO complete, the ranks agree on
the global advantages and end with identical weights, and the advantages are the pure functions' on the gathered
rewards, masks and KL (script: tests/scripts/advantages_2proc.py). One sample per prompt: REINFORCE++ and ReMax with
`num_generations=1` train and evaluate, with each optimizer step normalised by its own tokens summed over the
processes (script: tests/scripts/one_sample_2proc.py)."""

import json
import math

import pytest
import torch
from launcher import accelerate_launch

from trl_ppo_variants.advantages import reinforce_pp_advantages, rloo_advantages


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_split_groups(toy_model_dir, tmp_path, machines):
    accelerate_launch("advantages_2proc.py", toy_model_dir, tmp_path, marker="ADVANTAGES-2PROC-OK", machines=machines)
    for algo in ("reinforce_pp", "rloo"):
        ranks = [torch.load(tmp_path / f"{algo}_rank{r}.pt", weights_only=False) for r in range(2)]
        assert [r["world_size"] for r in ranks] == [2, 2], algo
        assert [r["global_step"] for r in ranks] == [3, 3], algo
        torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"], rtol=0, atol=0, msg=algo)
        records = [r["records"] for r in ranks]
        assert len(records[0]) == len(records[1]) == 3, algo
        saw_kl = False
        for step, (rec0, rec1) in enumerate(zip(*records)):
            where = f"{algo} step {step}"
            assert rec0["rewards"].shape == (12,) and rec0["group_size"] == 4, where  # group 1 = rows 4-7 split
            for key in ("rewards", "completion_mask", "kl_in_reward", "advantages"):
                assert torch.equal(torch.nan_to_num(rec0[key]), torch.nan_to_num(rec1[key])), f"{where}: {key}"
            kl, mask = rec0["kl_in_reward"], rec0["completion_mask"]
            saw_kl |= bool(kl.abs().sum() > 0)
            if algo == "reinforce_pp":
                expected = reinforce_pp_advantages(rec0["rewards"], mask, kl=kl, kl_coef=0.05)
            else:
                expected = rloo_advantages(rec0["rewards"] - 0.05 * kl.sum(1), 4)
            torch.testing.assert_close(rec0["advantages"], expected, rtol=1e-5, atol=1e-6, msg=where)
            for rank, rec in enumerate((rec0, rec1)):  # each rank trains on its own contiguous slice
                local = rec["local_advantages"]
                global_slice = rec0["advantages"][rank * 6 : (rank + 1) * 6]
                if global_slice.dim() == 2:
                    width = rec["local_completion_mask"].shape[1]
                    assert not global_slice[:, width:].any(), where  # trimmed columns are padding only
                    global_slice = global_slice[:, :width]
                assert torch.equal(local, global_slice), f"{where}: rank {rank} slice"
        assert saw_kl, f"{algo}: the KL in the reward was 0 at every step"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_one_sample_per_prompt(toy_model_dir, tmp_path, machines):
    accelerate_launch("one_sample_2proc.py", toy_model_dir, tmp_path, marker="ONE-SAMPLE-2PROC-OK",
                      machines=machines)
    for algo in ("reinforce_pp", "remax"):
        ranks = [json.loads((tmp_path / f"{algo}_rank{r}.json").read_text()) for r in range(2)]
        assert [r["world_size"] for r in ranks] == [2, 2] and [r["global_step"] for r in ranks] == [4, 4], algo
        assert ranks[0]["weights"] == ranks[1]["weights"], algo
        assert ranks[0]["records"] == ranks[1]["records"], algo  # every rank estimated the same global batch
        records = ranks[0]["records"]
        # 2 generation batches of 12 prompts (3 per process and step, 2 steps each), 1 eval batch of 6: groups of one
        assert [(r["training"], r["group_size"], len(r["rewards"])) for r in records] == \
            [(True, 1, 12), (True, 1, 12), (False, 1, 6)], algo
        if algo == "remax":  # one greedy row per sample, A = r - r(greedy)
            for r in records:
                assert len(r["baseline"]) == len(r["rewards"])
                assert r["advantages"] == pytest.approx([a - b for a, b in zip(r["rewards"], r["baseline"])])
        # each optimizer step (one micro-batch per process) is normalised by its own tokens on both processes:
        # TRL's "dapo" normaliser divides num_items_in_batch by steps_per_generation / accumulation = 2
        steps = list(zip(ranks[0]["micro_batches"], ranks[1]["micro_batches"]))
        assert len(steps) == 4, algo
        for mine, theirs in steps:
            assert mine["step"] == theirs["step"] and mine["num_items_in_batch"] == theirs["num_items_in_batch"]
            assert mine["num_items_in_batch"] / 2 == mine["tokens"] + theirs["tokens"], algo
        logs = ranks[0]["log_history"]
        # rewards are logged at the steps that generated (2 of 4), the losses at every step
        assert sum("eval_reward" in h for h in logs) == 1 and sum("reward" in h for h in logs) == 2, algo
        assert sum("loss" in h for h in logs) == 4, algo
        for entry in logs:
            assert not any("frac_reward_zero_std" in key for key in entry), algo
            for key, value in entry.items():
                assert value is not None and (not isinstance(value, float) or math.isfinite(value)), (algo, key)
