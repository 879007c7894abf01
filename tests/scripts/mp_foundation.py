"""2-process runs of REINFORCE++ (token-level advantages, KL in the reward) and RLOO (KL in the reward), launched by
tests/test_multiprocess.py with `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU).

Usage: mp_foundation.py MODEL_DIR OUT_DIR

G = 4 with 6 rows per process: the 12 rows of a generation batch hold 3 groups and the middle one is split across
the two processes. Each rank writes OUT_DIR/{algo}_rank{r}.pt with, for every generation step, the global rewards,
completion mask, KL-in-reward and advantages its `compute_advantages` saw and the local advantages it trained on,
plus its final weights and the number of optimizer steps. The test compares the ranks and recomputes the advantages.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

from trl_ppo_variants.toy import addition_dataset, addition_reward  # noqa: E402
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer  # noqa: E402
from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer  # noqa: E402


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
    args = config_cls(
        output_dir=os.path.join(out_dir, name),
        per_device_train_batch_size=6,
        num_generations=4,
        max_completion_length=4,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,  # with the launcher's 2 processes: DDP over gloo on CPU
        **overrides,
    )
    trainer = recording(trainer_cls)(model_dir, addition_reward, args=args, train_dataset=addition_dataset(256))
    trainer.records = []
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "world_size": trainer.accelerator.num_processes,
            "global_step": trainer.state.global_step,
            "records": trainer.records,
            "weights": weights,
        },
        os.path.join(out_dir, f"{name}_rank{rank}.pt"),
    )
    trainer.accelerator.wait_for_everyone()


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    run("reinforce_pp", ReinforcePPTrainer, ReinforcePPConfig, model_dir, out_dir, kl_in_reward_coef=0.05)
    run("rloo", RLOOTrainer, RLOOConfig, model_dir, out_dir, beta=0.05)
    print("MP-FOUNDATION-OK", flush=True)


if __name__ == "__main__":
    main()
    from trl_ppo_variants.distributed import finish

    finish(0)  # exit status 0 once every process is done, never a crash in interpreter teardown
