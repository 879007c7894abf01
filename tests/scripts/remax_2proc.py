"""2-process ReMax run with groups split across ranks (per-device batch 6, G = 4: the middle group straddles the ranks).

Usage: accelerate launch --multi_gpu --num_processes 2 ... remax_2proc.py MODEL_DIR OUT_DIR
Each rank writes OUT_DIR/rank{r}.json: per step the baseline ReMax used, the baseline recomputed in one process
(greedy `generate` of every group's prompt with the same weights, scored by the same reward), the advantages and
the expected `r - b_p`, and a fingerprint of the final weights.
"""

import json
import os

import torch
from _common import SPLIT_GROUPS, main_then_finish, model_and_out_dirs, toy_args, weight_sums
from accelerate.utils import gather_object
from transformers import AutoTokenizer

from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.remax import ReMaxConfig, ReMaxTrainer


class Probe(ReMaxTrainer):
    records = []

    def _generate_and_score_completions(self, inputs):
        self._all_inputs = gather_object([dict(x) for x in inputs])
        return super()._generate_and_score_completions(inputs)

    def compute_advantages(self, rewards, batch, group_size):
        baseline = self.total_rewards(self._greedy_rewards)
        advantages = super().compute_advantages(rewards, batch, group_size)
        groups = self._all_inputs[::group_size]
        tok = self.processing_class
        enc = tok([g["prompt"] for g in groups], return_tensors="pt", padding=True, padding_side="left")
        model = self.accelerator.unwrap_model(self.model)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=self.max_completion_length,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        expected = torch.tensor(addition_reward(texts, [g["answer"] for g in groups]))
        self.records.append({
            "num_groups": len(groups),
            "baseline": baseline.tolist(),
            "expected_baseline": expected.tolist(),
            "advantages": advantages.tolist(),
            "expected_advantages": (rewards - expected.repeat_interleave(group_size)).tolist(),
        })
        return advantages


def main():
    model_dir, out_dir = model_and_out_dirs()
    args = toy_args(ReMaxConfig, out_dir, **SPLIT_GROUPS, temperature=1.5)
    trainer = Probe(model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0),
                    processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": trainer.state.global_step, "records": Probe.records, "weights": weight_sums(trainer)}, f)


if __name__ == "__main__":
    main_then_finish(main)
