"""The offline tiny vision-language models (`trl_ppo_variants.toy_vlm`): they load through the Auto classes, their
outputs depend on the image, the colour data set and reward have the shape TRL expects, and `trl.GRPOTrainer` trains
each family (the vision tower included)."""

import pytest
import torch

from trl_ppo_variants.toy_vlm import (
    EXTRA_FAMILIES,
    VLM_FAMILIES,
    color_images,
    color_reward,
    load_tiny_vlm_processor,
    make_tiny_vlm,
    toy_vlm_dataset,
    vision_parameter_names,
)

ALL_FAMILIES = VLM_FAMILIES + EXTRA_FAMILIES


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_vlm")
    return {family: make_tiny_vlm(str(root / family), family, seed=0) for family in ALL_FAMILIES}


def _inputs(processor, dataset, rows):
    texts = [processor.apply_chat_template(dataset[i]["prompt"], tokenize=False, add_generation_prompt=True)
             for i in rows]
    return processor(text=texts, images=[[dataset[i]["image"]] for i in rows], return_tensors="pt", padding=True)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_model_and_processor_load_offline_and_the_image_changes_the_output(vlm_dirs, family):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(vlm_dirs[family])
    processor = AutoProcessor.from_pretrained(vlm_dirs[family])
    assert type(processor) is type(load_tiny_vlm_processor(vlm_dirs[family]))
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert vision_parameter_names(model)
    dataset = toy_vlm_dataset(8)
    first = dataset["answer"][0]
    other = next(i for i, a in enumerate(dataset["answer"]) if a != first)
    inputs = _inputs(processor, dataset, [0, other])
    image_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    # 4 tokens an image; LLaVA-NeXT: 16 patches of the base view, 16 of the one tile, 4 row ends (more than 32x32
    # is not seen)
    per_image = 36 if family == "llava_next" else 4
    assert (inputs["input_ids"] == image_id).sum(dim=1).tolist() == [per_image, per_image]
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
    # the same text, two images: the next-token distributions differ (the image reaches the language model)
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_qwen_processor_refuses_videos(vlm_dirs):
    processor = load_tiny_vlm_processor(vlm_dirs["qwen2_vl"])
    with pytest.raises(ValueError, match="videos: .* image-only"):
        processor(text=["x"], videos=[[color_images(1)[0][0]]])


def test_dataset_rows_carry_their_own_images_and_answers():
    single = toy_vlm_dataset(6, seed=3)
    assert set(single.column_names) == {"prompt", "image", "answer"}
    content = single[0]["prompt"][0]["content"]
    assert [part["type"] for part in content] == ["image", "text"] and single[0]["prompt"][0]["role"] == "user"
    pixels = [tuple(single[i]["image"].getpixel((0, 0))) for i in range(6)]
    assert len(set(map(tuple, (list(single[i]["image"].getdata()) for i in range(6))))) == 6  # all images differ
    assert all(pixels)  # PIL images, read back from the data set
    multi = toy_vlm_dataset(4, images_per_prompt=3)
    assert "images" in multi.column_names and "image" not in multi.column_names
    assert all(len(row) == 3 for row in multi["images"])
    assert [p["type"] for p in multi[0]["prompt"][0]["content"]].count("image") == 3
    with pytest.raises(ValueError, match="images_per_prompt: expected an integer >= 1"):
        toy_vlm_dataset(4, images_per_prompt=0)


def test_mixed_dataset_has_an_image_every_nth_prompt():
    from trl_ppo_variants.toy_vlm import toy_vlm_mixed_dataset

    mixed = toy_vlm_mixed_dataset(8, image_every=4)
    assert set(mixed.column_names) == {"prompt", "images", "answer"}
    assert [len(images) for images in mixed["images"]] == [1, 0, 0, 0, 1, 0, 0, 0]
    kinds = [[part["type"] for part in row[0]["content"]] for row in mixed["prompt"]]
    assert kinds == [["image", "text"], ["text"], ["text"], ["text"]] * 2
    plain = toy_vlm_dataset(8)
    assert mixed["answer"] == plain["answer"]
    assert list(mixed[4]["images"][0].getdata()) == list(plain[4]["image"].getdata())
    with pytest.raises(ValueError, match="image_every: expected an integer >= 1"):
        toy_vlm_mixed_dataset(4, image_every=0)


def test_color_images_are_named_by_their_colour():
    from trl_ppo_variants.toy_vlm import COLORS

    images, names = color_images(20, seed=1)
    for image, name in zip(images, names):
        # solid or striped with a darker shade: the most common pixel or its 3/5 shade is the named colour
        rgb = COLORS[name]
        assert {rgb, tuple(c * 3 // 5 for c in rgb)} >= {color for _, color in image.getcolors()}


def test_color_reward_is_full_for_the_answer_and_graded_otherwise():
    completions = [[{"role": "assistant", "content": "It is Red."}], [{"role": "assistant", "content": "dre"}],
                   [{"role": "assistant", "content": "xq"}], [{"role": "assistant", "content": "\x07\x80"}],
                   [{"role": "assistant", "content": ""}]]
    rewards = color_reward(completions, answer=["red"] * 5)
    assert rewards[0] == 1.0 and rewards[4] == 0.0
    assert 0.4 < rewards[1] < 0.5  # every letter, not the word
    assert 0 < rewards[3] < rewards[2] < 0.1  # no letter: closeness of the bytes to the answer's letters
    assert len(set(rewards)) == 5
    assert color_reward(["blue"], answer=["blue"]) == [1.0]  # plain-text completions too


def _frozen_by_design(family: str, name: str) -> bool:
    """LLaVA-NeXT reads the tower's next-to-last layer (vision_feature_layer=-2): its last layer and final norm get no
    gradient (as TRL's test of the real tiny model expects)."""
    return family == "llava_next" and ("encoder.layers.1." in name or "post_layernorm" in name)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_trl_grpo_trains_each_family_and_its_vision_tower(vlm_dirs, family, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, learning_rate=0.05, report_to="none", use_cpu=True,
                      logging_steps=1, save_strategy="no", seed=0)
    # no processing_class: TRL loads it with AutoProcessor.from_pretrained(model path)
    trainer = GRPOTrainer(model=vlm_dirs[family], reward_funcs=color_reward, args=args,
                          train_dataset=toy_vlm_dataset(8))
    vision = vision_parameter_names(trainer.model)
    before = {n: trainer.model.get_parameter(n).detach().clone() for n in vision}
    trainer.train()
    assert trainer.state.global_step == 2
    # rewards differ within the groups of an untrained model: the loss has a gradient
    assert any(log.get("reward_std", 0) > 0 for log in trainer.state.log_history)
    changed = {n for n in vision if not torch.equal(before[n], trainer.model.get_parameter(n))}
    expected = {n for n in vision if not _frozen_by_design(family, n)}
    assert changed == expected, sorted(expected ^ changed)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_trl_grpo_trains_on_multi_image_prompts(vlm_dirs, family, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, learning_rate=0.05, report_to="none", use_cpu=True,
                      save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=vlm_dirs[family], reward_funcs=color_reward, args=args,
                          train_dataset=toy_vlm_dataset(4, images_per_prompt=2))
    trainer.train()
    assert trainer.state.global_step == 1
