"""2-process runs of the trainers that accept one sample per prompt (REINFORCE++ and ReMax with `num_generations=1`,
their papers' setting), launched by tests/test_multiprocess.py with `accelerate launch --multi_gpu --num_processes 2`.

Usage: one_sample_2proc.py MODEL_DIR OUT_DIR

3 prompts per process and micro-batch (an odd count), and `steps_per_generation=2` without accumulation: each
generation batch feeds two optimizer steps, so the token count that normalises each step
(`token_level_normalizer="optimizer_step"`) is summed across the processes. 4 optimizer
steps, then an evaluation. Each rank writes OUT_DIR/{algo}_rank{r}.json with every micro-batch's local loss tokens and
the `num_items_in_batch` it trained with, what `compute_advantages` saw and returned (ReMax: with its greedy
baselines), the log history and its final weights.
"""

import json
import os

from _common import main_then_finish, model_and_out_dirs, toy_args, weight_sums

from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from trl_ppo_variants.trainers.remax import ReMaxConfig, ReMaxTrainer


def recording(trainer_cls):
    class Recording(trainer_cls):
        def compute_advantages(self, rewards, batch, group_size):
            greedy = getattr(self, "_greedy_rewards", None)
            baseline = self.total_rewards(greedy).tolist() if greedy is not None else None
            advantages = super().compute_advantages(rewards, batch, group_size)
            self.records.append({"training": self.model.training, "group_size": group_size,
                                 "rewards": rewards.tolist(), "baseline": baseline,
                                 "advantages": advantages.tolist()})
            return advantages

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                self.micro_batches.append({"step": self._step, "tokens": int(inputs["completion_mask"].sum()),
                                           "num_items_in_batch": float(inputs["num_items_in_batch"])})
            return inputs

    return Recording


def run(name, trainer_cls, config_cls, model_dir, out_dir, **overrides):
    args = toy_args(
        config_cls, out_dir, output_dir=os.path.join(out_dir, name), per_device_train_batch_size=3,
        per_device_eval_batch_size=3, num_generations=1, steps_per_generation=2, max_steps=4, temperature=1.5,
        eval_strategy="steps", eval_steps=4, **overrides,
    )
    trainer = recording(trainer_cls)(model_dir, addition_reward, args=args, train_dataset=addition_dataset(256),
                                     eval_dataset=addition_dataset(6, seed=1))
    trainer.records, trainer.micro_batches = [], []
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
        json.dump({
            "world_size": trainer.accelerator.num_processes, "global_step": trainer.state.global_step,
            "records": trainer.records, "micro_batches": trainer.micro_batches,
            "log_history": trainer.state.log_history,
            "weights": weight_sums(trainer),
        }, f)
    trainer.accelerator.wait_for_everyone()


def main():
    model_dir, out_dir = model_and_out_dirs()
    run("reinforce_pp", ReinforcePPTrainer, ReinforcePPConfig, model_dir, out_dir, beta=None, kl_in_reward_coef=0.05)
    run("remax", ReMaxTrainer, ReMaxConfig, model_dir, out_dir)
    print("ONE-SAMPLE-2PROC-OK", flush=True)


if __name__ == "__main__":
    main_then_finish(main)
