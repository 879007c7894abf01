"""`python -m trl_ppo_variants.demo` (`make demo`), the real-model demo: its command line, its settings table, the
whole path (table, time left, results, plot) on the tiny offline model, and one step on the real model (slow)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo_variants import demo
from trl_ppo_variants.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]


def test_demo_module_help_runs_offline():
    proc = subprocess.run([sys.executable, "-m", "trl_ppo_variants.demo", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in ("--algo", "--steps", "--output_dir", "--save_models", "--eval_prompts"):
        assert option in proc.stdout


@pytest.mark.parametrize("spec,message", [("grpoo", "unknown algorithm 'grpoo'"),
                                          ("rloo,nope", "unknown algorithm 'nope'")])
def test_demo_unknown_algorithm_is_one_line(capsys, spec, message):
    assert demo.main(["--algo", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "all" in err[0]


def test_demo_settings_table(tmp_path):
    """One row per algorithm (the reference too), each a valid config of its algorithm on top of COMMON; the default
    set is TRL's GRPO and at least two of ours."""
    assert set(demo.ALGO_SETTINGS) <= {demo.REFERENCE, *ALGORITHMS}
    assert demo.DEFAULT_ALGOS[0] == demo.REFERENCE and len(demo.DEFAULT_ALGOS) >= 3
    assert set(demo.DEFAULT_ALGOS) <= set(demo.ALGO_SETTINGS)
    for algo in demo.ALGO_SETTINGS:
        if algo != demo.REFERENCE and algo not in demo.algorithm_names():
            continue
        args = demo.training_args(algo, steps=3, seed=0, output_dir=str(tmp_path))
        # critic-only steps (VAPO's value pre-training) come on top: every algorithm gets 3 policy updates
        assert (args.max_steps, args.temperature, args.learning_rate) == (3 + demo.critic_only_steps(algo), 0.7,
                                                                          3e-5), algo
        for key, value in demo.ALGO_SETTINGS[algo].items():
            assert getattr(args, key) == value, (algo, key)
    # an override of the critic-only steps still leaves 3 policy updates (bench/critic_learning.py's variants)
    longer = demo.training_args("vapo", steps=3, seed=0, output_dir=str(tmp_path), value_pretrain_steps=12)
    assert (longer.value_pretrain_steps, longer.max_steps) == (12, 15)
    assert demo._select("all") == demo.algorithm_names() and demo._select(None) == list(demo.DEFAULT_ALGOS)
    assert demo._select("dapo,grpo") == ["dapo", "grpo"]


def _table_rows(out):
    return re.findall(r"^(\S+)(?: \(trl\.GRPOTrainer\))?\s+([\d.]+) -> ([\d.]+)\s+([+-][\d.]+)\s+(\d+(?: \+ \d+ "
                      r"critic-only)?)\s+([\d.]+)$", out, flags=re.M)


@pytest.mark.timeout(300)
def test_demo_whole_path_on_the_tiny_model(tmp_path, capsys, toy_model_dir):
    """The demo's path end to end on the tiny offline model (the real one is `--model`-free): two algorithms, one step
    each; the table, the progress bar with the time left, results.json and the plot."""
    out = tmp_path / "demo"
    code = demo.main(["--algo", "grpo,rloo", "--steps", "1", "--model", toy_model_dir, "--eval_prompts", "4",
                      "--eval_samples", "2", "--output_dir", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    rows = _table_rows(captured.out)
    assert [r[0] for r in rows] == ["grpo", "rloo"], captured.out
    assert [r[4] for r in rows] == ["1", "1"]
    assert "grpo (trl.GRPOTrainer)" in captured.out
    before = {r[1] for r in rows}
    assert len(before) == 1  # one measure of the same base model for every algorithm
    assert "2/2 steps" in captured.err and "left" in captured.err
    results = json.loads((out / "results.json").read_text())
    assert [r["algorithm"] for r in results["rows"]] == ["grpo", "rloo"]
    assert all(len(r["curve"]) == 1 and r["sec_per_step"] > 0 for r in results["rows"])
    assert f"{results['before']:.3f}" == before.pop()
    assert (out / "reward_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "rloo" / "model.safetensors").exists()  # models are saved only with --save_models
    assert "demo: generation engine: transformers generate" in captured.out  # says which engine it used
    assert results["generation_engine"] == "transformers generate"


@pytest.mark.parametrize("installed", [False, True])
def test_demo_generates_with_transformers_on_cpu_whether_vllm_is_installed_or_not(monkeypatch, installed):
    """vLLM colocate is slower than `generate` on CPU (bench/vllm_speed.py), and the demo trains on the CPU."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "vllm" else real(name, *a))
    engine, why = demo.generation_engine()
    assert engine == "transformers generate"
    assert ("installed, but" in why) == installed and "vLLM" in why


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_one_step_on_the_real_model(tmp_path, capsys, smollm2_dir):
    import torch
    from conftest import worker_cores

    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    torch.set_num_threads(worker_cores())  # one process on a 135M model: every core it has (the suite's default is 1)
    try:
        code = demo.main(["--algo", "rloo", "--steps", "1", "--eval_prompts", "4", "--eval_samples", "1",
                          "--output_dir", str(out), "--save_models"])
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert [r[0] for r in _table_rows(captured.out)] == ["rloo"]
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == smollm2_dir
    assert "trained with **RLOO**" in (out / "rloo" / "README.md").read_text()
    assert (out / "rloo" / "model.safetensors").exists()
