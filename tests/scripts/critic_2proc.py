"""2-process VAPO run with the critic attached to the policy (DDP, DeepSpeed ZeRO-2 or ZeRO-3: the launcher decides).

Usage: accelerate launch [--config_file tests/configs/critic_zero{2,3}.yaml | --multi_gpu] --num_processes 2 ...
       critic_2proc.py MODEL_DIR OUT_DIR [full | lora | lora-reference | lora-peft]

The critic: "full" (default), or a LoRA critic over a frozen copy ("lora": VAPO has no KL, so no reference model), over
the reference model's weights ("lora-reference": a KL in the reward loads one) or as a second adapter of a LoRA policy
("lora-peft").

3 optimizer steps, the first one value pre-training (weight decay on, to check that the frozen policy does not decay);
the number of optimizer-state entries dropped when pre-training ends is recorded (ZeRO keys them by flat partitions).
Each rank writes OUT_DIR/rank{r}.json with, per step, a fingerprint of the policy's and of the critic's full weights
(ZeRO-3 parameters gathered first), the logged losses, and the files of the exported model (rank 0 exports).
"""

import hashlib
import json
import os
import sys

from _common import main_then_finish, model_and_out_dirs, toy_args
from transformers import TrainerCallback

from trl_ppo_variants.critic import is_critic_key
from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.vapo import VAPOConfig, VAPOTrainer


def fingerprints(trainer) -> dict:
    """sha256 of the policy's and of the critic's parameters (full tensors, on every rank)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = list(model.named_parameters())
    gather = None
    if trainer.is_deepspeed_enabled and any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([p for _, p in params])
    digests = {"policy": hashlib.sha256(), "critic": hashlib.sha256()}
    if gather is not None:
        gather.__enter__()
    try:
        for name, param in params:
            part = "critic" if is_critic_key(name) else "policy"
            digests[part].update(param.detach().float().cpu().numpy().tobytes())
    finally:
        if gather is not None:
            gather.__exit__(None, None, None)
    out = {k: v.hexdigest() for k, v in digests.items()}
    ref = trainer.ref_model
    if ref is not None and not any(hasattr(p, "ds_id") for p in ref.parameters()):  # the reference must never move
        digest = hashlib.sha256()
        for param in ref.parameters():
            digest.update(param.detach().float().cpu().numpy().tobytes())
        out["reference"] = digest.hexdigest()
    return out


class Record(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.steps = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append({"step": 0, **fingerprints(self.trainer)})

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, **fingerprints(self.trainer)})


def main():
    model_dir, out_dir = model_and_out_dirs()
    critic = sys.argv[3] if len(sys.argv) > 3 else "full"
    extra, kwargs = {}, {}
    if critic != "full":
        extra["critic_backbone"] = "lora"
    if critic == "lora-reference":
        extra["kl_in_reward_coef"] = 0.05
    if critic == "lora-peft":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = toy_args(VAPOConfig, out_dir, per_device_train_batch_size=4, max_steps=3, critic_learning_rate=1e-3,
                    weight_decay=0.1, value_pretrain_steps=1, length_adaptive_alpha=1.0, save_strategy="steps",
                    save_steps=3, temperature=1.0, **extra)
    record = Record()
    trainer = VAPOTrainer(model_dir, addition_reward, args=args, train_dataset=addition_dataset(64),
                          callbacks=[record], **kwargs)
    record.trainer = trainer
    resets = []
    reset = trainer._reset_policy_optimizer_state
    trainer._reset_policy_optimizer_state = lambda: resets.append(reset()) or resets[-1]
    trainer.train()
    export = os.path.join(out_dir, "export")
    trainer.save_model(export)
    trainer.accelerator.wait_for_everyone()
    rank = trainer.accelerator.process_index
    logs = [{k: v for k, v in h.items() if k in ("loss", "value/loss", "value/explained_variance", "grad_norm",
                                                 "value_pretraining", "positive/nll", "learning_rate",
                                                 "value/learning_rate")}
            for h in trainer.state.log_history if "loss" in h]
    checkpoint = os.path.join(args.output_dir, "checkpoint-3")
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "deepspeed_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
        if trainer.is_deepspeed_enabled else None,
        "global_step": trainer.state.global_step,
        "critic_base": trainer.critic_base,
        "steps": record.steps,
        "policy_state_entries_reset": resets,
        "logs": logs,
        "export_files": sorted(os.listdir(export)) if os.path.isdir(export) else [],
        "value_model_files": sorted(os.listdir(os.path.join(export, "value_model")))
        if os.path.isdir(os.path.join(export, "value_model")) else [],
        "checkpoint_files": sorted(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else [],
    }
    if rank == 0:
        from safetensors import safe_open

        def keys(path):
            files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
            out = []
            for f in files:
                with safe_open(os.path.join(path, f), "pt") as handle:
                    out.extend(handle.keys())
            return out

        result["export_keys"] = keys(export)
        result["value_model_keys"] = keys(os.path.join(export, "value_model"))
        result["checkpoint_keys"] = keys(checkpoint) if os.path.isdir(checkpoint) and any(
            f.endswith(".safetensors") for f in os.listdir(checkpoint)) else []
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main_then_finish(main)
