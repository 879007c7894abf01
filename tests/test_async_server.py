"""`max_staleness=1` against a real vLLM server process on CPU (`trl_ppo_variants/async_rollout.py`), in vLLM's CPU
build (`make test-vllm` runs it in `.venv-vllm`).

One server for the module (`test_vllm_server.Server`: `trl-ppo-variants vllm-serve` of the tied-head toy model on a
free loopback port). Against it: every trainer's case trains 2 steps with `max_staleness=1` in one subprocess
(`tests/scripts/async_server.py`); the off-policy correction's weights against the sampling policy's log-probs, with
and without TRL's correction; a run stopped at its checkpoint and resumed; two training processes (DDP) sharing the
server. The server is killed with its whole process group at the end.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import accelerate_launch
from test_vllm_server import SERVER_BOUND, Server, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
#: the trainers of `vllm_colocate.CASES`, 2 steps each with max_staleness=1
CASES = ["grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo", "dapo_spread", "grpo_speed",
         "grpo_greso", "ttrl", "ppo", "vapo", "process_grpo"]
#: the cases whose first request of a step is never the dataloader's batch: each request is made when it comes
NOT_PREFETCHED = {"dapo", "grpo_speed", "grpo_greso"}
RATIO_CASES = ["ratio_on", "ratio_off"]
LAUNCH_CASES = ["grpo", "remax"]
#: a policy version behind: the sampling log-probs differ from the policy's by more than this where a step trained
STALE_GAP = 1e-2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM's CPU build is not installed here (`make test-vllm` runs these tests)"),
]


@pytest.fixture(scope="module")
def toy_model():
    from vllm_colocate import build_model

    return build_model("tied")


@pytest.fixture(scope="module")
def server(toy_model, tmp_path_factory):
    server = Server(toy_model, str(tmp_path_factory.mktemp("server") / "server.log"))
    server.start_seconds = server.wait()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cases_run(server, toy_model, tmp_path_factory):
    """{case: result} of every case against the server, in one subprocess."""
    out = tmp_path_factory.mktemp("cases") / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "async_server.py"), str(out), server.url, toy_model,
                           *CASES, *RATIO_CASES], env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and out.exists(), (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads(out.read_text())


def _case(run, name):
    result = run[name]
    assert "error" not in result, result.get("traceback", result.get("error"))
    return result


def _logged(result, key):
    return [h.get(key) for h in result["logs"]]


@pytest.mark.parametrize("case", CASES)
def test_every_trainer_trains_one_step_off_policy(case, cases_run):
    """Each trainer trains 2 steps with `max_staleness=1`. Step 0's requests are made when they come (version 0); a
    trainer whose first request is the dataloader's batch gets step 1's batch queued ahead during step 0, generated
    with version 0 (staleness 1, logged), the others make each request with the current policy (staleness 0). No
    request older than the bound is trained on; the correction's numbers are logged every step, and a stale batch
    after a step that trained differs from the policy by more than the server's own mismatch."""
    result = _case(cases_run, case)
    assert result["steps"] == 2 and result["policy_moved"] > 1e-3 and result["pending_after"] == 0, result
    history = result["history"]
    assert all(0 <= step - version <= 1 for step, _, version, _ in history), history
    assert all(not prefetched and version == 0 for step, _, version, prefetched in history if step == 0), history
    staleness = _logged(result, "async/staleness")
    step1 = [h for h in history if h[0] == 1]
    if case in NOT_PREFETCHED:
        assert staleness == [0.0, 0.0] and all(not h[3] and h[2] == 1 for h in step1), (staleness, history)
    else:
        # the step's first request was queued at step 0 (DAPO's refill rounds, made when they come, are fresh: the
        # logged staleness is the mean over the step's requests)
        assert staleness[0] == 0.0 and staleness[1] > 0.0, (staleness, history)
        assert step1[0][3] and step1[0][2] == 0, history
    for key in ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/corrected_share"):
        assert all(v is not None for v in _logged(result, key)), (key, result["logs"])
    differences = _logged(result, "sampling/sampling_logp_difference/max")
    assert differences[0] <= SERVER_BOUND, differences  # generated by the policy that scores it
    if staleness[1] == 1.0 and result["logs"][0]["grad_norm"] > 0:
        assert differences[1] > 10 * SERVER_BOUND, differences


def test_remax_greedy_rows_come_from_the_sampled_rows_policy_version(cases_run):
    """ReMax's greedy request is queued with its sampled rows: at every step both were generated by one version."""
    history = _case(cases_run, "remax")["history"]
    for step in (0, 1):
        rows = {n: (version, prefetched) for s, n, version, prefetched in history if s == step}
        assert set(rows) == {4, 1} and rows[4] == rows[1], history


@pytest.mark.parametrize("case", ["ppo", "vapo"])
def test_the_critic_trains_on_stale_batches(case, cases_run):
    assert _case(cases_run, case)["critic_moved"] > 1e-3


def test_the_clipped_objective_takes_the_sampling_policys_log_probs(cases_run):
    """A batch one version old. Without TRL's correction the clipped ratio is the current policy's against itself (no
    old log-probs are kept: r = 1), which differs from the ratio to the sampling policy by as much as the policy
    moved. With it (untruncated), the objective's weight w r = (pi_old / pi_sampling)(pi / pi_old) is the ratio to the
    sampling policy, pi / pi_sampling, the server's log-probs, on every loss token."""
    off, on = _case(cases_run, "ratio_off"), _case(cases_run, "ratio_on")
    for result in (off, on):
        assert _logged(result, "async/staleness")[1:] == [1.0, 1.0], result["logs"]
    stale = [r for r in off["ratios"] if r["sampling_gap"] > STALE_GAP]
    assert stale and all(not r["has_old"] and not r["has_weight"] for r in off["ratios"]), off["ratios"]
    assert all(r["objective_vs_sampling"] > STALE_GAP for r in stale), off["ratios"]
    assert any(r["sampling_gap"] > STALE_GAP for r in on["ratios"]), on["ratios"]
    for record in on["ratios"]:
        assert record["has_old"] and record["has_weight"], record
        assert record["objective_vs_sampling"] <= 1e-4, record


# ------------------------------------------------------------------------------------------------- resume
def resumable_trainer(model_dir: str, url: str, output_dir: str):
    """A GRPO trainer of 4 steps with max_staleness=1, checkpointing every 2 steps, its sampling seeded on the
    server (the same completions from the same weights and prompts)."""
    from vllm_colocate import varied_reward

    from trl_ppo_variants.toy import addition_dataset
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=output_dir, max_completion_length=6, max_steps=4, per_device_train_batch_size=4,
                      num_generations=2, learning_rate=3e-2, report_to=[], use_cpu=True, bf16=False, seed=0,
                      disable_tqdm=True, generation_kwargs={"seed": 7}, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=url, vllm_server_timeout=30, save_strategy="steps", save_steps=2,
                      max_staleness=1, logging_steps=1)
    return GRPOTrainer(model_dir, reward_funcs=varied_reward, args=args, train_dataset=addition_dataset(32))


def test_a_resumed_run_reproduces_the_uninterrupted_run(server, toy_model, tmp_path):
    """max_staleness=1, 4 steps, a checkpoint at step 2: the batches of steps 1 and 3 were queued a step ahead,
    step 2's was generated after the checkpoint with the checkpoint's weights; a run resumed from that checkpoint
    makes the same requests and ends on the same weights."""
    from test_vllm_server import _weights, torch_load_initial

    uninterrupted = resumable_trainer(toy_model, server.url, str(tmp_path / "run"))
    uninterrupted.train()
    expected = _weights(uninterrupted)
    history = [(s, v, p) for s, n, v, p in uninterrupted._async.history]
    assert history == [(0, 0, False), (1, 0, True), (2, 2, False), (3, 2, True)], history
    del uninterrupted
    resumed = resumable_trainer(toy_model, server.url, str(tmp_path / "run"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert [(s, v, p) for s, n, v, p in resumed._async.history] == history[2:]
    got = _weights(resumed)
    initial = torch_load_initial(toy_model)
    difference = max((got[k] - expected[k]).abs().max().item() for k in expected)
    moved = max((got[k] - initial[k]).abs().max().item() for k in expected)
    assert difference <= 1e-6 and moved > 1e-3, (difference, moved)


# ------------------------------------------------------------------------------------------------- two processes
@pytest.fixture(scope="module")
def launch(server, toy_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    accelerate_launch("async_server.py", f"{out}/", server.url, toy_model, *LAUNCH_CASES, timeout=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_two_training_processes_train_the_same_stale_batches(case, launch):
    """`accelerate launch --num_processes 2`: only the main process queues requests; both ranks log the same
    staleness (the main process's, broadcast), trained the same steps and moved their policies alike."""
    main, other = (rank[case] for rank in launch)
    for result in (main, other):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["world"] == 2 and result["steps"] == 2, result
    assert _logged(main, "async/staleness") == _logged(other, "async/staleness") == [0.0, 1.0]
    assert other["history"] == [] and [h[2] for h in main["history"] if h[0] == 1] == [0] * len(
        [h for h in main["history"] if h[0] == 1]), main["history"]
    assert main["policy_moved"] == other["policy_moved"] > 1e-3
