"""The model card: names the algorithm, links and cites its paper, lists hyperparameters and final metrics, says the
package trained it; written by every trainer (not TRL's GRPO card) and uploaded by `push_to_hub`. Offline."""

import math
import re

import pytest
from conftest import toy_args

from trl_ppo_variants import model_card as mc
from trl_ppo_variants.toy import addition_reward


def _table(text: str, heading: str) -> dict:
    """The `| `key` | value |` rows under a `### heading`."""
    section = text.split(f"### {heading}", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", section, flags=re.M))


def test_every_algorithm_has_a_paper_with_bibtex():
    from trl_ppo_variants.algorithms import ALGORITHMS

    assert set(mc.PAPERS) == set(ALGORITHMS)
    for algo, paper in mc.PAPERS.items():
        assert re.fullmatch(r"\d{4}\.\d{4,5}", paper.arxiv_id), algo
        assert paper.bibtex.startswith("@") and paper.bibtex.rstrip().endswith("}"), algo
        assert paper.bibtex.count("{") == paper.bibtex.count("}"), algo  # balanced: parses as BibTeX
        assert paper.title.split(":")[0].lower().replace("-", "") in paper.bibtex.lower().replace("-", ""), algo
    assert mc.PAPERS["reinforce_pp_baseline"].name == "REINFORCE++-baseline"
    assert mc.PAPERS["reinforce_pp_baseline"].arxiv_id == mc.PAPERS["reinforce_pp"].arxiv_id


def test_algorithm_of_maps_trainer_classes_and_the_baseline_variant():
    import trl

    from trl_ppo_variants.algorithms import ALGORITHMS, BASELINE

    for name, algorithm in ALGORITHMS.items():
        args = type("Args", (), dict(algorithm.preset))()
        assert mc.algorithm_of(algorithm.classes()[1], args) == name
    reinforce = ALGORITHMS["reinforce_pp"].classes()[1]
    assert mc.algorithm_of(reinforce) == "reinforce_pp"  # no args: the plain variant
    # a user's subclass is still its algorithm; VAPO (a PPOTrainer subclass) is VAPO, not PPO
    vapo = ALGORITHMS["vapo"].classes()[1]
    assert mc.algorithm_of(type("MyVAPO", (vapo,), {})) == "vapo"
    # the baseline cites TRL's GRPO paper itself; another package's trainer of the same name is not ours
    assert mc.algorithm_of(BASELINE.classes()[1]) is None and mc.algorithm_of(trl.GRPOTrainer) is None
    assert mc.algorithm_of(type("PPOTrainer", (), {})) is None


def test_final_metrics_are_the_last_finite_values():
    history = [
        {"reward": 0.25, "kl": 0.1, "rewards/acc/mean": 0.2, "step": 1, "learning_rate": 1e-6},
        {"reward": 0.75, "kl": float("nan"), "rewards/acc/mean": 0.7, "step": 2, "note": "text", "flag": True},
        {"train_loss": 0.5, "train_runtime": 3.0, "step": 2},
    ]
    m = mc.final_metrics(history)
    assert m["reward"] == 0.75
    assert m["kl"] == 0.1  # the NaN of step 2 is not a measurement
    assert m["rewards/acc/mean"] == 0.7
    assert m["train_loss"] == 0.5 and m["global_step"] == 2
    assert "learning_rate" not in m and "note" not in m and "flag" not in m


def test_rendered_card_content(tmp_path):
    from trl_ppo_variants.trainers.rloo import RLOOConfig

    args = toy_args(RLOOConfig, tmp_path, beta=0.05, learning_rate=3e-6, num_generations=4,
                    max_completion_length=7, normalize_advantages=True)
    hp = mc.run_hyperparameters(args, num_processes=2)
    assert hp["beta"] == 0.05 and hp["normalize_advantages"] is True and hp["kl_in_reward_coef"] == 0.05
    assert hp["completions_per_optimizer_step"] == 8 * 1 * 2
    text = mc.render_model_card("rloo", hp, {"reward": 0.5, "global_step": 2}, model_name="my-rloo",
                                base_model="Qwen/Qwen3-0.6B", dataset_name="openai/gsm8k", tags=["custom"])
    front = text.split("---")[1]
    assert "base_model: Qwen/Qwen3-0.6B" in front and "openai/gsm8k" in front
    for tag in ("trl-ppo-variants", "rloo", "custom"):
        assert f"- {tag}" in front
    assert "trained with **RLOO**" in text
    assert "https://arxiv.org/abs/2402.14740" in text
    assert "@inproceedings{ahmadian2024back" in text and "```bibtex" in text
    assert "trained with `trl-ppo-variants`" in text
    table = _table(text, "Training hyperparameters")
    assert table["learning_rate"] == "3e-06" and table["beta"] == "0.05"
    assert table["max_completion_length"] == "7" and table["normalize_advantages"] == "True"
    assert table["lr_scheduler_type"] == "linear"  # the enum's value, not `SchedulerType.LINEAR`
    assert _table(text, "Final metrics") == {"reward": "0.5", "global_step": "2"}
    assert "DeepSeekMath" not in text and "GRPO" not in text


def test_trainer_writes_its_algorithm_card_and_push_uploads_it(tmp_path, toy_model_dir, toy_dataset, monkeypatch):
    """A real (2-step) RLOO run: `create_model_card` (TRL's hook, called at checkpoints and by `push_to_hub`) writes
    our card; `push_to_hub` uploads the output folder holding it (the Hub call is intercepted: no network)."""
    import transformers.trainer as hf_trainer

    from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer

    args = toy_args(RLOOConfig, tmp_path, beta=0.0, max_steps=2)
    trainer = RLOOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    trainer.train()

    uploads = []

    class FakeApi:
        def upload_folder(self, **kwargs):
            with open(f"{kwargs['folder_path']}/README.md") as f:
                uploads.append((kwargs, f.read()))
            return "https://huggingface.co/user/toy-rloo"

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer.hub_model_id = "user/toy-rloo"  # skips `init_hf_repo`, which would create the repo online
    trainer.push_to_hub()
    assert len(uploads) == 1
    kwargs, text = uploads[0]
    assert kwargs["repo_id"] == "user/toy-rloo" and kwargs["folder_path"] == args.output_dir
    assert "trained with **RLOO**" in text and "2402.14740" in text and "GRPO" not in text
    assert 'model="user/toy-rloo"' in text
    metrics = _table(text, "Final metrics")
    assert metrics["global_step"] == "2"
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert math.isclose(float(metrics["reward"]), logged[-1], rel_tol=1e-5)
    assert "rewards/addition_reward/mean" in metrics
    hp = _table(text, "Training hyperparameters")
    assert hp["max_steps"] == "2" and hp["num_generations"] == "4"


@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_card_names_the_variant(tmp_path, toy_model_dir, toy_dataset, algo):
    pytest.importorskip("trl_ppo_variants.trainers.reinforce_pp", reason="REINFORCE++ trainer not installed")
    from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer

    args = toy_args(ReinforcePPConfig, tmp_path, baseline=algo.endswith("baseline"), max_steps=1, beta=None,
                    kl_in_reward_coef=0.0)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    trainer.create_model_card(model_name="x")  # before training: no metrics yet, still a valid card
    text = (tmp_path / "out" / "README.md").read_text()
    name = mc.PAPERS[algo].name
    assert f"trained with **{name}**" in text and "2501.03262" in text
    assert "No metrics were logged." in text


def test_ppo_push_uploads_the_policy_without_critic_keys_and_the_critic_beside_it(
    tmp_path, toy_model_dir, toy_dataset, monkeypatch
):
    """transformers' `push_to_hub` saves with `_internal_call=True` (the checkpoint path); what reaches the Hub must be
    the export: policy weights without `critic.*`, the critic in `value_model/` (intercepted upload: no network). The
    pushes made from checkpoints during training: `test_ppo.py`."""
    import os

    import transformers.trainer as hf_trainer
    from safetensors import safe_open

    from trl_ppo_variants.trainers.ppo import PPOConfig, PPOTrainer

    args = toy_args(PPOConfig, tmp_path, max_steps=1, kl_in_reward_coef=0.0)
    trainer = PPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    trainer.train()
    uploads = []

    class FakeApi:
        def upload_folder(self, **kwargs):
            folder = kwargs["folder_path"]
            with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
                keys = list(f.keys())
            uploads.append((keys, os.listdir(os.path.join(folder, "value_model"))))
            return "https://huggingface.co/user/toy-ppo"

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer.hub_model_id = "user/toy-ppo"
    trainer.push_to_hub()
    assert len(uploads) == 1
    keys, value_files = uploads[0]
    assert keys and not any(k.startswith("critic.") for k in keys)
    assert any(name.endswith(".safetensors") for name in value_files)


# ------------------------------------------------------------------------------------------------ what TRL's cards carry
def test_base_model_of_local_folders(tmp_path):
    from trl_ppo_variants import smollm2

    assert mc.base_model_of("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    plain = tmp_path / "my_model"
    plain.mkdir()
    assert mc.base_model_of(str(plain)) == (None, None)
    built = tmp_path / "smollm2-135m-instruct-0123abcd"  # the built-in model's cache folder, with its marker
    built.mkdir()
    (built / smollm2.MARKER).write_text("{}")
    base, note = mc.base_model_of(str(built))
    assert base == "HuggingFaceTB/SmolLM2-135M-Instruct" and "dequantised" in note and "Q4_1" in note
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert mc.base_model_of(str(snapshot)) == ("Qwen/Qwen3-0.6B", None)


def test_hyperparameters_list_what_ends_the_run(tmp_path):
    """`num_train_epochs 3` next to `max_steps 2` said the run had 3 epochs: only the one that ends the run shows."""
    from trl_ppo_variants.trainers.rloo import RLOOConfig

    by_steps = mc.run_hyperparameters(toy_args(RLOOConfig, tmp_path, max_steps=2))
    assert by_steps["max_steps"] == 2 and "num_train_epochs" not in by_steps
    by_epochs = mc.run_hyperparameters(toy_args(RLOOConfig, tmp_path, max_steps=-1, num_train_epochs=2))
    assert by_epochs["num_train_epochs"] == 2 and "max_steps" not in by_epochs


def test_card_has_base_model_tracker_links_and_trl_tags(tmp_path, toy_model_dir, toy_dataset, monkeypatch):
    """The built-in model's card names HuggingFaceTB/SmolLM2-135M-Instruct; the tracker runs are linked and tagged as
    in TRL's cards (`trackio:<url>`, `hf_jobs` in a Hugging Face Job); an explicit base model wins."""
    import shutil

    from trl_ppo_variants import smollm2
    from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer

    model_dir = tmp_path / "smollm2-135m-instruct-0123abcd"  # the toy model standing in for the built-in one
    shutil.copytree(toy_model_dir, model_dir)
    (model_dir / smollm2.MARKER).write_text("{}")
    urls = {"wandb": "https://wandb.ai/me/proj/runs/abc", "trackio": "https://me-trackio.hf.space?project=p&runs=r"}
    monkeypatch.setattr(mc, "tracker_run_urls", lambda: dict(urls))
    monkeypatch.setenv("JOB_ID", "42")
    args = toy_args(RLOOConfig, tmp_path, max_steps=1)
    trainer = RLOOTrainer(str(model_dir), addition_reward, args=args, train_dataset=toy_dataset)
    trainer.train()
    trainer.create_model_card(tags=["trackio:https://old"])
    text = (tmp_path / "out" / "README.md").read_text()
    front = text.split("---")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in front
    assert f"- trackio:{urls['trackio']}" in front and "- hf_jobs" in front and "trackio:https://old" not in front
    assert f"[Weights & Biases run]({urls['wandb']})" in text and f"[Trackio run]({urls['trackio']})" in text
    assert "[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in text
    assert "num_train_epochs" not in _table(text, "Training hyperparameters")
    trainer.model_card_base_model = "me/my-sft"  # the command line's --base_model
    trainer.create_model_card()
    assert "base_model: me/my-sft" in (tmp_path / "out" / "README.md").read_text().split("---")[1]


def test_ppo_value_model_loads_on_its_own(tmp_path, toy_model_dir, toy_dataset):
    """`output_dir/value_model/` holds the critic and the tokenizer: it loads, tokenizes and scores by itself."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from trl_ppo_variants.trainers.ppo import PPOConfig, PPOTrainer

    # the full critic, saved in transformers' `...ForTokenClassification` layout (PPO's default LoRA critic loads with
    # `critic.load_value_model`: tests/test_ppo.py)
    args = toy_args(PPOConfig, tmp_path, max_steps=1, kl_in_reward_coef=0.0, critic_backbone="full")
    trainer = PPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    trainer.train()
    trainer.save_model(args.output_dir)
    folder = tmp_path / "out" / "value_model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    critic = AutoModelForTokenClassification.from_pretrained(folder)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(toy_model_dir).get_vocab()
    batch = tokenizer(["3+4=7"], return_tensors="pt")
    with torch.no_grad():
        values = critic(**batch).logits
    assert values.shape == (1, batch["input_ids"].shape[1], 1) and torch.isfinite(values).all()
