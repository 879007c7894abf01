"""Train RLOO on the toy task with a checkpoint every `--save-steps`; used by tests/test_faults.py.

With `RELIABILITY_SLOW_SAVE_AT=<step>` in the environment, the save of that step stalls after the model weights are
written and before the optimizer, RNG and trainer state (a hook of this script, not of the library): the script
writes `<output_dir>/SAVING` and sleeps, so that the test can SIGKILL it mid-checkpoint.
"""

import argparse
import os
import time

from _common import toy_args

from trl_ppo_variants import RLOOConfig, RLOOTrainer
from trl_ppo_variants.toy import addition_dataset, addition_reward


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=2)
    ns = parser.parse_args()

    class SlowSaveRLOOTrainer(RLOOTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            stall_at = os.environ.get("RELIABILITY_SLOW_SAVE_AT")
            if stall_at is not None and self.state.global_step == int(stall_at):
                with open(os.path.join(ns.output_dir, "SAVING"), "w") as f:
                    f.write(output_dir)
                time.sleep(600)
            super()._save_optimizer_and_scheduler(output_dir)

    import pathlib

    args = toy_args(RLOOConfig, pathlib.Path(ns.output_dir), output_dir=ns.output_dir, max_steps=ns.max_steps,
                    save_strategy="steps", save_steps=ns.save_steps, steps_per_generation=2)
    trainer = SlowSaveRLOOTrainer(ns.model, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0))
    trainer.train()


if __name__ == "__main__":
    main()
