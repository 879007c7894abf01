"""2-process runs with the sampling log-probs recorded during `generate` (launched by
tests/test_generation.py::test_two_processes_split_groups with `accelerate launch --multi_gpu --num_processes 2`).

Usage: sampling_logps_2proc.py MODEL_DIR OUT_DIR

G = 4 with 6 rows per process: the 12 rows of a generation batch hold 3 groups and the middle one is split across
the two processes. fp32 (`bf16=False`), repetition penalty 1.3, temperature 0.8, up to 8 tokens. For RLOO (beta =
0.05) and REINFORCE++ (KL in the reward 0.05), two steps with `sampling_logps_source="generate"` and two with
`"forward"`, from the same seed. Checks: on each process the recorded log-probs equal a forward pass's to 1e-5 on
every loss token; no policy forward ran for the KL with "generate"; both processes computed the same global
advantages; the first step's completions are the same with both sources and its global advantages equal to 1e-5.
Then RLOO on a tiny GPT-2 (learned positions) with the prompts in order (`shuffle_dataset=False`) and the first
prompt of each step lengthened: only process 0's rows are left-padded, so only process 0 cannot use its recording;
both processes must take the forward pass at both steps, log `sampling_logps/forward_fallback` 1.0, and finish.
Prints "SAMPLING-LOGPS-2PROC-OK" on the main process when every check passed.
"""

import os
import sys

import torch
from _common import SPLIT_GROUPS, main_then_finish, model_and_out_dirs, toy_args
from accelerate.utils import gather_object
from trl import GRPOTrainer

from trl_ppo_variants import rollout
from trl_ppo_variants.toy import addition_dataset, addition_reward, make_learned_position_checkpoint
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer


def probing(trainer_cls):
    class Probe(trainer_cls):
        def _replace_advantages(self, output, inputs):
            sampled = output.get("sampling_per_token_logps")
            if sampled is not None:
                ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
                attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
                with torch.no_grad():
                    forward, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                        self, self.model, ids, attention, output["completion_ids"].shape[1])
                mask = rollout.loss_mask(output).bool()
                self.logp_gaps.append((sampled[mask] - forward[mask]).abs().max().item())
            self.forwards_before = self.policy_forwards
            self.completions.append(output["completion_ids"].clone())
            return super()._replace_advantages(output, inputs)

        def unusable_sampling_logps(self, output):
            reason = super().unusable_sampling_logps(output)
            self.unusable.append(reason)
            return reason

        def compute_advantages(self, rewards, batch, group_size):
            advantages = super().compute_advantages(rewards, batch, group_size)
            self.records.append({"rewards": rewards.clone(), "advantages": advantages.clone(),
                                 "kl_forwards": self.policy_forwards - self.forwards_before})
            return advantages

    return Probe


def run(name, trainer_cls, config_cls, model_dir, out_dir, source, dataset=None, **overrides):
    args = toy_args(
        config_cls, out_dir, output_dir=os.path.join(out_dir, f"{name}_{source}"), **SPLIT_GROUPS,
        max_completion_length=8, bf16=False, repetition_penalty=1.3, temperature=0.8, sampling_logps_source=source,
        **overrides,
    )
    trainer = probing(trainer_cls)(model_dir, addition_reward, args=args,
                                   train_dataset=dataset if dataset is not None else addition_dataset(256))
    trainer.records, trainer.logp_gaps, trainer.completions, trainer.unusable = [], [], [], []
    trainer.policy_forwards = trainer.forwards_before = 0
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, *a, **kw):  # the fallback calls TRL's method directly: count at the class
        if self is trainer and model is not self.ref_model and not torch.is_grad_enabled():
            trainer.policy_forwards += 1
        return original(self, model, *a, **kw)

    GRPOTrainer._get_per_token_logps_and_entropies = counting
    try:
        trainer.train()
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = original
    return trainer


def main():
    model_dir, out_dir = model_and_out_dirs()
    problems = []
    cases = [("rloo", RLOOTrainer, RLOOConfig, {"beta": 0.05}),
             ("reinforce_pp", ReinforcePPTrainer, ReinforcePPConfig, {"beta": None, "kl_in_reward_coef": 0.05})]
    for name, cls, config_cls, overrides in cases:
        fast = run(name, cls, config_cls, model_dir, out_dir, "generate", **overrides)
        slow = run(name, cls, config_cls, model_dir, out_dir, "forward", **overrides)
        rank = fast.accelerator.process_index
        if len(fast.logp_gaps) != 2 or max(fast.logp_gaps) > 1e-5:
            problems.append(f"{name} rank {rank}: recorded vs forward log-probs {fast.logp_gaps}")
        if slow.logp_gaps:
            problems.append(f"{name} rank {rank}: log-probs were recorded with sampling_logps_source='forward'")
        # policy forwards between the rollout and the advantages: the KL's fallback, and only there
        counts = [[r["kl_forwards"] for r in t.records] for t in (fast, slow)]
        if counts != [[0, 0], [1, 1]]:
            problems.append(f"{name} rank {rank}: KL forwards (generate, forward) = {counts}, expected [0, 0], [1, 1]")
        both = gather_object([[r["advantages"].tolist() for r in fast.records]])
        if both[0] != both[1]:
            problems.append(f"{name}: the processes computed different global advantages")
        a, b = fast.records[0], slow.records[0]
        if not torch.equal(fast.completions[0], slow.completions[0]):
            problems.append(f"{name} rank {rank}: step 1 sampled differently with the two sources")
        elif not torch.allclose(a["advantages"], b["advantages"], rtol=0, atol=1e-5):
            gap = (a["advantages"] - b["advantages"]).abs().max().item()
            problems.append(f"{name}: step 1 advantages differ by {gap} between generate and forward")
    problems += learned_positions_on_one_rank(out_dir)
    merged = [p for per_rank in gather_object([problems]) for p in per_rank]
    if merged:
        print("\n".join(merged), flush=True)
        sys.exit(1)
    if int(os.environ.get("RANK", "0")) == 0:
        print("SAMPLING-LOGPS-2PROC-OK", flush=True)


def learned_positions_on_one_rank(out_dir):
    """GPT-2, left padding on process 0 only: one decision (the forward) on both processes."""
    from accelerate import PartialState

    state, model_dir = PartialState(), os.path.join(out_dir, "gpt2")
    rank = state.process_index
    with state.main_process_first():  # written once (transformers saves on the main process only)
        if state.is_main_process:
            make_learned_position_checkpoint(model_dir, seed=0)
    rows = [dict(row) for row in addition_dataset(256)]
    for i in (0, 3):  # 3 prompts x 4 rows a step, 6 rows a process: prompt 0 and 3 are process 0's alone
        rows[i]["prompt"] = "a a " + rows[i]["prompt"]
    from datasets import Dataset

    trainer = run("gpt2", RLOOTrainer, RLOOConfig, model_dir, out_dir, "generate", dataset=Dataset.from_list(rows),
                  beta=0.05, shuffle_dataset=False)
    problems = []
    padded = [reason is not None and "left-padded" in reason for reason in trainer.unusable]
    if padded != [rank == 0] * 2:
        problems.append(f"gpt2 rank {rank}: own recording unusable for padding at steps {padded}, expected "
                        f"{[rank == 0] * 2}")
    if [r["kl_forwards"] for r in trainer.records] != [1, 1]:
        problems.append(f"gpt2 rank {rank}: KL forwards {[r['kl_forwards'] for r in trainer.records]}, expected [1, 1]")
    logged = [h["sampling_logps/forward_fallback"] for h in trainer.state.log_history
              if "sampling_logps/forward_fallback" in h]
    if logged != [1.0, 1.0] or trainer.state.global_step != 2:
        problems.append(f"gpt2 rank {rank}: fallback logged {logged}, {trainer.state.global_step} steps")
    return problems


if __name__ == "__main__":
    main_then_finish(main)
