"""Vision-language models under the trainers of the package (issue 27): each trainer trains the offline tiny VLMs of
`trl_ppo_variants.toy_vlm` (Gemma3, Qwen2-VL, Qwen2.5-VL) with images flowing through row selection (DAPO's rounds,
SPEED, GRESO, TTRL's vote/train split) and the KL in the reward; with policy == reference the KL at step 0 is 0 (the
recorded generation log-probs and the forward fallback alike); multi-image prompts; resume is exact with images.

Runs in fp32 (`bf16=False`: TRL's default bf16 autocast on CPU rounds `generate`'s KV-cached calls differently from
the forward's, up to 4e-3 per token on the tiny Qwen2-VL, which is not what these tests measure).
"""

import pytest
import torch

from trl_ppo_variants import rollout
from trl_ppo_variants.toy_vlm import VLM_FAMILIES, color_reward, make_tiny_vlm, toy_vlm_dataset, vision_parameter_names

#: per-token bound on |recorded - forward| and on the step-0 KL in fp32 (measured 9.5e-7 on both families)
FP32_BOUND = 1e-5
PAD = 0


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {family: make_tiny_vlm(str(root / family), family, seed=0) for family in VLM_FAMILIES}


def _first_letter(completion):
    """TTRL's answer: the completion's first letter (a tiny random model's votes then differ within a group)."""
    text = completion if isinstance(completion, str) else completion[0]["content"]
    letters = [c for c in text.lower() if c.isalpha()]
    return letters[0] if letters else None


def _word_steps(completions, answer, **kwargs):
    """Process GRPO's step rewards: each space-separated step scored by `color_reward`."""
    out = []
    for completion, truth in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        steps = text.split(" ") or [""]
        out.append(color_reward(steps, answer=[truth] * len(steps)))
    return out


EASY_COLORS = ("red", "green", "blue", "yellow")


def _half_easy(completions, answer, **kwargs):
    """`color_reward`, but every completion about an image of half the colours gets 1.0: those groups have no
    spread, so prompt selection drops them (and refills)."""
    graded = color_reward(completions, answer=answer)
    return [1.0 if truth in EASY_COLORS else r for r, truth in zip(graded, answer)]


#: prompt selection needs groups to drop: two prompts a step
TWO_GROUPS = {"per_device_train_batch_size": 8}
# name -> (config, trainer, config overrides, trainer kwargs, reward)
SPECS = {
    "grpo": ("GRPOConfig", "GRPOTrainer", {}, {}, color_reward),
    "process_grpo": ("ProcessGRPOConfig", "ProcessGRPOTrainer", {"step_separator": " "},
                     {"step_reward_funcs": [_word_steps]}, color_reward),
    "rloo_kl": ("RLOOConfig", "RLOOTrainer", {"beta": 0.1}, {}, color_reward),
    "reinforce_pp": ("ReinforcePPConfig", "ReinforcePPTrainer", {"kl_in_reward_coef": 0.05}, {}, color_reward),
    "reinforce_pp_baseline": ("ReinforcePPConfig", "ReinforcePPTrainer", {"baseline": True, "beta": 0.01}, {},
                              color_reward),
    "dapo": ("DAPOConfig", "DAPOTrainer", {"max_generation_rounds": 3, **TWO_GROUPS}, {}, _half_easy),
    "speed": ("DAPOConfig", "DAPOTrainer", {"prompt_selection": "speed", "screening_num_generations": 2,
                                            "max_generation_rounds": 4, **TWO_GROUPS}, {}, _half_easy),
    "greso": ("RLOOConfig", "RLOOTrainer", {"prompt_selection": "greso", "max_generation_rounds": 3, "beta": 0.1,
                                            **TWO_GROUPS}, {}, _half_easy),
    "ttrl": ("TTRLConfig", "TTRLTrainer", {"n_votes": 4, "n_train": 2, "answer_extractor": _first_letter}, {}, None),
}
#: the quick suite trains every trainer on Qwen2-VL (M-RoPE, per-patch pixels) and Gemma3 (per-image pixels) with the
#: specs that move rows; Qwen2.5-VL and the remaining pairs are slow
QUICK = {("qwen2_vl", name) for name in SPECS} | {("gemma3", name) for name in ("dapo", "ttrl", "rloo_kl")}


def _make(name, model_dir, tmp_path, dataset=None, callbacks=None, **overrides):
    import trl_ppo_variants as V

    config_name, trainer_name, spec, kwargs, reward = {**SPECS, **VALUE_SPECS}[name]
    settings = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=2, learning_rate=0.05, logging_steps=1, report_to=[],
                    use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False)
    settings.update(spec)
    settings.update(overrides)
    args = getattr(V, config_name)(**settings)
    return getattr(V, trainer_name)(model_dir, reward, args=args, train_dataset=dataset or toy_vlm_dataset(16),
                                    callbacks=callbacks, **kwargs)


def _cases():
    return [pytest.param(family, name, marks=() if (family, name) in QUICK else pytest.mark.slow)
            for family in VLM_FAMILIES for name in SPECS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,name", _cases())
def test_every_trainer_trains_each_vlm_and_its_vision_tower(vlm_dirs, family, name, tmp_path):
    trainer = _make(name, vlm_dirs[family], tmp_path)
    vision = vision_parameter_names(trainer.model)
    before = {n: trainer.model.get_parameter(n).detach().clone() for n in vision}
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    changed = [n for n in vision if not torch.equal(before[n], trainer.model.get_parameter(n))]
    assert len(changed) == len(vision), sorted(set(vision) - set(changed))
    metrics = {k for log in trainer.state.log_history for k in log}
    if name in ("dapo", "speed", "greso"):  # groups were dropped (the easy colours') and the batch refilled
        prefix = "dapo" if name != "greso" else "selection"
        dropped = [log[f"{prefix}/frac_dropped_all_correct"] for log in trainer.state.log_history
                   if f"{prefix}/frac_dropped_all_correct" in log]
        assert dropped and max(dropped) > 0, sorted(k for k in metrics if "/" in k)
    if name in ("rloo_kl", "reinforce_pp"):
        assert "kl_in_reward" in metrics


def _rollout(trainer, family_rows=2):
    """One generation batch of the (untrained) trainer: TRL's rollout dict, before advantages."""
    trainer.model.train()
    inputs = [trainer.train_dataset[i] for i in range(family_rows) for _ in range(trainer.num_generations)]
    captured = {}
    reference_kl = trainer.reference_kl

    def spy(output):
        captured["output"] = dict(output)
        captured["kl"] = reference_kl(output)
        return captured["kl"]

    trainer.reference_kl = spy
    trainer._generate_and_score_completions(inputs)
    return captured["output"], captured["kl"]


def _forward_logps(trainer, output):
    from trl import GRPOTrainer

    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, output["completion_ids"].shape[1], **rollout.image_inputs(output))
    return logps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["generate", "forward"])
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_kl_at_step_zero_is_zero_with_images(vlm_dirs, family, source, tmp_path):
    """Policy == reference: the KL in the reward is 0 per token (fp32 bound), from the log-probs recorded during
    `generate` (Qwen's M-RoPE positions kept: arange positions made it 0.78 per token) and from the forward fallback
    (with the images: without them 0.013 on Qwen2-VL, 0.14 on Gemma3); the recorded log-probs are the forward's."""
    trainer = _make("rloo_kl", vlm_dirs[family], tmp_path, sampling_logps_source=source)
    output, kl = _rollout(trainer)
    assert output.get("pixel_values") is not None  # the rollout had images
    mask = output["completion_mask"].bool()
    assert kl[mask].abs().max().item() < FP32_BOUND
    if source == "generate":
        assert trainer._metrics["train"]["sampling_logps/forward_fallback"] == [0.0]  # the recording was used
        recorded = output["sampling_per_token_logps"]
        assert (recorded - _forward_logps(trainer, output))[mask].abs().max().item() < FP32_BOUND


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,name", [("gemma3", "dapo"), ("qwen2_5_vl", "ttrl"),
                                         pytest.param("qwen2_5_vl", "rloo_kl", marks=pytest.mark.slow),
                                         pytest.param("gemma3", "reinforce_pp", marks=pytest.mark.slow)])
def test_multi_image_prompts(vlm_dirs, family, name, tmp_path):
    trainer = _make(name, vlm_dirs[family], tmp_path, dataset=toy_vlm_dataset(16, images_per_prompt=2))
    trainer.train()
    assert trainer.state.global_step == 2


def _some_prompts_without_images(n: int = 16):
    """`toy_vlm_dataset(n, images_per_prompt=2)` with every third prompt asking about no image (its image parts and
    images dropped): TRL's `zen-multi-image` layout, where a prompt may have 0 images."""
    dataset = toy_vlm_dataset(n, images_per_prompt=2)

    def drop(row, i):
        if i % 3 == 0:
            row["prompt"] = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
            row["images"] = []
        return row

    return dataset.map(drop, with_indices=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_a_batch_mixing_prompts_with_and_without_images_trains(vlm_dirs, family, tmp_path):
    """TRL gives an image-less prompt `None` for images and its processor refuses the mixed batch (trl.GRPOTrainer
    too, with several prompts a batch); DAPO's rounds make such batches (TRL's test_train_vlm_multi_image failed)."""
    trainer = _make("dapo", vlm_dirs[family], tmp_path, dataset=_some_prompts_without_images())
    trainer.train()
    assert trainer.state.global_step == 2


#: trainers beyond SPECS for the mixed-batch test: critics (PPO, VAPO: chunked at rollout, a micro-batch in the loss)
#: and ReMax's greedy rows
VALUE_SPECS = {
    "ppo": ("PPOConfig", "PPOTrainer", {}, {}, color_reward),
    "vapo": ("VAPOConfig", "VAPOTrainer", {"value_pretrain_steps": 0}, {}, color_reward),
    "remax": ("ReMaxConfig", "ReMaxTrainer", {}, {}, color_reward),
}
#: every trainer family, with accumulation 2: TRL's micro-batch split, its reference forward's chunks (rloo_kl, ppo),
#: DAPO's rounds, TTRL's split, the critic's chunks, ReMax's greedy rows
MIXED = ("grpo", "rloo_kl", "dapo", "ttrl", "ppo", "vapo", "remax")
QUICK_MIXED = {("gemma3", "grpo"), ("gemma3", "ppo"), ("gemma3", "ttrl"), ("qwen2_5_vl", "rloo_kl"),
               ("qwen2_5_vl", "dapo"), ("qwen2_5_vl", "vapo"), ("qwen2_5_vl", "remax")}


@pytest.fixture
def forward_images(monkeypatch):
    """(rows, shape of `pixel_values`, `image_sizes` as a list; None where not given) of every forward pass TRL's
    `_get_per_token_logps_and_entropies` runs (policy, reference, old log-probs; each chunk of the package's own split
    once)."""
    from trl import GRPOTrainer

    seen = []
    inner = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, *args, pixel_values=None, **kwargs):
        sizes = kwargs.get("image_sizes")
        seen.append((input_ids.shape[0], None if pixel_values is None else tuple(pixel_values.shape),
                     None if sizes is None else sizes.tolist()))
        return inner(self, model, input_ids, *args, pixel_values=pixel_values, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,name", [
    pytest.param(family, name, marks=() if (family, name) in QUICK_MIXED else pytest.mark.slow)
    for family in ("gemma3", "qwen2_5_vl") for name in MIXED])
def test_prompts_with_and_without_images_train_with_gradient_accumulation(vlm_dirs, family, name, tmp_path,
                                                                          forward_images):
    """One prompt in four has an image, accumulation 2 (issue 33): a micro-batch or a chunk of the reference, policy
    or critic forward without an image got empty image tensors, which the vision towers refuse (Gemma3: "cannot
    reshape tensor of 0 elements", Qwen2.5-VL: "torch.cat(): expected a non-empty list"). Each such subset now goes
    text-only, as TRL gives a text-only batch; the others keep their images."""
    from trl_ppo_variants.toy_vlm import toy_vlm_mixed_dataset

    # unshuffled, every generation batch holds 4 prompts, one with an image: its 8 (trained) rows, 2 of them with the
    # image, make 4 micro-batches of 2 rows (2 optimizer steps of 2), so 2 or more have no image whatever TRL's shuffle
    layout = dict(per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2,
                  steps_per_generation=4, shuffle_dataset=False)
    if name == "ttrl":  # 4 votes, 2 trained per prompt
        layout.update(per_device_train_batch_size=4, num_generations=4)
    trainer = _make(name, vlm_dirs[family], tmp_path, dataset=toy_vlm_mixed_dataset(16), **layout)
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)
    # forwards with images and forwards of image-less subsets (of batches with an image) ran; none got empty images
    assert all(images is None or images[0] > 0 for _, images, _ in forward_images), forward_images
    assert any(images is None for _, images, _ in forward_images), forward_images
    assert any(images for _, images, _ in forward_images), forward_images


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_kl_at_step_zero_is_zero_with_image_less_reference_chunks(vlm_dirs, family, tmp_path):
    """Policy == reference, one prompt in four with an image, the reference forward in chunks of 4 rows (the second
    without an image): the KL in the reward is 0 per token against the log-probs recorded while generating, so each
    chunk's rows were scored with their own images (and the image-less ones with none)."""
    from trl_ppo_variants.toy_vlm import toy_vlm_mixed_dataset

    trainer = _make("rloo_kl", vlm_dirs[family], tmp_path, dataset=toy_vlm_mixed_dataset(8), num_generations=2)
    output, kl = _rollout(trainer, family_rows=4)
    assert output["num_images"] == [1, 1, 0, 0, 0, 0, 0, 0]
    assert kl[output["completion_mask"].bool()].abs().max().item() < FP32_BOUND


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory):
    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "llava_next"), "llava_next", seed=0)


def _solid_image_prompts(colors, sizes):
    """One prompt a colour about a solid image of that colour and size (width, height): LLaVA-NeXT gives a 32x32
    image 2 entries (its base view and 1 tile), a 64x32 one 3."""
    from datasets import Dataset
    from PIL import Image

    from trl_ppo_variants.toy_vlm import COLORS

    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the image?"}]}]
    return Dataset.from_dict({"prompt": [question] * len(colors), "answer": list(colors),
                              "image": [Image.new("RGB", size, COLORS[c]) for c, size in zip(colors, sizes)]})


#: prompt selections whose rounds are joined: (config overrides, the loss batch's rows); SPEED screens 2 of 4
TILE_ROUNDS = {"dapo": ({"num_generations": 2, "per_device_train_batch_size": 4}, 4),
               "speed": ({"num_generations": 4, "per_device_train_batch_size": 8}, 8),
               "greso": ({"num_generations": 2, "per_device_train_batch_size": 4}, 4)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "dapo" else pytest.mark.slow) for n in TILE_ROUNDS])
def test_llava_next_rounds_of_other_tile_counts_train(llava_next_dir, tmp_path, forward_images, name):
    """Prompt selection's rounds with LLaVA-NeXT (issue 33): the first round's images are square (2 entries an image),
    the refills' 2:1 (3 entries); joining the rounds failed ("Sizes of tensors must match except in dimension 0").
    Unshuffled, the first round is prompts 0 and 1: prompt 1's colour is easy (no spread: dropped), so the step
    keeps prompt 0's square group and a refilled 2:1 one, trained in one forward whose square image is padded with a
    zero tile."""
    dataset = _solid_image_prompts(["purple", "red", "orange", "black", "white", "purple", "orange", "black"],
                                   [(32, 32)] * 2 + [(64, 32)] * 6)
    overrides, rows = TILE_ROUNDS[name]
    trainer = _make(name, llava_next_dir, tmp_path, dataset=dataset, max_steps=1, shuffle_dataset=False, **overrides)
    trainer.train()
    assert trainer.state.global_step == 1
    prefix = "selection" if name == "greso" else "dapo"
    logs = {k: v for log in trainer.state.log_history for k, v in log.items()}
    assert logs[f"{prefix}/rounds"] >= 2 and logs[f"{prefix}/groups_kept"] == 2
    # the loss's batch (the last forward): a square image (32 x 32, its 2 entries padded to 3) and 2:1 ones (32 high,
    # 64 wide)
    batch_rows, pixels, sizes = forward_images[-1]
    assert batch_rows == rows and pixels == (rows, 3, 3, 32, 32), forward_images
    assert [32, 32] in sizes and [32, 64] in sizes, forward_images


def test_a_padded_tile_never_reaches_the_vision_tower(llava_next_dir):
    """A square image's row joined with a 2:1 image's row (`concat_rollouts`, then TRL's layout back): its image is
    padded with a zero tile to the other's 3 entries, which LLaVA-NeXT drops by the row's own `image_sizes` (the
    padding is never a real tile): the row's log-probs are those of the row alone, with its 2 entries."""
    from types import SimpleNamespace

    from transformers import AutoModelForImageTextToText

    from trl_ppo_variants.toy_vlm import load_tiny_vlm_processor

    model = AutoModelForImageTextToText.from_pretrained(llava_next_dir).eval()
    processor = load_tiny_vlm_processor(llava_next_dir)
    dataset = _solid_image_prompts(["purple", "orange"], [(32, 32), (64, 32)])
    completion = processor.tokenizer("it is purple", add_special_tokens=False, return_tensors="pt")["input_ids"]

    def one_row(i):
        text = processor.apply_chat_template(dataset[i]["prompt"], tokenize=False, add_generation_prompt=True)
        inputs = processor(images=[dataset[i]["image"]], text=[text], return_tensors="pt")
        return {"prompt_ids": inputs["input_ids"], "prompt_mask": inputs["attention_mask"],
                "completion_ids": completion, "completion_mask": torch.ones_like(completion),
                "pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"], "num_images": [1]}

    def logps(batch):
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                           image_sizes=batch["image_sizes"]).logits[:, -completion.shape[1] - 1 : -1]
        return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)

    square, wide = one_row(0), one_row(1)
    assert square["pixel_values"].shape[1] == 2 and wide["pixel_values"].shape[1] == 3
    joined = rollout.concat_rollouts([rollout.row_entries(square, 1), rollout.row_entries(wide, 1)], PAD)
    batch = rollout.redistribute_rows(SimpleNamespace(num_processes=1, process_index=0), joined,
                                      torch.zeros(2, dtype=torch.long), PAD)
    assert batch["pixel_values"].shape[1] == 3 and not batch["pixel_values"][0, 2].any()  # a zero tile
    assert torch.equal(batch["pixel_values"][0, :2], square["pixel_values"][0])
    torch.testing.assert_close(logps(batch)[0], logps(square)[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logps(batch)[1], logps(wide)[0], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,name", [("qwen2_vl", "dapo"), ("gemma3", "ttrl")])
def test_resume_is_exact_with_images(vlm_dirs, family, name, tmp_path):
    """tests/test_resume.py's protocol with images: 4 steps straight, or 3 steps, a checkpoint, and a fresh trainer
    that resumes; the logs after step 3 and the final weights are equal."""
    from reliability_helpers import StopAt, modules_state, step_logs

    common = dict(max_steps=4, save_strategy="steps", save_steps=3)
    full = _make(name, vlm_dirs[family], tmp_path / "full", **common)
    full.train()
    stopped = _make(name, vlm_dirs[family], tmp_path / "stopped", callbacks=[StopAt(3)], **common)
    stopped.train()
    resumed = _make(name, vlm_dirs[family], tmp_path / "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    logs_a, logs_b = step_logs(full), step_logs(resumed)
    assert logs_a.get(4) and logs_b.get(4) == logs_a[4]
    wa, wb = modules_state(full), modules_state(resumed)
    assert not [k for k in wa if not torch.equal(wa[k], wb[k])]


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl"])
def test_checkpoint_weights_load_back_under_the_models_names(vlm_dirs, family, tmp_path):
    """transformers 5 saves a VLM's weights under its original names, which `Trainer`'s resume loaded raw (every key
    missing, the initial weights kept); `checkpoint_to_model_keys` renames them back."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from trl_ppo_variants.checkpointing import checkpoint_to_model_keys

    model = AutoModelForImageTextToText.from_pretrained(vlm_dirs[family])
    model.save_pretrained(tmp_path / "ckpt")
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    own = model.state_dict()
    assert not set(saved) <= set(own)  # the saved names are not the model's
    renamed = checkpoint_to_model_keys(model, saved)
    assert set(renamed) <= set(own) and len(renamed) == len(saved)
    assert all(torch.equal(renamed[k], own[k]) for k in renamed)
    again = checkpoint_to_model_keys(model, renamed)  # already the model's names: unchanged
    assert again.keys() == renamed.keys() and all(torch.equal(again[k], renamed[k]) for k in again)


def test_models_that_place_their_own_positions_are_told_apart(vlm_dirs):
    """Qwen's M-RoPE derives positions from the images (a recording `generate` gets none); Gemma3 counts them."""
    from transformers import AutoModelForImageTextToText

    from trl_ppo_variants import generation

    own = {family: generation.computes_own_positions(AutoModelForImageTextToText.from_pretrained(path))
           for family, path in vlm_dirs.items()}
    assert own == {"gemma3": False, "qwen2_vl": True, "qwen2_5_vl": True}
