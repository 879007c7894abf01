"""2-process run of ProcessGRPOTrainer with groups split across ranks, launched by
tests/test_process_grpo.py::test_two_processes_split_groups (`accelerate launch --multi_gpu --num_processes 2`, gloo).

Usage: process_grpo_2proc.py MODEL_DIR OUT_DIR

G = 4 with 6 rows per process: the middle group of the 12 rows straddles the ranks. Each rank writes
OUT_DIR/rank{r}.pt with, for every generation step: the global step rewards and step ends its `compute_advantages`
saw, the same recomputed from every completion (gathered as text and ids) with the public helpers in one place, the
outcome rewards, the mask, the global advantages, the local advantages it trained on and its own number of steps;
plus its final weights.
"""

import math
import os

import torch
from _common import SPLIT_GROUPS, flat_weights, main_then_finish, model_and_out_dirs, toy_args
from accelerate.utils import gather_object

from trl_ppo_variants.process import split_steps, step_end_tokens
from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.process_grpo import ProcessGRPOConfig, ProcessGRPOTrainer

SEP = "1"


def length_steps(completions, **kwargs):
    return [[len(step) - 0.5 * j for j, step in enumerate(split_steps(c, SEP))] for c in completions]


class Recording(ProcessGRPOTrainer):
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        local = [(c, [int(i) for i in ids]) for c, ids in zip(completions, completion_ids_list)]
        self._all_completions = gather_object(local)  # process order: the global row order
        self._local_steps = max(len(split_steps(c, SEP)) for c in completions)
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def compute_advantages(self, rewards, batch, group_size):
        advantages = super().compute_advantages(rewards, batch, group_size)
        def decode(x):
            return self.processing_class.decode(x, skip_special_tokens=True)

        ends = [step_end_tokens(c, ids, decode, SEP) for c, ids in self._all_completions]
        values = length_steps([c for c, _ in self._all_completions])
        width = self.step_batch[0].shape[1]
        expected_rewards = torch.full((len(ends), width), math.nan)
        expected_ends = torch.zeros((len(ends), width), dtype=torch.long)
        for row, (e, v) in enumerate(zip(ends, values)):
            expected_rewards[row, : len(e)] = torch.tensor(v)
            expected_ends[row, : len(e)] = torch.tensor(e)
        self.records.append({
            "rewards": rewards.clone(), "group_size": group_size, "mask": batch["completion_mask"].clone(),
            "step_rewards": self.step_batch[0].clone(), "step_ends": self.step_batch[1].clone(),
            "expected_step_rewards": expected_rewards, "expected_step_ends": expected_ends,
            "advantages": advantages.clone(), "local_steps": self._local_steps,
        })
        return advantages

    def _replace_advantages(self, output, inputs):
        output = super()._replace_advantages(output, inputs)
        self.records[-1]["local_advantages"] = output["advantages"].clone()
        return output


def main():
    model_dir, out_dir = model_and_out_dirs()
    args = toy_args(ProcessGRPOConfig, out_dir, **SPLIT_GROUPS, max_completion_length=8, max_steps=3,
                    temperature=2.0, step_separator=SEP)
    trainer = Recording(model_dir, addition_reward, args=args, train_dataset=addition_dataset(256),
                        step_reward_funcs=[length_steps])
    trainer.records = []
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save({"global_step": trainer.state.global_step, "records": trainer.records,
                "weights": flat_weights(trainer)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main_then_finish(main)
