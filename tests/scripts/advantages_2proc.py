"""2-process runs of REINFORCE++ (token-level advantages, KL in the reward) and RLOO (KL in the reward), launched by
tests/test_multiprocess.py with `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU).

Usage: advantages_2proc.py MODEL_DIR OUT_DIR

G = 4 with 6 rows per process: the 12 rows of a generation batch hold 3 groups and the middle one is split across
the two processes. Each rank writes OUT_DIR/{algo}_rank{r}.pt with, for every generation step, the global rewards,
completion mask, KL-in-reward and advantages its `compute_advantages` saw and the local advantages it trained on,
plus its final weights and the number of optimizer steps. The test compares the ranks and recomputes the advantages.
"""

import os

import torch
from _common import SPLIT_GROUPS, flat_weights, main_then_finish, model_and_out_dirs, toy_args

from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer


def recording(trainer_cls):
    """The trainer with its global-batch inputs and outputs recorded (nothing else changed)."""

    class Recording(trainer_cls):
        def compute_advantages(self, rewards, batch, group_size):
            advantages = super().compute_advantages(rewards, batch, group_size)
            self.records.append({
                "rewards": rewards.clone(),
                "completion_mask": batch["completion_mask"].clone() if batch is not None else None,
                "kl_in_reward": batch["kl_in_reward"].clone() if batch and "kl_in_reward" in batch else None,
                "advantages": advantages.clone(),
                "group_size": group_size,
            })
            return advantages

        def _replace_advantages(self, output, inputs):
            output = super()._replace_advantages(output, inputs)
            self.records[-1]["local_advantages"] = output["advantages"].clone()
            self.records[-1]["local_completion_mask"] = output["completion_mask"].clone()
            return output

    return Recording


def run(name, trainer_cls, config_cls, model_dir, out_dir, **overrides):
    args = toy_args(config_cls, out_dir, output_dir=os.path.join(out_dir, name), **SPLIT_GROUPS, max_steps=3,
                    **overrides)
    trainer = recording(trainer_cls)(model_dir, addition_reward, args=args, train_dataset=addition_dataset(256))
    trainer.records = []
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "world_size": trainer.accelerator.num_processes,
            "global_step": trainer.state.global_step,
            "records": trainer.records,
            "weights": flat_weights(trainer),
        },
        os.path.join(out_dir, f"{name}_rank{rank}.pt"),
    )
    trainer.accelerator.wait_for_everyone()


def main():
    model_dir, out_dir = model_and_out_dirs()
    run("reinforce_pp", ReinforcePPTrainer, ReinforcePPConfig, model_dir, out_dir, beta=None, kl_in_reward_coef=0.05)
    run("rloo", RLOOTrainer, RLOOConfig, model_dir, out_dir, beta=0.05)
    print("ADVANTAGES-2PROC-OK", flush=True)


if __name__ == "__main__":
    main_then_finish(main)
