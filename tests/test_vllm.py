"""vLLM's CPU build under the trainers (`trl_ppo_variants/vllm_cpu.py`).

The real-engine tests need vLLM's CPU build, which pins an older transformers than the main test environment: they
run in the second virtualenv that `make test-vllm` (and `make test`) builds (`.venv-vllm`). vLLM allows one engine
per process, so `tests/scripts/vllm_colocate.py` runs every case of a model (tied head: every trainer and the
learning check; untied head: three of them) in one subprocess sharing one engine; each test reads its case from that
run. Elsewhere they are skipped with that reason; the configuration checks run everywhere.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import toy_args

from trl_ppo_variants import vllm_cpu
from trl_ppo_variants.trainers.rloo import RLOOConfig

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "vllm_colocate.py")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM's CPU build is not installed here (`make test-vllm` runs these tests)")
#: engine vs policy, max per-token |log-prob difference| of fixed completions, fp32: measured <= 9.5e-7 before and
#: after 2 steps at lr 3e-2 and a sync on the toy model, every trainer, tied or untied head, full or LoRA (vllm-cpu
#: 0.31.0); 3.6e-5 / 5.9e-5 on SmolLM2-135M. The sampled tokens' difference TRL logs while training is <= 1.4e-6.
ENGINE_BOUND = 1e-4


def test_server_mode_is_refused_with_vllms_cpu_build(tmp_path, monkeypatch):
    """TRL sends the weights to a `trl vllm-serve` server over NCCL: with vLLM's CPU build, one line naming colocate."""
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: True)
    with pytest.raises(ValueError, match=r"^vllm_mode: expected 'colocate' with vLLM's CPU build") as err:
        toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="server")
    assert "\n" not in str(err.value)
    toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="colocate")
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: False)  # a GPU build: TRL's server mode as it is
    toy_args(RLOOConfig, tmp_path, use_vllm=True, vllm_mode="server")


def test_the_cpu_engine_is_only_swapped_in_for_colocate_on_cpu(monkeypatch):
    """`cpu_colocate_engine` rebinds TRL's `VLLMGeneration` only while a CPU colocate engine is built, and restores it."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    args = RLOOConfig.__new__(RLOOConfig)  # the fields the check reads, without a full config
    args.use_vllm, args.vllm_mode = True, "colocate"
    monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda: True)
    with vllm_cpu.cpu_colocate_engine(args):
        assert grpo_module.VLLMGeneration.__name__ == "CPUColocateVLLMGeneration"
        assert issubclass(grpo_module.VLLMGeneration, original)
    assert grpo_module.VLLMGeneration is original
    for use_vllm, mode, on_cpu in [(False, "colocate", True), (True, "server", True), (True, "colocate", False)]:
        args.use_vllm, args.vllm_mode = use_vllm, mode
        monkeypatch.setattr(vllm_cpu, "engine_runs_on_cpu", lambda on_cpu=on_cpu: on_cpu)
        with vllm_cpu.cpu_colocate_engine(args):
            assert grpo_module.VLLMGeneration is original



def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_colocate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = list(_load_script().CASES)
UNTIED = ["grpo", "rloo_lora", "ppo_lora"]  # an untied LM head: full and merged-LoRA syncs, a critic left out
#: the cases whose policy is not meant to move: every importance-sampling ratio is masked (`ppo_is_masked`)
FROZEN_POLICY = {"ppo_is_masked"}


def _run(tmp_path, tie, *cases):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, SCRIPT, str(out), tie, *cases], capture_output=True, text=True,
                          timeout=2400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    """Every case on the tied-head toy model, and the learning check (first: its batch of 64 sizes the engine)."""
    return _run(tmp_path_factory.mktemp("vllm_tied"), "tied", "learning", *CASES)


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("vllm_untied"), "untied", *UNTIED)


def _case(run, name):
    result = run[name]
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


def _logged(result, key):
    return [h[key] for h in result["logs"] if key in h]


def _assert_engine_matches_the_policy(result):
    """The engine scores fixed completions as the policy's forward does, before training and after 2 steps and a
    sync that carried the training's change; TRL's own measure on the sampled tokens agrees."""
    assert result["engine"] == "CPUColocateVLLMGeneration" and result["steps"] == 2, result
    assert result["untrained"] <= ENGINE_BOUND and result["trained"] <= ENGINE_BOUND, result
    if result["case"] not in FROZEN_POLICY:
        assert result["policy_moved"] > 1e-3, result
        assert result["engine_vs_initial_policy"] > 100 * ENGINE_BOUND, result  # the sync is not vacuous
    differences = _logged(result, "sampling/sampling_logp_difference/max")
    if result["case"] != "rloo_vllm_logps":  # TRL's correction (default) logs the sampled tokens' difference
        assert len(differences) == 2 and max(differences) <= ENGINE_BOUND, result["logs"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", CASES)
def test_every_trainer_trains_under_the_colocate_engine(case, tied_run):
    """Each trainer (tied LM head; full, LoRA policy; PPO/VAPO with their critics) trains 2 steps with generation by a
    real vLLM engine on CPU, and the synced engine then matches the policy within `ENGINE_BOUND`."""
    _assert_engine_matches_the_policy(_case(tied_run, case))


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", UNTIED)
def test_trainers_with_an_untied_head_under_the_colocate_engine(case, untied_run):
    _assert_engine_matches_the_policy(_case(untied_run, case))


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_remax_greedy_rows_are_the_engines_greedy_decoding(tied_run):
    """ReMax's baseline rows come from the engine in a temperature-0 request after the sampled rows (one per group):
    equal to a temperature-0 generation of the same engine, and the policy's argmax at every position."""
    result = _case(tied_run, "remax")
    groups = 2  # 8 rows, 4 per group
    assert result["generate_calls"] == [[0, 8], [0, groups], [1, 8], [1, groups]], result["generate_calls"]
    assert len(result["greedy"]) == 2, result["greedy"]
    for record in result["greedy"]:
        assert record["rows"] == groups and record["equal_to_temperature_0"], record
        assert record["argmax_gap"] <= ENGINE_BOUND, record


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case, prefix, block", [("dapo", "dapo", 4), ("grpo_speed", "selection", 2),
                                                 ("grpo_greso", "selection", 4)])
def test_prompt_selection_rounds_are_one_engine_call_each(case, prefix, block, tied_run):
    """Dynamic sampling (DAPO), SPEED and GRESO under the engine: half the prompts have no reward spread, so steps
    take several rounds; each round is one vLLM call whose first holds the step's whole first round (over-sampled
    once a keep rate was observed), `block` completions per prompt (SPEED screens with 2)."""
    result = _case(tied_run, case)
    rounds = _logged(result, f"{prefix}/rounds")
    first_round = _logged(result, f"{prefix}/first_round_prompts")
    for step in (0, 1):
        calls = [rows for s, rows in result["generate_calls"] if s == step]
        assert len(calls) == rounds[step], (result["generate_calls"], rounds)
        assert calls[0] == first_round[step] * block, (calls, first_round)
    assert max(rounds) >= 2, rounds
    assert first_round[1] > 2, first_round  # over-sampled beyond the 2 groups a step trains on


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", ["rloo", "rloo_vllm_logps", "rloo_lora", "reinforce_pp", "ppo"])
def test_kl_in_the_reward_is_zero_at_step_0_under_the_engine(case, tied_run):
    """With policy == reference at step 0 the KL in the reward is 0 within the bound, then positive. With TRL's
    importance-sampling correction (default) its sampling log-probs are TRL's forward (`old_per_token_logps`);
    without it (`rloo_vllm_logps`) they are the engine's."""
    result = _case(tied_run, case)
    kl = _logged(result, "kl_in_reward")
    assert len(kl) == 2 and abs(kl[0]) <= ENGINE_BOUND and kl[1] > 0, kl
    corrected = _logged(result, "sampling/importance_sampling_ratio/mean")
    assert (corrected == []) == (case == "rloo_vllm_logps"), result["logs"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_importance_sampling_correction_weights_the_policy_loss_not_the_value_loss(tied_run):
    """TRL's `vllm_importance_sampling_correction` multiplies the per-token policy loss by the engine-vs-policy ratio.
    Masking every ratio (token_mask outside [2, 3]: the ratios are 1 within the bound) leaves PPO's policy exactly
    where it was, while the value loss, which the correction does not weight, still trains the critic."""
    result = _case(tied_run, "ppo_is_masked")
    assert _logged(result, "sampling/importance_sampling_ratio/max") == [0.0, 0.0], result["logs"]
    assert result["policy_moved"] == 0.0 and result["critic_moved"] > 1e-3, result
    for name in ("rloo", "ppo"):  # unmasked: every ratio is 1 within the bound
        ratios = _logged(_case(tied_run, name), "sampling/importance_sampling_ratio/min")
        ratios += _logged(_case(tied_run, name), "sampling/importance_sampling_ratio/max")
        assert all(abs(math.log(r)) <= ENGINE_BOUND for r in ratios), ratios


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("case", ["ppo", "ppo_full_critic", "ppo_lora", "vapo"])
def test_the_critic_trains_and_stays_out_of_the_engine(case, tied_run):
    """PPO (LoRA critic, full critic, LoRA policy with the critic as a second adapter) and VAPO under the engine: the
    critic moved, and the sync sent the policy only (the engine matches the policy, checked above, and the sync did
    not fail on the critic's names)."""
    assert _case(tied_run, case)["critic_moved"] > 1e-3


#: the learning check, measured: mean gain over seeds 0, 1, 2 with HF `generate` / with the engine (toy reward of 200
#: seeded samples, 30 steps, `make demo-toy`'s settings; TTRL at lr 1e-3, its gain in agreement with its own majority
#: vote: it has no labels, and on this model its votes are mostly wrong, so its toy reward falls with either engine,
#: -0.13 / -0.16). A single seed is too noisy to compare (GRPO seed 1: vLLM 0.47x HF; RLOO seed 1: 0.38x), hence the
#: means. Process GRPO's toy reward is one step long, where its advantage is GRPO's: its gains equal GRPO's.
LEARNED = {"grpo": (0.258, 0.280), "rloo": (0.235, 0.235), "remax": (0.115, 0.105), "reinforce_pp": (0.238, 0.325),
           "reinforce_pp_baseline": (0.242, 0.265), "dapo": (0.370, 0.397), "ppo": (0.242, 0.290),
           "vapo": (0.260, 0.273), "ttrl": (0.472, 0.488), "process_grpo": (0.258, 0.280)}
LEARN_MIN_GAIN = 0.08  # every trainer must learn with HF `generate` first, or half of its gain means nothing


@needs_vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("algo", list(LEARNED))
def test_each_trainer_learns_with_the_engine_at_least_half_as_much_as_with_hf_generate(algo, tied_run):
    """Each trainer on the toy task, same checkpoint, seeds and steps: generated by the engine, the mean gain over the
    seeds is at least half the mean gain with HF `generate` (which must itself learn: `LEARN_MIN_GAIN`). The gain is
    in toy reward; TTRL's, in agreement with its majority vote (what it trains on)."""
    seeds = list(_case(tied_run, "learning")["algorithms"][algo]["seeds"].values())
    suffix = "_agreement" if algo == "ttrl" else ""

    def gain(backend):
        return sum(s[backend + suffix] - s["before" + suffix] for s in seeds) / len(seeds)

    assert gain("hf") >= LEARN_MIN_GAIN, seeds
    assert gain("vllm") >= 0.5 * gain("hf"), seeds
