"""TRL's vLLM colocate mode with several processes and DeepSpeed ZeRO-3, on vLLM's CPU build.

One `accelerate launch` with `tests/configs/critic_zero3.yaml` (2 processes, gloo) runs `tests/scripts/vllm_zero3.py`:
each process builds its own engine (TRL's `external_launcher`, tensor-parallel size 1) and trains GRPO, GRPO with a
LoRA policy, PPO (LoRA critic) and PPO with a LoRA policy (critic as a second adapter) for 2 steps each, generating
with its engine; TRL's sync gathers each sharded parameter (all of them at once to merge a LoRA policy) before
loading it. Each test reads its case from that run's per-rank results. Skipped where vLLM's CPU build or DeepSpeed is
missing (`make test-vllm` runs it in `.venv-vllm`).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from test_vllm import ENGINE_BOUND, LAUNCHER  # the single-process tests' bound, and their launcher

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "vllm_zero3.py"
PORT = 29711  # this test's port (other tests' ranges must not overlap)
CASES = ["grpo", "grpo_lora", "ppo", "ppo_lora"]
RANKS = 2
MISSING = [name for name in ("vllm", "deepspeed") if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(bool(MISSING), reason=f"{' and '.join(MISSING)} not installed here (`make test-vllm` runs "
                                             "these tests with vLLM's CPU build and DeepSpeed)"),
]


def zero3_command(directory):
    """The `accelerate launch` of `vllm_zero3.py` on the tied-head toy model (head_dim 32), into `directory`."""
    from trl_ppo_variants.toy import make_toy_checkpoint

    model_dir = make_toy_checkpoint(os.path.join(directory, "model"), warm_steps=12, hidden_size=128,
                                    tie_word_embeddings=True)
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "tests" / "configs" / "critic_zero3.yaml"), "--num_processes", str(RANKS),
           "--main_process_port", str(PORT), str(SCRIPT), model_dir, directory, *CASES]
    return cmd, {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


# two processes: two of the launcher's slots, so first (a cost above every other run's): it then runs alone, and the
# single-process runs fill both slots after it instead of one waiting for the other to end
LAUNCHER.add("zero3", "zero3_run", 10_000, zero3_command, slots=RANKS, timeout=900)


@pytest.fixture(scope="module")
def zero3_run(request):
    """{case: [rank 0's result, rank 1's result]} of the ZeRO-3 launch (`LAUNCHER`, beside the single-process runs)."""
    directory, proc = LAUNCHER.result("zero3", request)
    assert proc.returncode == 0, proc.stdout[-8000:]
    # `distributed.finish` destroys the engines' groups first: vLLM's exit-time finalizer then has nothing to destroy
    assert "Invalid process group" not in proc.stdout, proc.stdout[-5000:]
    ranks = [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {case: [rank[case] for rank in ranks] for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_each_rank_trains_with_its_own_engine_under_zero3(case, zero3_run):
    """Every rank built an engine, its parameters were ZeRO-3 partitions (about half the elements each), it trained 2
    steps generating its own 8 completions per step with its engine, and the policy moved, the same on both ranks."""
    for rank, result in enumerate(zero3_run[case]):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["engine"] == "CPUColocateVLLMGeneration" and result["world"] == RANKS, result
        assert result["deepspeed_stage"] == 3 and result["local_fraction"] < 0.6, result
        assert result["steps"] == 2 and result["generate_calls"] == [[0, 8], [1, 8]], result
        assert result["policy_moved"] > 1e-3, result
        differences = [h["sampling/sampling_logp_difference/max"] for h in result["logs"]]
        assert len(differences) == 2 and max(differences) <= ENGINE_BOUND, (rank, result["logs"])
    assert zero3_run[case][0]["policy_moved"] == zero3_run[case][1]["policy_moved"]


@pytest.mark.parametrize("case", CASES)
def test_each_ranks_synced_engine_matches_its_policy_under_zero3(case, zero3_run):
    """Per rank: the engine scores fixed completions as the policy's forward with the full (gathered) parameters does,
    before training and after 2 steps and a sync, and the synced engine is far from the untrained policy (the sync
    carried the training's change; a LoRA policy's adapter merged into it)."""
    for rank, result in enumerate(zero3_run[case]):
        assert result["untrained"] <= ENGINE_BOUND and result["trained"] <= ENGINE_BOUND, (rank, result)
        assert result["engine_vs_initial_policy"] > 1e-2, (rank, result)


@pytest.mark.parametrize("case", ["ppo", "ppo_lora"])
def test_ppos_critic_trains_and_stays_out_of_the_engine_under_zero3(case, zero3_run):
    """PPO's critic (a LoRA critic on the reference weights; a second adapter of a LoRA policy) trained, and the sync
    sent the policy only: the engine matches the policy (above) and loading did not fail on the critic's names."""
    for result in zero3_run[case]:
        assert result["critic_moved"] > 1e-3, result
