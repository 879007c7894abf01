"""Fails loudly when TRL moves under us: the private methods we override or call, the attributes we read, and the
minor series we test against. Each failure message says what changed and where we depend on it."""

import inspect
import re

import pytest
import trl
from conftest import toy_args
from packaging.version import Version
from trl import GRPOTrainer

from trl_ppo_variants.trainers.base import TRL_PRIVATE_API

TESTED_MINOR = (1, 16)


def test_trl_version_is_the_tested_minor_series():
    version = Version(trl.__version__)
    assert (version.major, version.minor) == TESTED_MINOR, (
        f"trl {trl.__version__} is installed but trl_ppo_variants is tested against trl "
        f"{TESTED_MINOR[0]}.{TESTED_MINOR[1]}.x only: it overrides private GRPOTrainer methods "
        f"({', '.join(sorted(TRL_PRIVATE_API))}). Re-run the test suite and re-check trainers/base.py before "
        "widening the pin in pyproject.toml."
    )


@pytest.mark.parametrize("name", sorted(TRL_PRIVATE_API))
def test_private_method_signature(name):
    expected = TRL_PRIVATE_API[name]
    method = getattr(GRPOTrainer, name, None)
    assert method is not None, f"trl.GRPOTrainer.{name} no longer exists (trl {trl.__version__}); trl_ppo_variants " \
        "overrides or calls it: see TRL_PRIVATE_API in trl_ppo_variants/trainers/base.py"
    params = list(inspect.signature(method).parameters)
    assert tuple(params[: len(expected)]) == expected, (
        f"trl.GRPOTrainer.{name} changed signature in trl {trl.__version__}: its parameters are now {params}, "
        f"trl_ppo_variants relies on {list(expected)} (TRL_PRIVATE_API in trl_ppo_variants/trainers/base.py)"
    )


def test_private_api_covers_our_overrides():
    """Every private GRPOTrainer/Trainer method that our trainers (the base class and every exported trainer)
    override is guarded above."""
    import trl_ppo_variants

    classes = [getattr(trl_ppo_variants, name) for name in trl_ppo_variants.__all__ if name.endswith("Trainer")]
    missing = {}
    for cls in classes:
        for klass in cls.__mro__:
            if klass is GRPOTrainer or not issubclass(klass, GRPOTrainer):
                continue
            for name, value in vars(klass).items():
                private = name.startswith("_") and not name.startswith("__")
                if private and callable(value) and hasattr(GRPOTrainer, name) and name not in TRL_PRIVATE_API:
                    missing.setdefault(name, klass.__name__)
    assert not missing, (
        f"these TRL private methods are overridden ({missing}) but not guarded: add them with their parameters to "
        "TRL_PRIVATE_API in trl_ppo_variants/trainers/base.py"
    )


def test_trainer_state_we_read_exists(toy_model_dir, toy_dataset, tmp_path):
    """Attributes of a built GRPOTrainer the base class reads or writes at run time."""
    from trl_ppo_variants.toy import addition_reward

    trainer = GRPOTrainer(toy_model_dir, addition_reward, args=toy_args(trl.GRPOConfig, tmp_path),
                          train_dataset=toy_dataset)
    for attr in ("beta", "ref_model", "reward_weights", "num_generations", "num_generations_eval", "loss_type",
                 "max_completion_length", "importance_sampling_level", "_metrics", "_logs", "_tokenizer",
                 "accelerator", "_buffered_inputs", "_step", "epsilon_low", "epsilon_high", "scale_rewards",
                 "temperature", "use_vllm", "use_transformers_continuous_batching", "rollout_func"):
        assert hasattr(trainer, attr), f"GRPOTrainer no longer has `{attr}`; trainers/base.py reads it"
    assert "advantages" in trainer._logs, "GRPOTrainer._logs['advantages'] is gone; base._log_advantages edits it"
    assert trainer._logs["advantages"].maxlen is not None
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for needle in ("self._calculate_rewards(", "if self.beta != 0.0:", '"advantages": advantages'):
        assert needle in source, (
            f"GRPOTrainer._generate_and_score_completions no longer contains {needle!r}: the seam in "
            "trainers/base.py (rewards capture, reference toggling, advantage replacement) must be re-checked"
        )
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    needle = "self._buffered_inputs[self._step % self.args.steps_per_generation]"
    assert needle in source, (
        f"GRPOTrainer._prepare_inputs no longer contains {needle!r}: the per-optimizer-step token count of "
        "trainers/base.py (`_step_normalizers`) assumes micro-batch `_step` trains that slice of the buffer"
    )
    source = inspect.getsource(trl.GRPOConfig.__post_init__)
    assert "self.num_generations < 2" in source, (
        "GRPOConfig.__post_init__ no longer refuses num_generations < 2 with `<`: re-check base._GroupOfOne, which "
        "lets REINFORCE++ and ReMax configs through with num_generations=1"
    )
    # the sampling log-probs recorded during `generate` (base._generate_single_turn -> generation.patched_generate)
    # reach the rollout as TRL's `sampling_per_token_logps`
    source = inspect.getsource(GRPOTrainer._generate_single_turn)
    for needle in ("unwrapped_model.generate(", "return completion_ids, logprobs"):
        assert needle in source, (
            f"GRPOTrainer._generate_single_turn no longer contains {needle!r}: the generate wrapper of "
            "trainers/base.py (ReMax's greedy rows, the recorded sampling log-probs) must be re-checked"
        )
    # a VLM's prompts for the colocate engine (base._tokenize_prompts, engine_prompt_ids): rendered with TRL's arguments,
    # and its vLLM branch reads the prompt ids for the engine only; `_generate` hands the forward the image lists
    # second to last (base._generate)
    for attr in ("tools", "chat_template", "chat_template_kwargs", "environment_factories", "vllm_mode"):
        assert hasattr(trainer, attr), f"GRPOTrainer no longer has `{attr}`; trainers/base.py reads it"
    for method, needle in ((GRPOTrainer._generate_single_turn, "prompts=prompt_ids,"),
                           (GRPOTrainer._generate, "extra_fields, images, tool_images")):
        assert needle in inspect.getsource(method), (
            f"GRPOTrainer.{method.__name__} no longer contains {needle!r}: the vLLM image prompts of "
            "trainers/base.py (`engine_prompt_ids`, `_generate`) must be re-checked")
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in source, (
        "GRPOTrainer._generate_and_score_completions no longer stores `sampling_per_token_logps`: "
        "VariantTrainer.sampling_logps (trainers/base.py) reads the generation's log-probs from there"
    )
    # the recording `generate` copies what TRL's training forward does: accelerate's autocast, no position_ids
    source = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    text_positions = re.search(r"(?<!image_)position_ids", source)  # image_position_ids are a VLM's, not ours
    assert "with self.accelerator.autocast():" in source and text_positions is None, (
        "GRPOTrainer._get_per_token_logps_and_entropies changed its autocast or now passes position_ids: the "
        "recording `generate` of trainers/base.py (`_generate_single_turn`) must be re-checked"
    )
    source = inspect.getsource(GRPOTrainer._compute_loss)
    for needle in ('inputs["advantages"]', "self.beta * per_token_kl", "self._get_per_token_logps_and_entropies(",
                   'inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes',
                   "self.current_gradient_accumulation_steps / self.args.steps_per_generation"):
        assert needle in source, (
            f"GRPOTrainer._compute_loss no longer contains {needle!r}: the KL toggling, log-prob capture and "
            "per-step token normaliser in trainers/base.py must be re-checked"
        )


def test_the_image_inputs_trl_slices_are_the_ones_selection_moves():
    """rollout.py packs per row exactly the image inputs TRL's forward takes (and nothing it does not know)."""
    from trl_ppo_variants import rollout

    params = list(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    image_params = params[params.index("compute_aux_loss") + 1:]
    assert sorted(image_params) == sorted(rollout.MULTIMODAL_KEYS), (
        f"trl {trl.__version__}'s _get_per_token_logps_and_entropies takes the image inputs {image_params}; "
        f"rollout.MULTIMODAL_KEYS (how rows keep their images) knows {list(rollout.MULTIMODAL_KEYS)}")


def test_transformers_checkpoint_loader_we_call():
    """`checkpointing.convert_checkpoint` (resume and `load_best_model_at_end`) runs transformers' own checkpoint
    loader, a private function, on a weightless twin of the model."""
    import dataclasses

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    assert list(inspect.signature(get_model_conversion_mapping).parameters)[:1] == ["model"]
    params = list(inspect.signature(convert_and_load_state_dict_in_model).parameters)
    assert params[:3] == ["model", "state_dict", "load_config"], (
        f"transformers' convert_and_load_state_dict_in_model now takes {params}: re-check "
        "checkpointing.convert_checkpoint")
    assert "weight_mapping" in {f.name for f in dataclasses.fields(LoadStateDictConfig)}, (
        "transformers' LoadStateDictConfig has no `weight_mapping` any more: re-check checkpointing.convert_checkpoint")
