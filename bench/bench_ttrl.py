"""Seconds per step of TTRL (n_votes = 2 * n_train) against TRL's GRPOTrainer with num_generations = n_votes and
with num_generations = n_train, same prompts per step (a script, not a test).

TTRL generates and scores n_votes completions per prompt like GRPO(G = n_votes), then trains on n_train of them like
GRPO(G = n_train), so its step time should lie between the two. The trainers are built in one process and run
round-robin (`--rounds` rounds of `--steps` steps, the first step of each call dropped); the ratios are medians of
per-round ratios, so that drift of a shared machine hits every trainer alike.

    .venv/bin/python bench/bench_ttrl.py --n-train 4 --prompts 4 --steps 4 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_ppo_variants.toy import addition_dataset, addition_reward, make_toy_checkpoint  # noqa: E402
from trl_ppo_variants.trainers.ttrl import TTRLConfig, TTRLTrainer  # noqa: E402


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def build(kind, model_dir, out, n_train, prompts, steps, completion_len):
    n_votes = 2 * n_train
    common = dict(output_dir=out, max_completion_length=completion_len, max_steps=steps, learning_rate=1e-5,
                  logging_steps=10**6, report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                  beta=0.0)
    data = addition_dataset(10_000)
    if kind == "ttrl":
        args = TTRLConfig(n_votes=n_votes, n_train=n_train, per_device_train_batch_size=prompts * n_votes,
                          answer_extractor="last_number", **common)
        return TTRLTrainer(model_dir, args=args, train_dataset=data)
    g = n_votes if kind == "grpo_votes" else n_train
    args = GRPOConfig(num_generations=g, per_device_train_batch_size=prompts * g, **common)
    return GRPOTrainer(model_dir, addition_reward, args=args, train_dataset=data)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--completion-len", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)
    model_dir = make_toy_checkpoint(tempfile.mkdtemp(prefix="bench_ttrl_"), warm_steps=25)
    kinds = ["ttrl", "grpo_votes", "grpo_train"]
    trainers, timers = {}, {}
    for kind in kinds:
        trainers[kind] = build(kind, model_dir, tempfile.mkdtemp(), a.n_train, a.prompts, a.steps, a.completion_len)
        timers[kind] = StepTimer()
        trainers[kind].add_callback(timers[kind])
    per_round = {k: [] for k in kinds}
    for r in range(a.rounds):
        for kind in kinds[r % 3:] + kinds[: r % 3]:  # rotate the order
            timer, trainer = timers[kind], trainers[kind]
            timer.times = []
            trainer.state.global_step = 0
            trainer.args.max_steps = a.steps
            trainer.train()
            per_round[kind].append(statistics.median(timer.times[1:] or timer.times))
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratio = {k: statistics.median(x / y for x, y in zip(per_round[k], per_round["ttrl"])) for k in kinds}
    n_votes = 2 * a.n_train
    print(f"TTRL n_votes={n_votes} n_train={a.n_train}, {a.prompts} prompts/step, completion <= {a.completion_len} "
          f"tokens, {a.rounds} rounds x {a.steps} steps (toy model, CPU, {a.threads} thread)")
    print(f"{'trainer':<32}{'s/step':>10}{'ratio to TTRL':>16}")
    labels = {"ttrl": f"TTRL ({n_votes} votes, {a.n_train} trained)", "grpo_votes": f"GRPO (G = n_votes = {n_votes})",
              "grpo_train": f"GRPO (G = n_train = {a.n_train})"}
    for k in kinds:
        print(f"{labels[k]:<32}{med[k]:>10.4f}{ratio[k]:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
