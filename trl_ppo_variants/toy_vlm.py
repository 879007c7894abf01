"""Tiny vision-language models built fully offline, and a colour-naming data set and reward to train them on.

    from trl_ppo_variants.toy_vlm import make_tiny_vlm, toy_vlm_dataset, color_reward
    path = make_tiny_vlm("/tmp/tiny-qwen2vl", "qwen2_vl")          # model + processor saved there
    trainer = GRPOTrainer(model=path, reward_funcs=color_reward, train_dataset=toy_vlm_dataset(16), args=...)

Every family (`VLM_FAMILIES`) is a random model of the real architecture (hidden size 32, 2 text layers, a 2-layer
vision tower, 32x32 images in 8x8 patches: 4 image tokens an image), fp32, with a byte-level tokenizer (one token per
byte, no merges) that carries the family's special tokens and the chat template TRL ships for it
(`trl/chat_templates/*.jinja`, read at build time). Nothing is downloaded and torchvision is not needed: the image
processors are the PIL ones.

`VLLM_FAMILY` (Idefics3: SigLIP-style tower, Llama text model with a tied head, hidden size 64 and head size 32) is
the one vLLM's CPU build serves without torchvision (tests/test_vllm.py trains every trainer on it under the engine).

Qwen2-VL / Qwen2.5-VL: transformers' `Qwen2VLProcessor` needs a video processor, which without torchvision cannot be
built. `ToyQwen2VLProcessor` / `ToyQwen2_5_VLProcessor` are image-only subclasses; importing this module registers them
with `AutoProcessor`, so `AutoProcessor.from_pretrained(path)` (what TRL does when no `processing_class` is passed)
loads them in any process that imported `trl_ppo_variants.toy_vlm` first. `load_tiny_vlm_processor(path)` does both.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

VLM_FAMILIES = ("gemma3", "qwen2_vl", "qwen2_5_vl")
#: further families `build_tiny_vlm` builds (TRL's suite tests them; not in `VLM_FAMILIES`, which every trainer's tests
#: cover): LLaVA-NeXT (CLIP tower, Mistral text model, any-resolution tiles), Qwen3.5 and Qwen3.5-MoE (linear
#: attention; image-only `Qwen3VLProcessor`)
EXTRA_FAMILIES = ("llava_next", "qwen3_5", "qwen3_5_moe")

#: image side in pixels, and the vision towers' patch side: (32 / 8)^2 = 16 patches an image
IMAGE_SIZE = 32
PATCH_SIZE = 8

#: colour name -> RGB (names are short and distinct, so `color_reward` can grade partial spellings)
COLORS = {
    "red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (235, 220, 40),
    "purple": (130, 40, 170), "orange": (240, 140, 20), "black": (10, 10, 10), "white": (245, 245, 245),
}


# ---------------------------------------------------------------------------------------------------------- tokenizer
def trl_chat_template(name: str) -> str:
    """The text of `trl/chat_templates/<name>.jinja` of the installed TRL."""
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"chat template {name!r}: the installed TRL has no {path.name}")
    return path.read_text(encoding="utf-8")


def template_tokens(template: str) -> tuple[list[str], list[str]]:
    """The tokens a chat template writes: (`<|...|>` tokens, special in the real tokenizers; other `<tag>` and
    `</tag>` tokens such as `<think>` or `<tool_call>`, ordinary added tokens there), each in order of appearance."""
    special = list(dict.fromkeys(re.findall(r"<\|[^|<>\s]+\|>", template)))
    plain = list(dict.fromkeys(t for t in re.findall(r"</?[A-Za-z_][A-Za-z0-9_]*>", template) if t not in special))
    return special, plain


def byte_level_tokenizer(template: str, *, bos: str | None = None, eos: str, pad: str, special=(), plain=(),
                         named: dict | None = None):
    """A `PreTrainedTokenizerFast` with one token per byte (256 ids, no merges) plus added tokens, and `template`.

    special: added special tokens (never split, skipped by `decode(skip_special_tokens=True)`); bos/eos/pad are added
    too. plain: added ordinary tokens (one id each, kept when decoding). named: attribute name -> token, e.g.
    {"image_token": "<|image_pad|>"}, for processors that read `tokenizer.image_token` / `tokenizer.image_token_id`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    roles = {f"{k}_token": v for k, v in (("bos", bos), ("eos", eos), ("pad", pad)) if v is not None}
    named = dict(named or {})
    extra = [t for t in dict.fromkeys([*special, *named.values()]) if t not in roles.values()]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
    fast.add_special_tokens({"extra_special_tokens": extra})
    fast.add_tokens([t for t in plain if t not in extra and t not in roles.values()])
    if named:
        # model-specific named tokens (`tokenizer.boi_token`, `.image_token_id`): saved in tokenizer_config.json and
        # restored by from_pretrained
        fast._set_model_specific_special_tokens(special_tokens=named)
    fast.chat_template = template
    return fast


# ---------------------------------------------------------------------------------------------------------- processors
def _qwen_image_only(base):
    """An image-only subclass of a Qwen2-VL-style processor: its `__init__` takes no video processor, so
    `ProcessorMixin` neither requires nor saves one (the base class cannot be built without torchvision)."""

    class ImageOnly(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError(f"videos: {type(self).__name__} is image-only (no video processor without "
                                 "torchvision); expected None")
            return super().__call__(images=images, text=text, **kwargs)

        @property
        def model_input_names(self):
            names = list(self.tokenizer.model_input_names) + list(self.image_processor.model_input_names)
            return list(dict.fromkeys(names + ["mm_token_type_ids"]))

    return ImageOnly


def _register_processors() -> dict:
    from transformers import AutoProcessor, PretrainedConfig
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    classes = {}
    for name, base in (("ToyQwen2VLProcessor", Qwen2VLProcessor), ("ToyQwen2_5_VLProcessor", Qwen2_5_VLProcessor),
                       ("ToyQwen3VLProcessor", Qwen3VLProcessor)):
        cls = _qwen_image_only(base)
        cls.__name__ = cls.__qualname__ = name
        cls.__module__ = __name__

        # AutoProcessor resolves `"processor_class": name` (processor_config.json) among registered processors by
        # name; it registers against a config class, so each gets a private one that no model uses
        class Key(PretrainedConfig):
            model_type = f"toy_vlm_{name.lower()}"

        AutoProcessor.register(Key, cls, exist_ok=True)
        classes[name] = cls
    return classes


def _register_idefics3_image_processor() -> None:
    """transformers 5.17 (vLLM's CPU build pins < 5.18) marks `Idefics3ImageProcessorPil` as needing torchvision (its
    module's docstrings name `TorchvisionBackend`, which its import-structure scan reads as a dependency), so
    `AutoProcessor` finds no Idefics3 image processor without torchvision. Registered classes are looked up by name
    first; registering against transformers' own config is skipped, hence a private config class as the key."""
    from transformers import PretrainedConfig
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # the top-level name is a stub
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    class Key(PretrainedConfig):
        model_type = "toy_vlm_idefics3_image_processor"

    AutoImageProcessor.register(Key, image_processor_classes={"pil": Idefics3ImageProcessorPil}, exist_ok=True)


_PROCESSORS = _register_processors()
_register_idefics3_image_processor()
ToyQwen2VLProcessor = _PROCESSORS["ToyQwen2VLProcessor"]
ToyQwen2_5_VLProcessor = _PROCESSORS["ToyQwen2_5_VLProcessor"]
ToyQwen3VLProcessor = _PROCESSORS["ToyQwen3VLProcessor"]


def load_tiny_vlm_processor(path):
    """The processor saved by `make_tiny_vlm` (AutoProcessor, with this module's processors registered)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path))


# ---------------------------------------------------------------------------------------------------------- models
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=512)


def init_tiny_weights(model, seed: int) -> None:
    """Xavier-uniform linear and conv weights and zero-initialised weight matrices, N(0, 0.02) embeddings, zero
    biases: finite logits that visibly depend on the image."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
    for param in model.parameters():
        # bare weight matrices that start at zero (Gemma3's `mm_input_projection_weight`) would cut the image out
        if param.dim() == 2 and not param.detach().any():
            nn.init.xavier_uniform_(param)


def _gemma3(family: str):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    boi, eoi, image = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tokenizer = byte_level_tokenizer(
        trl_chat_template("gemma3"), bos="<bos>", eos="<eos>", pad="<pad>", special=[boi, eoi, image],
        plain=["<start_of_turn>", "<end_of_turn>"], named={"boi_token": boi, "eoi_token": eoi, "image_token": image})
    tokens_per_image = 4  # the tower's 4x4 patches average-pooled to 2x2
    config = Gemma3Config(
        text_config=dict(model_type="gemma3_text", vocab_size=len(tokenizer), **_TEXT, query_pre_attn_scalar=16,
                         sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                           vision_use_head=False),  # Gemma3 reads the last hidden state: no pooling head
        mm_tokens_per_image=tokens_per_image, boi_token_index=tokenizer.convert_tokens_to_ids(boi),
        eoi_token_index=tokenizer.convert_tokens_to_ids(eoi), image_token_index=tokenizer.convert_tokens_to_ids(image))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template, image_seq_length=tokens_per_image)
    model = Gemma3ForConditionalGeneration(config)
    return model, processor, [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]


# M-RoPE: a head's rotary frequency pairs split over (time, height, width) positions
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
_QWEN35_TEXT = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    # a quarter of the head rotated, as the real model (0.25): 0.5 of 16 dims = 4 pairs
                    rope_parameters={**_MROPE, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5,
                                     "mrope_interleaved": True})
#: family -> (chat template of trl/chat_templates, config class, model class, processor, vision and text settings)
_QWEN = {
    "qwen2_vl": ("qwen2_5_vl", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "ToyQwen2VLProcessor",
                 dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2), {"rope_parameters": _MROPE}),
    # window attention over 2x2 merged patches in block 0, full attention in block 1 (as the real 7/15/23/31)
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "ToyQwen2_5_VLProcessor",
                   dict(_QWEN_VISION, window_size=2 * PATCH_SIZE * 2, fullatt_block_indexes=[1]),
                   {"rope_parameters": _MROPE}),
    # a linear-attention (gated delta rule) layer and a full-attention layer; the tower's learned positions: a 4x4 grid
    "qwen3_5": ("qwen3_5_nothink", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "ToyQwen3VLProcessor",
                dict(_QWEN_VISION, num_position_embeddings=16), _QWEN35_TEXT),
    "qwen3_5_moe": ("qwen3_5_nothink", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                    "ToyQwen3VLProcessor", dict(_QWEN_VISION, num_position_embeddings=16),
                    dict(_QWEN35_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32)),
}


def _qwen_vl(family: str):
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    template_name, config_cls, model_cls, processor_name, vision, text_extra = _QWEN[family]
    template = trl_chat_template(template_name)
    special, plain = template_tokens(template)
    named = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
             "vision_end_token": "<|vision_end|>"}
    tokenizer = byte_level_tokenizer(template, eos="<|im_end|>", pad="<|endoftext|>", special=special, plain=plain,
                                     named=named)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in named.items()}
    text = dict(vocab_size=len(tokenizer), **_TEXT, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **text_extra)
    vision = dict(vision, patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2)
    config = getattr(transformers, config_cls)(
        text_config=text, vision_config=vision, image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    pixels = IMAGE_SIZE * IMAGE_SIZE  # every image resized to about 32x32: 16 patches, 4 tokens after the 2x2 merge
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels},
                                               patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2)
    processor = _PROCESSORS[processor_name](image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=tokenizer.chat_template)
    model = getattr(transformers, model_cls)(config)
    return model, processor, [tokenizer.eos_token_id]


def _llava_next(family: str):
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = byte_level_tokenizer(trl_chat_template("llava_next"), bos="<s>", eos="</s>", pad="<pad>",
                                     special=["<image>"], named={"image_token": "<image>"})
    # any-resolution: a 32x32 base view plus the tiles of the best of these grids (a 32-64 pixel image: 1 or 2 tiles)
    grids = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]
    config = LlavaNextConfig(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), **_TEXT, sliding_window=None,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_grid_pinpoints=grids,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                 image_grid_pinpoints=grids)
    # the CLIP tower's class token is counted, then dropped by the "default" feature selection
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                   vision_feature_select_strategy="default", chat_template=tokenizer.chat_template,
                                   num_additional_image_tokens=1)
    return LlavaNextForConditionalGeneration(config), processor, [tokenizer.eos_token_id]


#: the family vLLM's CPU build runs (`make_tiny_vlm(path, VLLM_FAMILY)`): vLLM 0.31's Gemma3, LLaVA(-NeXT), Pixtral and
#: Qwen2(.5)-VL model code imports transformers' torchvision image processors, which do not load without torchvision
#: (whose wheels do not load with the CPU torch); its Idefics3 imports none
VLLM_FAMILY = "idefics3"
#: the text model at vLLM's CPU attention's smallest head size (32; the toy's 16 is refused)
_VLLM_TEXT = dict(_TEXT, hidden_size=64, intermediate_size=128, head_dim=32)


def _idefics3(family: str):
    """Idefics3 (SigLIP-style tower, pixel-shuffle connector, Llama text model) with a tied LM head, at vLLM's CPU
    head size. No image splitting: a 32x32 image is one frame of 16 patches, 4 tokens after the 2x2 pixel shuffle,
    wrapped as `<fake_token_around_image><global-img><image>x4<fake_token_around_image>`."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    fake, image, end = "<fake_token_around_image>", "<image>", "<end_of_utterance>"
    tokenizer = byte_level_tokenizer(trl_chat_template("idefics3"), bos="<|begin_of_text|>", eos=end, pad="<pad>",
                                     special=[fake, image, "<global-img>"], named={"image_token": image})
    scale = 2
    tokens_per_image = (IMAGE_SIZE // PATCH_SIZE) ** 2 // scale**2
    text = {k: v for k, v in _VLLM_TEXT.items() if k != "head_dim"}  # Llama: hidden / heads
    config = Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), **text, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE),  # one head of 32
        scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids(image), tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id)
    side = {"longest_edge": IMAGE_SIZE}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(do_image_splitting=False, size=side, max_image_size=side),
        tokenizer=tokenizer, image_seq_len=tokens_per_image, chat_template=tokenizer.chat_template)
    return Idefics3ForConditionalGeneration(config), processor, [tokenizer.eos_token_id]


def build_tiny_vlm(family: str, seed: int = 0, dtype: str = "float32"):
    """(model, processor) of `family` (one of `VLM_FAMILIES`, `EXTRA_FAMILIES` or `VLLM_FAMILY`), random weights from
    `seed`, in `dtype`."""
    import torch
    from transformers import GenerationConfig

    builders = {"gemma3": _gemma3, "llava_next": _llava_next, **dict.fromkeys(_QWEN, _qwen_vl),
                VLLM_FAMILY: _idefics3}
    if family not in builders:
        raise ValueError(f"family: expected one of {VLM_FAMILIES + EXTRA_FAMILIES + (VLLM_FAMILY,)}, got {family!r}")
    model, processor, eos = builders[family](family)
    init_tiny_weights(model, seed)
    tokenizer = processor.tokenizer
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    return model.to(getattr(torch, dtype)), processor


def make_tiny_vlm(out_dir: str, family: str, seed: int = 0, dtype: str = "float32") -> str:
    """Build a tiny `family` model with its processor and save both to `out_dir` (created); return `out_dir`."""
    model, processor = build_tiny_vlm(family, seed, dtype)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return str(out_dir)


# ---------------------------------------------------------------------------------------------------------- data
def color_images(n: int, size: int = IMAGE_SIZE, seed: int = 0) -> tuple[list, list[str]]:
    """`n` RGB PIL images of `size`x`size` and their colour names: each a named colour, solid or with stripes of a
    darker shade (pattern and stripe width drawn per image), so that images differ even when their colours repeat."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    images, names = [], []
    for _ in range(n):
        name = rng.choice(list(COLORS))
        rgb = COLORS[name]
        image = Image.new("RGB", (size, size), rgb)
        width = rng.choice([0, 2, 4, 8])  # 0: solid
        if width:
            dark = tuple(c * 3 // 5 for c in rgb)
            draw = ImageDraw.Draw(image)
            vertical = rng.random() < 0.5
            for start in range(0, size, 2 * width):
                box = (start, 0, start + width - 1, size) if vertical else (0, start, size, start + width - 1)
                draw.rectangle(box, fill=dark)
        images.append(image)
        names.append(name)
    return images, names


def toy_vlm_dataset(n: int = 16, images_per_prompt: int = 1, seed: int = 0):
    """`n` conversational prompts in TRL's vision-language format: `prompt` (a user message whose content is
    `images_per_prompt` {"type": "image"} parts and a question), `image` (one PIL image, when `images_per_prompt` is 1)
    or `images` (a list), and `answer`: the colour of the (first) image."""
    from datasets import Dataset

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    if not isinstance(images_per_prompt, int) or images_per_prompt < 1:
        raise ValueError(f"images_per_prompt: expected an integer >= 1, got {images_per_prompt!r}")
    images, names = color_images(n * images_per_prompt, seed=seed)
    question = "What colour is the image?" if images_per_prompt == 1 else "What colour is the first image?"
    parts = [{"type": "image"}] * images_per_prompt + [{"type": "text", "text": question}]
    rows = {"prompt": [[{"role": "user", "content": parts}] for _ in range(n)],
            "answer": names[::images_per_prompt]}
    if images_per_prompt == 1:
        rows["image"] = images
    else:
        rows["images"] = [images[i:i + images_per_prompt] for i in range(0, len(images), images_per_prompt)]
    return Dataset.from_dict(rows)


def toy_vlm_mixed_dataset(n: int = 16, image_every: int = 4, seed: int = 0):
    """`toy_vlm_dataset(n)` in which only every `image_every`-th prompt (0, `image_every`, ...) asks about its image;
    the others ask "Name a colour." about none. TRL's `images` column (a list per prompt, empty for a prompt without
    an image), and `answer` as in `toy_vlm_dataset`. Unshuffled (`shuffle_dataset=False`), every generation batch of
    `image_every` prompts holds exactly one prompt with an image."""
    if not isinstance(image_every, int) or image_every < 1:
        raise ValueError(f"image_every: expected an integer >= 1, got {image_every!r}")
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]

    def mix(row, i):
        with_image = i % image_every == 0
        return {"prompt": row["prompt"] if with_image else text_only, "images": [row["image"]] if with_image else []}

    return toy_vlm_dataset(n, seed=seed).map(mix, with_indices=True, remove_columns=["image"])


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] if isinstance(m["content"], str) else "" for m in completion)


def color_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion names the answer's colour, else a graded partial score in [0, 0.5): half the fraction
    of the answer's letters the completion contains, plus a small closeness of its characters to those letters
    (1 - byte distance / 256, averaged). The closeness term makes completions of an untrained model (random bytes)
    score differently, so a group's advantages are not all zero."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = _text(completion).lower()
        if gold in text:
            rewards.append(1.0)
            continue
        if not text:
            rewards.append(0.0)
            continue
        letters = set(gold)
        present = sum(ch in text for ch in letters) / len(letters)
        close = sum(max(0.0, 1 - min(abs(ord(c) - ord(g)) for g in letters) / 256) for c in text) / len(text)
        rewards.append(0.4 * present + 0.099 * close)
    return rewards


def vision_parameter_names(model) -> list[str]:
    """Names of the vision tower's parameters (`model.visual.*` for Qwen, `model.vision_tower.*` for Gemma3)."""
    return [n for n, _ in model.named_parameters() if re.search(r"(^|\.)(visual|vision_tower)\.", n)]


__all__ = ["VLM_FAMILIES", "EXTRA_FAMILIES", "VLLM_FAMILY", "make_tiny_vlm", "build_tiny_vlm", "load_tiny_vlm_processor",
           "color_images", "toy_vlm_dataset", "toy_vlm_mixed_dataset",
           "color_reward", "byte_level_tokenizer", "trl_chat_template", "vision_parameter_names",
           "ToyQwen2VLProcessor", "ToyQwen2_5_VLProcessor", "ToyQwen3VLProcessor", "template_tokens"]
