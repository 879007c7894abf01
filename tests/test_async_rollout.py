"""`max_staleness` (`trl_ppo_variants/async_rollout.py`) without a server: the config's checks, the refusals, the
share of corrected importance weights, and `max_staleness=0` leaving the synchronous path exactly as it was. The
overlapped generation itself runs against a real vLLM server in `tests/test_async_server.py` (vLLM env)."""

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants import async_rollout
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.base import VariantConfig

SERVER = {"use_vllm": True, "vllm_mode": "server"}


def _config_classes():
    import trl_ppo_variants

    return [getattr(trl_ppo_variants, n) for n in trl_ppo_variants.__all__
            if n.endswith("Config") and isinstance(getattr(trl_ppo_variants, n), type)
            and issubclass(getattr(trl_ppo_variants, n), VariantConfig)]


@pytest.mark.parametrize("config_cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_config_has_max_staleness_and_needs_the_server_for_it(config_cls, tmp_path):
    extra = {"max_steps": 100} if config_cls.__name__ == "VAPOConfig" else {}  # its value pre-training needs steps
    assert toy_args(config_cls, tmp_path, **extra).max_staleness == 0
    for engine in ({}, {"use_vllm": True, "vllm_mode": "colocate"}):
        with pytest.raises(ValueError) as err:
            toy_args(config_cls, tmp_path, max_staleness=1, **engine, **extra)
        message = str(err.value)
        assert message.startswith("max_staleness: expected 0 unless use_vllm=True and vllm_mode='server'"), message
        assert "\n" not in message
    assert toy_args(config_cls, tmp_path, max_staleness=2, **SERVER, **extra).max_staleness == 2


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_max_staleness_must_be_a_count(value, tmp_path):
    with pytest.raises(ValueError, match=r"^max_staleness: expected an integer( >= 0)?, got "):
        toy_args(VariantConfig, tmp_path, max_staleness=value, **SERVER)


def test_multi_turn_generation_is_refused_before_any_server_is_reached(toy_model_dir, toy_dataset, tmp_path):
    """Tools make requests that cannot be known ahead: one line at construction (no server at the URL is needed to
    say so)."""
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    args = toy_args(GRPOConfig, tmp_path, max_staleness=1, vllm_server_base_url="http://127.0.0.1:9", **SERVER)
    with pytest.raises(ValueError) as err:
        GRPOTrainer(toy_model_dir, reward_funcs=addition_reward, args=args, train_dataset=toy_dataset, tools=[add])
    assert str(err.value).startswith("max_staleness: expected 0 for GRPOTrainer (tools, environments and "), err.value


def test_corrected_share_counts_truncated_and_masked_weights():
    """Token mode: the weights TRL's truncation changed, among the loss tokens; sequence mode: the sequences."""
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
    sampling = torch.tensor([[0.0, -3.0, -2.0], [-0.5, 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    raw = torch.exp((old - sampling) * mask)
    truncated = raw.clamp(max=3.0)  # one loss token above 3: exp(2); the masked-out one does not count
    count, total = async_rollout.corrected_share(old, sampling, truncated, mask)
    assert (count.item(), total.item()) == (1.0, 5.0)
    count, _ = async_rollout.corrected_share(old, sampling, raw, mask)
    assert count.item() == 0.0
    per_sequence = torch.exp(((old - sampling) * mask).sum(-1, keepdim=True))  # (2, 1): exp(2), exp(0.5)
    for cap, expected in ((3.0, 1.0), (1.5, 2.0), (9.0, 0.0)):
        masked = torch.where(per_sequence > cap, torch.zeros_like(per_sequence), per_sequence)
        count, total = async_rollout.corrected_share(old, sampling, masked, mask)
        assert (count.item(), total.item()) == (expected, 2.0), cap


def _trained_weights(toy_model_dir, toy_dataset, tmp_path, **overrides):
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    args = toy_args(GRPOConfig, tmp_path, learning_rate=3e-2, **overrides)
    trainer = GRPOTrainer(toy_model_dir, reward_funcs=addition_reward, args=args, train_dataset=toy_dataset)
    trainer.train()
    return trainer, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_max_staleness_0_is_the_synchronous_path_bit_for_bit(toy_model_dir, toy_dataset, tmp_path, monkeypatch):
    """A run with `max_staleness=0` never builds the overlapped generation and ends on exactly the weights of a run
    whose trainer has the hooks taken out (the Trainer's own `get_batch_samples`, the generation without its
    wrapper): the code path before `max_staleness` existed."""
    from transformers import Trainer

    from trl_ppo_variants.trainers.base import VariantTrainer

    def refuse(*args, **kwargs):
        raise AssertionError("max_staleness=0 built the overlapped generation")

    monkeypatch.setattr(async_rollout, "AsyncRollout", refuse)
    trainer, ours = _trained_weights(toy_model_dir, toy_dataset, tmp_path / "a", max_staleness=0)
    assert trainer._async is None and trainer.state.global_step == 2
    monkeypatch.setattr(VariantTrainer, "get_batch_samples", Trainer.get_batch_samples)
    monkeypatch.setattr(VariantTrainer, "_generate_single_turn", VariantTrainer._generate_turn)
    _, before = _trained_weights(toy_model_dir, toy_dataset, tmp_path / "b")
    assert all(torch.equal(ours[k], before[k]) for k in ours)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(toy_model_dir).state_dict()
    assert max((ours[k] - start[k]).abs().max().item() for k in start if k in ours) > 1e-4  # it trained
