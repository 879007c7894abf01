"""2-process TTRL run with vote groups split across ranks (per-device batch 6, n_votes = 4: the middle group of every
generation batch straddles the ranks), training on n_train = 2 of the 4 votes.

Usage: accelerate launch --multi_gpu --num_processes 2 ... ttrl_2proc.py MODEL_DIR OUT_DIR
Each rank writes OUT_DIR/rank{r}.json: per generation, the gathered completions (process order), this rank's local
completions, the vote column of the reward table the trainer used, the rows this rank trains on, and a fingerprint
of the final weights. The test recomputes the rewards in one process from the completions.
"""

import json
import os

from _common import main_then_finish, model_and_out_dirs, toy_args, weight_sums
from accelerate.utils import gather_object

from trl_ppo_variants.toy import addition_dataset
from trl_ppo_variants.trainers.ttrl import TTRLConfig, TTRLTrainer


class Probe(TTRLTrainer):
    records = []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.records.append({
            "local_completions": list(completions),
            "completions": gather_object(list(completions)),
            "prompts": gather_object(list(prompts)),
            "vote_rewards": rewards_per_func[:, 0].tolist(),
            "labels": self._vote_state["labels"],
        })
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.records[-1]["local_rows"] = int(output["prompt_ids"].shape[0])
        self.records[-1]["local_advantages"] = output["advantages"].tolist()
        return output


def main():
    model_dir, out_dir = model_and_out_dirs()
    args = toy_args(TTRLConfig, out_dir, per_device_train_batch_size=6, n_votes=4, n_train=2, train_subset="random",
                    answer_extractor="last_number", max_steps=3, temperature=2.0)
    trainer = Probe(model_dir, args=args, train_dataset=addition_dataset(64, seed=0))
    trainer.train()
    rank = trainer.accelerator.process_index
    logs = [h for h in trainer.state.log_history if "ttrl/votes/majority_ratio" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"records": trainer.records, "fingerprint": weight_sums(trainer), "logs": logs}, f)


if __name__ == "__main__":
    main_then_finish(main)
