"""2-process runs of the trainers that accept one sample per prompt (REINFORCE++ and ReMax with `num_generations=1`,
their papers' setting), launched by tests/test_multiprocess.py with `accelerate launch --multi_gpu --num_processes 2`.

Usage: one_sample_two_process.py MODEL_DIR OUT_DIR

3 prompts per process and micro-batch (an odd count), and `steps_per_generation=2` without accumulation: each
generation batch feeds two optimizer steps, so the token count that normalises each step
(`token_level_normalizer="optimizer_step"`) is summed across the processes. 4 optimizer
steps, then an evaluation. Each rank writes OUT_DIR/{algo}_rank{r}.json with every micro-batch's local loss tokens and
the `num_items_in_batch` it trained with, what `compute_advantages` saw and returned (ReMax: with its greedy
baselines), the log history and its final weights.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

from trl_ppo_variants.toy import addition_dataset, addition_reward  # noqa: E402
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer  # noqa: E402
from trl_ppo_variants.trainers.remax import ReMaxConfig, ReMaxTrainer  # noqa: E402


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
    args = config_cls(
        output_dir=os.path.join(out_dir, name), per_device_train_batch_size=3, per_device_eval_batch_size=3,
        num_generations=1, steps_per_generation=2, max_completion_length=4, max_steps=4, learning_rate=1e-3,
        temperature=1.5, logging_steps=1, eval_strategy="steps", eval_steps=4, report_to=[], seed=0,
        save_strategy="no", disable_tqdm=True, use_cpu=True, **overrides,
    )
    trainer = recording(trainer_cls)(model_dir, addition_reward, args=args, train_dataset=addition_dataset(256),
                                     eval_dataset=addition_dataset(6, seed=1))
    trainer.records, trainer.micro_batches = [], []
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
        json.dump({
            "world_size": trainer.accelerator.num_processes, "global_step": trainer.state.global_step,
            "records": trainer.records, "micro_batches": trainer.micro_batches,
            "log_history": trainer.state.log_history,
            "weights": [round(p.detach().double().sum().item(), 10) for p in model.parameters()],
        }, f)
    trainer.accelerator.wait_for_everyone()


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    run("reinforce_pp", ReinforcePPTrainer, ReinforcePPConfig, model_dir, out_dir, kl_in_reward_coef=0.05)
    run("remax", ReMaxTrainer, ReMaxConfig, model_dir, out_dir)
    print("ONE-SAMPLE-OK", flush=True)


if __name__ == "__main__":
    main()
    from trl_ppo_variants.distributed import finish

    finish(0)  # exit status 0 once every process is done, never a crash in interpreter teardown
