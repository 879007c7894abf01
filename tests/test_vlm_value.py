"""Vision-language models under ReMax, PPO and VAPO (issue 27): the critic sees the images the policy sees (full and
LoRA critic, every frozen base), ReMax's greedy rows carry their own prompt's images (HF `generate` and the vLLM
request), and each trainer trains 2 steps on every tiny VLM family (`trl_ppo_variants.toy_vlm`)."""

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants.critic import critic_values
from trl_ppo_variants.rollout import image_inputs, image_rows, take_rows
from trl_ppo_variants.toy_vlm import (
    VLM_FAMILIES,
    color_reward,
    load_tiny_vlm_processor,
    make_tiny_vlm,
    toy_vlm_dataset,
    vision_parameter_names,
)
from trl_ppo_variants.trainers.ppo import PPOConfig, PPOTrainer
from trl_ppo_variants.trainers.remax import ReMaxConfig, ReMaxTrainer, greedy_row_images
from trl_ppo_variants.trainers.vapo import VAPOConfig, VAPOTrainer

G = 2


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_value")
    return {family: make_tiny_vlm(str(root / family), family, seed=0) for family in VLM_FAMILIES}


def _args(config_cls, tmp_path, **overrides):
    kwargs = dict(per_device_train_batch_size=4, num_generations=G, max_completion_length=4, learning_rate=1e-2)
    if config_cls is VAPOConfig:
        kwargs["value_pretrain_steps"] = 0
    kwargs.update(overrides)
    return toy_args(config_cls, tmp_path, **kwargs)


def _trainer(trainer_cls, config_cls, path, tmp_path, dataset=None, peft_config=None, **overrides):
    return trainer_cls(path, color_reward, args=_args(config_cls, tmp_path, **overrides),
                       train_dataset=dataset if dataset is not None else toy_vlm_dataset(8),
                       processing_class=load_tiny_vlm_processor(path), peft_config=peft_config)


def _same_text_two_images(processor, colors=("red", "blue")):
    """A batch of 2 rows with the same prompt and completion text, each with its own solid image: (ids, mask,
    image fields with `num_images`, completion width)."""
    from PIL import Image

    from trl_ppo_variants.toy_vlm import COLORS

    images = [Image.new("RGB", (32, 32), COLORS[c]) for c in colors]
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the image?"}]}]
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) + "red"
    batch = processor(text=[text] * len(images), images=[[im] for im in images], return_tensors="pt", padding=True)
    fields = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    fields["num_images"] = [1] * len(images)
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][-1])  # the text is the same
    return batch["input_ids"], batch["attention_mask"], image_inputs(fields), 3


# ------------------------------------------------------------------------------------------------ the critic
#: critic -> (config overrides, whether the policy is PEFT, the expected `critic_base`)
CRITICS = {
    "full": ({"critic_backbone": "full"}, False, "own"),
    "lora_copy": ({"kl_in_reward_coef": 0.0}, False, "copy"),  # no KL: no reference model to share
    "lora_reference": ({}, False, "reference"),  # PPO's default KL in the reward loads the reference model
    "lora_policy_adapter": ({}, True, "policy_adapter"),
}


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("kind", list(CRITICS))
def test_critic_values_depend_on_the_image(vlm_dirs, family, kind, tmp_path):
    """The same text with a red and a blue image: different values (the critic's backbone gets the image inputs),
    for the full critic and the LoRA critic over each frozen base. Text only, as the critic was called before, the
    two rows are the same state: identical values. The head reads the language model's hidden states."""
    from peft import LoraConfig

    overrides, peft, base = CRITICS[kind]
    trainer = _trainer(PPOTrainer, PPOConfig, vlm_dirs[family], tmp_path,
                       peft_config=LoraConfig(r=4, target_modules="all-linear") if peft else None, **overrides)
    assert trainer.critic_base == base
    assert trainer.critic.score.in_features == trainer.model.config.get_text_config().hidden_size
    ids, mask, fields, width = _same_text_two_images(trainer.processing_class)
    critic = trainer.critic
    with torch.no_grad():
        # give the new head a spread of weights so that small hidden differences show in the values
        critic.score.weight.normal_(0, 1)
        seen = critic_values(critic, ids, mask, width, image_fields=fields)
        blind = critic_values(critic, ids, mask, width)
        chunked = critic_values(critic, ids, mask, width, batch_size=1, image_fields=fields)
    assert (seen[0] - seen[1]).abs().max() > 1e-4
    torch.testing.assert_close(blind[0], blind[1], rtol=0, atol=1e-5)  # the same up to batched rounding
    # chunks of one row get their own row's images (`rollout.pack_multimodal`, then `take_rows`)
    torch.testing.assert_close(chunked, seen, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_critic_values_of_rows_without_images_take_no_image_inputs(vlm_dirs, family, tmp_path):
    """A micro-batch without an image, as TRL's split hands it over (empty `pixel_values`, `num_images` all 0, zero
    token types), is valued text-only, as TRL gives a text-only batch; the empty image tensors reached the vision
    tower (Gemma3: "cannot reshape tensor of 0 elements", Qwen2.5-VL: "torch.cat(): expected a non-empty list")."""
    trainer = _trainer(PPOTrainer, PPOConfig, vlm_dirs[family], tmp_path, critic_backbone="full")
    _, _, fields, _ = _same_text_two_images(trainer.processing_class)
    batch = trainer.processing_class.tokenizer(["Name a colour. red", "Name a colour. blue"], return_tensors="pt",
                                               padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    empty = {key: value[:0] if key in ("pixel_values", "image_grid_thw") else value for key, value in fields.items()}
    empty.update({key: torch.zeros_like(ids) for key in ("token_type_ids", "mm_token_type_ids") if key in fields},
                 num_images=[0, 0])
    with torch.no_grad():
        text_only = critic_values(trainer.critic, ids, mask, 3)
        for batch_size in (None, 1):
            torch.testing.assert_close(critic_values(trainer.critic, ids, mask, 3, batch_size=batch_size,
                                                     image_fields=empty), text_only, rtol=0, atol=1e-6)


def test_image_rows_pick_each_rows_own_images():
    """Grid layout (Qwen: `pixel_values` rows per image patch, `image_grid_thw` per image), flat layout (one
    `pixel_values` entry per image, `image_sizes`), per-token fields and rows without images."""
    grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 4]])  # 4, 4 and 8 patch rows
    fields = {"pixel_values": torch.arange(16.0).unsqueeze(1), "image_grid_thw": grid, "num_images": [1, 0, 2],
              "mm_token_type_ids": torch.tensor([[1], [0], [1]])}
    picked = image_rows(fields, [2, 0, 2], 3)
    assert picked["pixel_values"].squeeze(1).tolist() == list(range(4, 16)) + list(range(4)) + list(range(4, 16))
    assert picked["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2], [1, 2, 2], [1, 2, 4]]
    assert picked["num_images"] == [2, 1, 2] and picked["mm_token_type_ids"].tolist() == [[1], [1], [1]]
    assert image_rows(fields, [1, 1], 3) == {}  # no image: no image input, as TRL gives a text-only batch
    flat = {"pixel_values": torch.tensor([10.0, 20.0, 30.0]), "image_sizes": torch.tensor([[1, 1], [2, 2], [3, 3]]),
            "num_images": [2, 1], "token_type_ids": [[0, 1], [1, 0]]}
    picked = image_rows(flat, [1, 0], 2)
    assert picked["pixel_values"].tolist() == [30.0, 10.0, 20.0]
    assert picked["image_sizes"].tolist() == [[3, 3], [1, 1], [2, 2]]
    assert picked["token_type_ids"] == [[1, 0], [0, 1]]
    with pytest.raises(NotImplementedError, match="'pixel_values'"):  # neither per image nor per row
        image_rows({"pixel_values": torch.zeros(5)}, [0], 2)
    with pytest.raises(NotImplementedError, match="'token_type_ids' has 3 rows, expected 2"):
        image_rows({"pixel_values": torch.zeros(2, 1), "num_images": [1, 1], "token_type_ids": [[0], [1], [0]]},
                   [0], 2)
    with pytest.raises(ValueError, match=r"^mm:x: expected one entry per row \(2\), got Tensor \(\(3,\)\)$"):
        take_rows({"mm:x": torch.zeros(3)}, [0], 2)


# ------------------------------------------------------------------------------------------------ ReMax
def _remax_prompts(dataset, num_prompts):
    """TRL's rows for `_generate` (each prompt G times, its image parts filled in, as `_generate_and_score_completions`
    prepares them) and the matching dataset rows."""
    from trl.data_utils import prepare_multimodal_messages

    rows = [dict(dataset[i]) for i in range(num_prompts) for _ in range(G)]
    return [prepare_multimodal_messages(r["prompt"], images=[r["image"]]) for r in rows], rows


def _record_generate(model, calls):
    inner = model.generate

    def generate(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return inner(*args, **kwargs)

    model.generate = generate


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_remax_greedy_rows_carry_their_own_prompts_images(vlm_dirs, family, tmp_path):
    """Each greedy row is generated with its own prompt's image inputs (the same pixel values as that prompt's sampled
    rows), and its completion is that prompt's greedy completion: the one a batch holding that prompt alone gives."""
    dataset = toy_vlm_dataset(4, seed=1)
    assert len(set(dataset["answer"])) > 1
    trainer = _trainer(ReMaxTrainer, ReMaxConfig, vlm_dirs[family], tmp_path, dataset=dataset)
    trainer.model.train()
    calls = []
    _record_generate(trainer.model, calls)
    prompts, _ = _remax_prompts(dataset, 4)
    trainer._generate(prompts)
    greedy = [list(ids) for ids in trainer._greedy["completion_ids"]]
    assert trainer._greedy["rows"] == [0, 2, 4, 6]
    (call,) = calls
    num_rows = len(prompts) + 4
    assert call["input_ids"].shape[0] == num_rows
    per_row = image_rows({**image_inputs(call), "num_images": [1] * num_rows}, range(num_rows), num_rows)
    pixels = per_row["pixel_values"].reshape(num_rows, -1)
    for j, row in enumerate(trainer._greedy["rows"]):
        assert torch.equal(pixels[len(prompts) + j], pixels[row])
    assert not torch.equal(pixels[0], pixels[2])  # the prompts' images differ

    alone = []
    for i in range(4):  # each prompt alone in a batch: its greedy row cannot take another prompt's image
        trainer._generate(prompts[i * G: (i + 1) * G])
        alone.append(list(trainer._greedy["completion_ids"][0]))
    assert greedy == alone


def test_remax_greedy_row_images_follow_their_rows():
    fields = {"pixel_values": torch.arange(6.0).reshape(3, 2), "token_type_ids": [[0, 1], [0, 2], [0, 3]]}
    images = [["a"], ["b"], ["c"]]
    out = greedy_row_images(fields, images, [0, 1, 2, 2, 0], 3)
    assert out["pixel_values"][:, 0].tolist() == [0.0, 2.0, 4.0, 4.0, 0.0]
    assert out["token_type_ids"] == [[0, 1], [0, 2], [0, 3], [0, 3], [0, 1]]
    assert "num_images" not in out  # TRL's generate path would pass it to the model
    assert greedy_row_images({}, None, [0, 0], 1) == {}


def test_remax_vllm_greedy_request_carries_the_greedy_prompts_images(vlm_dirs, tmp_path):
    """vLLM pairs each prompt with its image list: the temperature-0 request gets each greedy prompt's own images."""
    dataset = toy_vlm_dataset(3, seed=1)
    trainer = _trainer(ReMaxTrainer, ReMaxConfig, vlm_dirs["qwen2_vl"], tmp_path, dataset=dataset)
    requests = []

    class FakeVLLM:
        temperature = 1.0

        def generate(self, prompts, images, num_generations, profiler=None):
            requests.append((list(prompts), images, num_generations, self.temperature))
            return prompts, [[5] for _ in prompts], [[[-0.5]] for _ in prompts], None

    trainer.use_vllm = True
    trainer.vllm_generation = FakeVLLM()
    trainer._last_loaded_step = trainer.state.global_step
    prompts, rows = _remax_prompts(dataset, 3)
    trainer._generate(prompts)
    (sampled_ids, sampled_images, _, _), (greedy_ids, greedy_images, n, temperature) = requests
    assert (n, temperature) == (1, 0.0)
    assert greedy_ids == sampled_ids[::G]
    assert [imgs[0] for imgs in greedy_images] == [rows[i]["image"] for i in (0, 2, 4)]
    assert greedy_images == sampled_images[::G]


# ------------------------------------------------------------------------------------------------ training
TRAINERS = {
    "remax": (ReMaxTrainer, ReMaxConfig, {}),
    "ppo_lora": (PPOTrainer, PPOConfig, {}),  # PPO's defaults: KL in the reward, LoRA critic over the reference
    "ppo_full": (PPOTrainer, PPOConfig, {"critic_backbone": "full"}),
    "vapo": (VAPOTrainer, VAPOConfig, {}),
}


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("name", list(TRAINERS))
def test_trains_two_steps_on_each_vlm(vlm_dirs, family, name, tmp_path):
    """Two steps; the policy's vision tower changes, and a full critic's own vision tower too (it is in the critic's
    forward: a text-only critic would leave it untouched)."""
    trainer_cls, config_cls, overrides = TRAINERS[name]
    trainer = _trainer(trainer_cls, config_cls, vlm_dirs[family], tmp_path, **overrides)
    vision = vision_parameter_names(trainer.model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(torch.tensor(log.get("loss", 0.0))) for log in trainer.state.log_history)
    assert any(not torch.equal(before[n], params[n]) for n in vision if not n.startswith("critic."))
    if name == "remax":
        assert any("remax/greedy_reward" in log for log in trainer.state.log_history)
        return
    critic = [n for n in params if n.startswith("critic.") and params[n].requires_grad]
    assert critic and any(not torch.equal(before[n], params[n]) for n in critic)
    if overrides.get("critic_backbone") == "full" or config_cls is VAPOConfig:  # VAPO's default is the full critic
        critic_vision = [n for n in critic if n in vision]
        assert critic_vision and all(not torch.equal(before[n], params[n]) for n in critic_vision)


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
@pytest.mark.parametrize("backbone", ["full", "lora"])
def test_vlm_critic_checkpoint_round_trip(vlm_dirs, family, backbone, tmp_path):
    """A VLM checkpoint is read back as the best model (`load_best_model_at_end`) by a fresh trainer: the policy's
    weights (saved under the VLM's original key names, which transformers' `_load_best_model` loaded raw: every
    weight missing) and the critic in `value_model/`, with the same values on image rows; the critic also loads on
    its own (`load_value_model`)."""
    from reliability_helpers import modules_state

    from trl_ppo_variants.critic import VALUE_MODEL_DIR, load_value_model

    def make(out):
        return _trainer(PPOTrainer, PPOConfig, vlm_dirs[family], tmp_path, critic_backbone=backbone,
                        output_dir=str(tmp_path / out), save_strategy="steps", save_steps=2)

    trained = make("a")
    trained.train()
    fresh = make("b")
    ids, mask, fields, width = _same_text_two_images(trained.processing_class)
    with torch.no_grad():
        before = critic_values(fresh.critic, ids, mask, width, image_fields=fields)
        fresh.state.best_model_checkpoint = str(tmp_path / "a" / "checkpoint-2")
        fresh._load_best_model()
        expected = critic_values(trained.critic, ids, mask, width, image_fields=fields)
        loaded = critic_values(fresh.critic, ids, mask, width, image_fields=fields)
    assert not torch.equal(before, expected)  # training changed the critic
    assert torch.equal(loaded, expected)
    saved, read = modules_state(trained), modules_state(fresh)
    assert saved.keys() == read.keys()
    different = [k for k in saved if not torch.equal(saved[k], read[k])]
    assert not different, f"{len(different)} weights differ from the checkpoint's: {different[:3]}"
    alone = load_value_model(str(tmp_path / "a" / "checkpoint-2" / VALUE_MODEL_DIR))
    with torch.no_grad():
        torch.testing.assert_close(critic_values(alone, ids, mask, width, image_fields=fields), expected)


def test_a_backbone_without_image_inputs_is_refused(toy_model_dir):
    """A critic whose backbone cannot take the images (a text model's) says so instead of valuing the text alone."""
    from transformers import AutoModelForCausalLM

    from trl_ppo_variants.critic import build_critic

    critic = build_critic(AutoModelForCausalLM.from_pretrained(toy_model_dir), critic_backbone="full")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(NotImplementedError, match=r"critic: .*Model.forward takes no pixel_values"):
        critic_values(critic, ids, torch.ones_like(ids), 1, image_fields={"pixel_values": torch.zeros(1, 3)})


# ------------------------------------------------------------------------------------------------ resume
#: quick: each family and each trainer once (7-12 s a case); the other pairs are slow
QUICK_RESUME = {("gemma3", "ppo_lora"), ("qwen2_vl", "ppo_full"), ("qwen2_vl", "remax")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,name", [
    pytest.param(family, name, marks=() if (family, name) in QUICK_RESUME else pytest.mark.slow)
    for family in ("qwen2_vl", "gemma3") for name in ("ppo_lora", "ppo_full", "remax")])
def test_resume_is_exact_with_images(vlm_dirs, family, name, tmp_path):
    """tests/test_resume.py's protocol with images: 4 steps straight, or 3 steps, a checkpoint (the policy's weights,
    the critic in `value_model/`), and a fresh trainer that resumes; the logs after step 3 and the final policy and
    critic weights are equal."""
    import transformers
    from reliability_helpers import StopAt, modules_state, step_logs
    from transformers.testing_utils import CaptureLogger

    trainer_cls, config_cls, overrides = TRAINERS[name]

    def make(out, callbacks=None):
        trainer = _trainer(trainer_cls, config_cls, vlm_dirs[family], tmp_path, output_dir=str(tmp_path / out),
                           max_steps=4, save_strategy="steps", save_steps=3, **overrides)
        for callback in callbacks or ():
            trainer.add_callback(callback)
        return trainer

    full = make("full")
    full.train()
    stopped = make("stopped", [StopAt(3)])
    stopped.train()
    assert stopped.state.global_step == 3
    resumed = make("stopped")
    with CaptureLogger(transformers.trainer.logger) as log:
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert "missing keys" not in log.out  # nor Gemma3's tied lm_head, which no checkpoint holds
    logs_a, logs_b = step_logs(full), step_logs(resumed)
    assert logs_a.get(4) and logs_b.get(4) == logs_a[4]
    wa, wb = modules_state(full), modules_state(resumed)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} weights differ after resume: {different[:5]}"
