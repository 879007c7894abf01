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
    from trl_ppo_variants.cli import ALGORITHMS

    assert set(mc.PAPERS) == set(ALGORITHMS)
    for algo, paper in mc.PAPERS.items():
        assert re.fullmatch(r"\d{4}\.\d{4,5}", paper.arxiv_id), algo
        assert paper.bibtex.startswith("@") and paper.bibtex.rstrip().endswith("}"), algo
        assert paper.bibtex.count("{") == paper.bibtex.count("}"), algo  # balanced: parses as BibTeX
        assert paper.title.split(":")[0].lower().replace("-", "") in paper.bibtex.lower().replace("-", ""), algo
    assert mc.PAPERS["reinforce_pp_baseline"].name == "REINFORCE++-baseline"
    assert mc.PAPERS["reinforce_pp_baseline"].arxiv_id == mc.PAPERS["reinforce_pp"].arxiv_id


def test_algorithm_of_maps_trainer_classes_and_the_baseline_variant():
    class Args:
        baseline = True

    for cls_name, algo in [("ReMaxTrainer", "remax"), ("RLOOTrainer", "rloo"), ("DAPOTrainer", "dapo"),
                           ("PPOTrainer", "ppo"), ("VAPOTrainer", "vapo"), ("TTRLTrainer", "ttrl"),
                           ("ReinforcePPTrainer", "reinforce_pp")]:
        assert mc.algorithm_of(type(cls_name, (), {})) == algo
    reinforce = type("ReinforcePPTrainer", (), {})
    assert mc.algorithm_of(reinforce, Args()) == "reinforce_pp_baseline"
    # a user's subclass is still its algorithm; VAPO (a PPOTrainer subclass) is VAPO, not PPO
    ppo = type("PPOTrainer", (), {})
    vapo = type("VAPOTrainer", (ppo,), {})
    assert mc.algorithm_of(type("MyVAPO", (vapo,), {})) == "vapo"
    assert mc.algorithm_of(type("GRPOTrainer", (), {})) is None


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
    """transformers' `push_to_hub` saves with `_internal_call=True` (the checkpoint path, which keeps `critic.*` in
    the weights for resume); what reaches the Hub must be the export: policy weights without `critic.*`, the critic in
    `value_model/` (intercepted upload: no network)."""
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
