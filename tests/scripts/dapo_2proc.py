"""2-process DAPO run on the toy task (launched by tests/test_dapo.py with `accelerate launch --num_processes 2`).

--mode uneven: G = 4 with 6 local rows per generation batch (a group always spans the two processes),
  gradient accumulation = steps_per_generation = 2, num_iterations = 2; prompts starting with "0" always score 1, so
  groups are dropped unevenly on the two processes. Checks, at every generation step: equal row counts on both
  processes, a full batch (generation_batch_size // G groups), every group one prompt with a reward spread; that
  some round dropped a different number of rows on the two processes; that some first round was over-sampled from
  the keep-rate estimate (keep_rate_init = 0.6: the dataloader's split groups plus refill prompts in one round); at
  the end, identical weights.
Both modes: every round was sized identically on both processes (groups needed, estimate, prompts) and the
  keep-rate estimators end equal.
--mode exhaust: the reward is constant except on prompts starting with "0" and at most 2 rounds are allowed, so steps
  end exhausted; G = 2, steps_per_generation = 2 on 2 processes: the kept groups are rounded to a multiple of 2.
  Checks: the run finishes, every step has equal row counts, at least one step is exhausted, identical weights.

--mode speed: trl_ppo_variants.GRPOTrainer with prompt_selection="speed+greso" (G = 4, screening 2 completions: a
  round mixes 2-row screenings and 2-row completions), 3 local rows per generation batch, gradient accumulation 2;
  the reward is constant on process 1 (every screening held there alone is rejected; a group may still span both
  processes). Checks, besides the common ones: full batches of whole groups of one prompt with a reward spread,
  every round's decisions (layout, accepted screenings, outcomes) identical on both processes, SPEED's screenings
  completed in a later round of the same step, GRESO's history and exploration probabilities identical, and the run
  does not hang.

Prints "DAPO-2PROC-OK <mode>" on the main process when every check passed.
"""

import argparse
import os
import sys

import torch
from _common import flat_weights, main_then_finish, toy_args
from accelerate.utils import gather_object
from conftest import addition_answer

from trl_ppo_variants import selection
from trl_ppo_variants.toy import addition_dataset, addition_reward
from trl_ppo_variants.trainers.dapo import DAPOConfig, DAPOTrainer
from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer


def zero_prompts_always_right(completions, prompts, answer, **kwargs):
    real = addition_reward(completions, answer)
    return [1.0 if p.startswith("0") else r for r, p in zip(real, prompts)]


def mostly_constant(completions, prompts, answer, **kwargs):
    real = addition_reward(completions, answer)
    return [r if p.startswith("0") else 0.5 for r, p in zip(real, prompts)]


def constant_on_process_1(completions, prompts, answer, **kwargs):
    real = addition_reward(completions, answer)
    return [1.0] * len(real) if int(os.environ.get("RANK", "0")) == 1 else real


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["uneven", "exhaust", "speed"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()

    common = dict(output_dir=os.path.join(opts.out, opts.mode))
    if opts.mode == "uneven":
        G = 4
        args = toy_args(DAPOConfig, opts.out, per_device_train_batch_size=3, num_generations=G,
                        gradient_accumulation_steps=2, num_iterations=2, max_steps=6, max_generation_rounds=8,
                        keep_rate_init=0.6, **common)
        reward = zero_prompts_always_right
    elif opts.mode == "speed":
        G = 4
        args = toy_args(GRPOConfig, opts.out, per_device_train_batch_size=3, num_generations=G,
                        gradient_accumulation_steps=2, max_steps=6, max_generation_rounds=8,
                        prompt_selection="speed+greso", screening_num_generations=2, **common)
        reward = constant_on_process_1
    else:
        G = 2
        args = toy_args(DAPOConfig, opts.out, per_device_train_batch_size=2, num_generations=G,
                        gradient_accumulation_steps=2, max_steps=4, max_generation_rounds=2, refill_num_prompts=1,
                        **common)
        reward = mostly_constant

    # record every round's spread mask (the same global decision on both processes)
    rounds, decisions = [], []
    original_add = selection.GroupAccumulator.add_round

    def add_round(self, rollout, rewards_per_func, filter_values, segments=None, extras=None):
        if all(seg.kind == "group" for seg in segments or []):  # dynamic sampling: whole groups
            rounds.append((filter_values.shape[0], selection.group_spread_mask(filter_values, self.G)))
        result = original_add(self, rollout, rewards_per_func, filter_values, segments, extras)
        decisions.append((self.rounds, [tuple(s) for s in segments or []], result.accepted, result.outcomes))
        return result

    selection.GroupAccumulator.add_round = add_round

    trainer_cls = GRPOTrainer if opts.mode == "speed" else DAPOTrainer
    trainer = trainer_cls(opts.model, reward, args=args, train_dataset=addition_dataset(256, seed=0))
    acc = trainer.accelerator
    tok = trainer.processing_class
    local_gen = args.per_device_train_batch_size * args.steps_per_generation
    steps = []
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        out = original(inputs)
        rows = out["completion_ids"].shape[0]
        counts = gather_object([rows])
        prompts = gather_object(tok.batch_decode(out["prompt_ids"], skip_special_tokens=True))
        completions = gather_object(tok.batch_decode(out["completion_ids"], skip_special_tokens=True))
        advantages = acc.gather(out["advantages"].contiguous())
        steps.append((counts, prompts, completions, advantages.cpu(), int(out["num_items_in_batch"])))
        return out

    trainer._generate_and_score_completions = wrapped
    sizing = []  # (groups needed, keep-rate estimate, prompts) of every round: the same on both processes
    sel = trainer.prompt_selection
    original_size = sel.round_prompts

    def size(needed):
        count = original_size(needed)
        sizing.append((needed, sel.keep_rate, count))
        return count

    sel.round_prompts = size
    trainer.train()

    problems = []
    for i, (counts, prompts, completions, advantages, num_items) in enumerate(steps):
        if len(set(counts)) != 1:
            problems.append(f"step {i}: row counts differ across processes {counts}")
        n = sum(counts)
        if n % G:
            problems.append(f"step {i}: {n} rows is not whole groups")
            continue
        groups = n // G
        for g in range(groups):
            if len(set(prompts[g * G:(g + 1) * G])) != 1:
                problems.append(f"step {i}: group {g} mixes prompts {prompts[g * G:(g + 1) * G]}")
        if opts.mode in ("uneven", "speed"):
            if counts[0] != local_gen:
                problems.append(f"step {i}: {counts[0]} local rows, expected the full {local_gen}")
            if opts.mode == "uneven":  # (speed: the reward depends on the process a row was scored on)
                rewards = torch.tensor(reward(completions, prompts, [addition_answer(p) for p in prompts])).view(-1, G)
                if not (rewards.std(dim=1) > 0).all():
                    problems.append(f"step {i}: a trained group has no reward spread: {rewards.tolist()}")
            if not (advantages.view(-1, G).abs().sum(dim=1) > 0).all():
                problems.append(f"step {i}: a trained group has all-zero advantages")
        if not torch.isfinite(advantages).all():
            problems.append(f"step {i}: non-finite advantages")

    prefix = trainer.selection_metric_prefix
    logs = [h for h in trainer.state.log_history if f"{prefix}/rounds" in h]
    every_sizing = gather_object([sizing])
    if every_sizing[0] != every_sizing[1]:
        problems.append(f"round sizes differ across processes: {every_sizing}")
    states = gather_object([(sel.keep_rate_state, sel.history, sel.p_easy, sel.p_hard)])
    if states[0] != states[1]:
        problems.append(f"selection states (keep rate, GRESO history, exploration) differ across processes")
    every_decision = gather_object([decisions])
    if every_decision[0] != every_decision[1]:
        problems.append("round layouts or decisions differ across processes")
    if opts.mode == "uneven":
        target = args.generation_batch_size // G
        if not any(h["dapo/first_round_prompts"] > target for h in logs):  # 6 rows per process: groups split
            problems.append(f"no first round was over-sampled: {[h['dapo/first_round_prompts'] for h in logs]}")
        uneven = False
        for n, spread in rounds:
            dropped_rows = (~spread).repeat_interleave(G)
            per_rank = dropped_rows.view(2, -1).sum(dim=1)
            uneven |= bool(per_rank[0] != per_rank[1])
        if not uneven:
            problems.append("no round dropped a different number of rows on the two processes")
        if not any(h["dapo/rounds"] > 1 for h in logs):
            problems.append("no refill happened")
    elif opts.mode == "speed":
        completed = [d for d in decisions if any(kind == "complete" for _, kind, _ in d[1])]
        mixed = [d for d in completed if any(kind == "screen" for _, kind, _ in d[1])]
        if not completed or not mixed:
            problems.append(f"no round completed an accepted screening ({len(completed)}) or mixed screening and "
                            f"completion in one generate call ({len(mixed)})")
        if any(h[f"{prefix}/exhausted"] > 0 for h in logs):
            problems.append("a step was exhausted")
        if not sel.history:
            problems.append("GRESO's history is empty")
    else:
        if not any(h["dapo/exhausted"] > 0 for h in logs):
            problems.append("no step was exhausted")

    # identical weights on both processes
    both = acc.gather(flat_weights(trainer).unsqueeze(0))
    if not torch.equal(both[0], both[1]):
        problems.append(f"weights differ across processes (max diff {(both[0] - both[1]).abs().max().item()})")

    merged = [p for per_rank in gather_object([problems]) for p in per_rank]
    acc.wait_for_everyone()
    if merged:
        if acc.is_main_process:
            print("\n".join(merged))
        sys.exit(1)
    if acc.is_main_process:
        print(f"DAPO-2PROC-OK {opts.mode} steps={len(steps)} rounds={len(rounds)} "
              f"metrics={[{k: h[k] for k in h if k.startswith(prefix + '/')} for h in logs]}")


if __name__ == "__main__":
    main_then_finish(main)
