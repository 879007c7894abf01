"""The TRL-suite harness (`bench/trl_suite.py`) without a TRL checkout: its table on hand-made results, the offline
tokenizers it builds, and its pytest plugin on a stand-in test file (the real run needs TRL's repository: see the
README's drop-in section)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import trl_suite  # noqa: E402
import trl_suite_assets  # noqa: E402


def test_table_counts_and_lists_only_what_the_baseline_passes():
    results = {
        "grpo": {"tests": {"t::a": {"outcome": "passed"}, "t::b": {"outcome": "failed", "cause": "E: old test"},
                           "t::c": {"outcome": "skipped", "cause": "test requires vllm"},
                           "t::d": {"outcome": "passed"}}},
        "rloo": {"tests": {"t::a": {"outcome": "failed", "cause": "ValueError: num_generations_eval"},
                           "t::b": {"outcome": "failed", "cause": "E: old test"},
                           "t::c": {"outcome": "skipped", "cause": "test requires vllm"},
                           "t::d": {"outcome": "error (setup)", "cause": "OSError: x"}}},
    }
    text, regressions = trl_suite.summarize(results)
    assert "| trl.GRPOTrainer | 2 | 1 | 1 | (baseline) |" in text
    assert "| rloo | 0 | 3 | 1 | 2 |" in text
    assert regressions["rloo"] == {"t::a": "ValueError: num_generations_eval", "t::d": "OSError: x"}
    assert "- `a`: ValueError: num_generations_eval" in text
    assert "1 x test requires vllm" in text


def test_offline_tokenizer_carries_the_familys_template_and_tokens():
    tok = trl_suite_assets.build_tokenizer("qwen3")
    assert tok.eos_token == "<|im_end|>" and len(tok.encode("<|im_end|>", add_special_tokens=False)) == 1
    assert len(tok.encode("<tool_call>", add_special_tokens=False)) == 1
    assert "<tool_call>" not in tok.all_special_tokens  # an ordinary added token, as in Qwen's tokenizer
    text = "Beautiful is better than ugly. ü ∑ 😀"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\nhi<|im_end|>") and rendered.rstrip().endswith("assistant")


STAND_IN = '''
import pytest
from trl import GRPOConfig, GRPOTrainer


def test_rebound():
    assert GRPOTrainer.__name__ == "RLOOTrainer" and GRPOConfig.__name__ == "RLOOConfig"


def test_run_length_is_capped(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).max_steps == 6
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2).max_steps == 2


def test_cause_is_one_line():
    raise ValueError("first line\\nsecond line")


@pytest.mark.skip(reason="test requires vllm")
def test_skipped():
    pass
'''


@pytest.mark.slow  # a pytest subprocess that imports TRL (about 20 s)
def test_plugin_rebinds_the_trainer_and_reports_each_test(tmp_path):
    work = tmp_path / "trl"
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "__init__.py").write_text("")
    (work / "tests" / "test_grpo_trainer.py").write_text(STAND_IN)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "assets" / "hub").mkdir(parents=True)
    report = trl_suite.run_trainer("rloo", work, tmp_path / "assets", out, 6, [], 120)
    tests = {k.split("::")[-1]: v for k, v in report["tests"].items()}
    assert tests["test_rebound"]["outcome"] == "passed"
    assert tests["test_run_length_is_capped"]["outcome"] == "passed"
    assert tests["test_cause_is_one_line"] == {"outcome": "failed", "cause": "ValueError: first line"}
    assert tests["test_skipped"] == {"outcome": "skipped", "cause": "test requires vllm"}
    assert json.loads((out / "runs" / "rloo.json").read_text())["trainer"] == "rloo"


def _trl_repo(root):
    """A stand-in TRL repository: the test file, `scripts/` and `pyproject.toml`, one commit; returns that commit."""
    import subprocess

    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_grpo_trainer.py").write_text("def test_x():\n    pass\n")
    (root / "scripts").mkdir()
    (root / "scripts" / "generate_zen_dataset.py").write_text("")
    (root / "pyproject.toml").write_text("[project]\nname = 'trl'\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("layout", ["work tree", "git directory"])
def test_results_name_trls_commit_not_a_folder_of_the_machine(tmp_path, layout):
    commit = _trl_repo(tmp_path / "trl-checkout")
    trl = tmp_path / "trl-checkout" if layout == "work tree" else tmp_path / "trl-checkout" / ".git"
    dest = tmp_path / "scratch"
    source = trl_suite.export_trl(trl, "HEAD", dest)
    assert (dest / "tests" / "test_grpo_trainer.py").is_file() and (dest / "pyproject.toml").is_file()
    assert source == f"TRL's repository at {commit[:12]}"
    assert str(tmp_path) not in source and "trl-checkout" not in source


@pytest.mark.slow  # builds two models and loads them in a fresh process (about 20 s)
def test_vlm_stand_ins_load_from_the_hub_cache_offline(tmp_path):
    """TRL's VLM tests load `trl-internal-testing/tiny-*ForConditionalGeneration` by name: the stand-ins resolve
    through `HF_HUB_CACHE` with the Auto classes TRL uses, processor included (no video processor, no torchvision)."""
    import subprocess

    names = ["tiny-Gemma3ForConditionalGeneration", "tiny-Qwen2VLForConditionalGeneration"]
    trl_suite_assets.build_assets(tmp_path, tmp_path, only=names, log=lambda *_: None)
    assert set(names) <= set(trl_suite_assets.VLM_MODELS) and not set(trl_suite_assets.VLM_MODELS) & set(
        trl_suite_assets.VLM_NOT_BUILT)
    # a fresh process, as the suite's pytest run: the plugin's import of toy_vlm registers the Qwen processors
    code = ("import trl_ppo_variants.toy_vlm, torch\n"
            "from transformers import AutoModelForImageTextToText, AutoProcessor\n"
            f"for name in {names!r}:\n"
            "    repo = 'trl-internal-testing/' + name\n"
            "    model, processor = AutoModelForImageTextToText.from_pretrained(repo), AutoProcessor.from_pretrained(repo)\n"
            "    assert model.dtype == torch.bfloat16 and processor.image_processor is not None\n"
            "    print(type(model).__name__, type(processor).__name__)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Gemma3ForConditionalGeneration", "Gemma3Processor",
                                  "Qwen2VLForConditionalGeneration", "ToyQwen2VLProcessor"]
