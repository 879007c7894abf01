"""One trainer of the package under a real vLLM colocate engine on CPU (vLLM's CPU build; one engine per process).

    python tests/scripts/vllm_colocate.py OUT.json TRAINER {tied,untied} {full,lora}

Builds the vLLM-capable toy model (head_dim 32), measures the engine against the policy's forward before training
(max per-token |log-prob difference| of fixed completions, the engine's own mismatch), trains 2 steps at a large
learning rate with generation by vLLM, syncs the weights once more and measures again; writes the numbers as JSON.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

import torch  # noqa: E402

#: (prompt, completion) pairs of the toy alphabet, scored by teacher forcing on both sides
FIXED = [("3+4=", "7"), ("1+2=", "3"), ("4+4=", "8, 2+2=4")]
TRAINERS = {  # name -> (module, config, trainer, settings); RLOO's KL in the reward reads vLLM's log-probs
    "grpo": ("trl_ppo_variants.trainers.grpo", "GRPOConfig", "GRPOTrainer", {}),
    "rloo": ("trl_ppo_variants.trainers.rloo", "RLOOConfig", "RLOOTrainer", {"beta": 0.05}),
}


def varied_reward(completions, **kwargs):
    """Distinct characters of a completion: varies within every group of the untrained model's samples, so every step
    moves the weights (the warm-started model answers the toy task alike in a group: zero advantages)."""
    return [float(len(set(c if isinstance(c, str) else c[-1]["content"]))) for c in completions]


def engine_vs_policy(trainer, tokenizer) -> float:
    """Max per-token |log p_engine - log p_policy| over `FIXED`: vLLM's prompt log-probs against the policy forward."""
    from vllm import SamplingParams

    worst = 0.0
    for prompt, completion in FIXED:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = p_ids + c_ids
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, len(p_ids) - 1 : -1].float()
        policy = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c_ids)[:, None])[:, 0]
        out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}],
                                                   SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scored = out[0].prompt_logprobs
        engine = torch.tensor([scored[len(p_ids) + i][t].logprob for i, t in enumerate(c_ids)])
        worst = max(worst, (engine - policy).abs().max().item())
    return worst


def main(out_path, name, tie, kind):
    import importlib

    from transformers import AutoTokenizer

    from trl_ppo_variants.toy import addition_dataset, make_toy_checkpoint

    module, config_name, trainer_name, settings = TRAINERS[name]
    mod = importlib.import_module(module)
    model_dir = make_toy_checkpoint(tempfile.mkdtemp(prefix="vllm_toy_"), warm_steps=0, hidden_size=128,
                                    tie_word_embeddings=tie == "tied")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = getattr(mod, config_name)(
        output_dir=tempfile.mkdtemp(prefix="vllm_out_"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=3e-2, logging_steps=1, report_to=[], use_cpu=True,
        bf16=False, seed=0, save_strategy="no", disable_tqdm=True, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05, vllm_max_model_length=64, **settings)
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    trainer = getattr(mod, trainer_name)(model_dir, varied_reward, args=args, train_dataset=addition_dataset(64),
                                         peft_config=peft_config)
    before = engine_vs_policy(trainer, tokenizer)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    moved = max((v.float() - initial[k].float()).abs().max().item() for k, v in trainer.model.state_dict().items())
    trainer.vllm_generation.sync_weights()  # a PEFT policy: TRL merges the adapter for the sync, then unmerges it
    after = engine_vs_policy(trainer, tokenizer)
    kl = [h["kl_in_reward"] for h in trainer.state.log_history if "kl_in_reward" in h]
    result = {"trainer": name, "tie": tie, "kind": kind, "untrained": before, "trained": after,
              "weights_moved": moved, "steps": trainer.state.global_step, "kl_in_reward": kl,
              "engine": type(trainer.vllm_generation).__name__}
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    main(*sys.argv[1:5])
