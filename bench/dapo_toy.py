"""DAPO against TRL's GRPOTrainer on the toy task, same model, data, seed and steps.

Runs TRL's `GRPOTrainer` (with DAPO's clip-higher so that only the data side differs), `DAPOTrainer` without dynamic
sampling (this package's seam alone) and `DAPOTrainer` with dynamic sampling, and reports per run: seconds per optimizer
step, seconds per generated completion token, generated tokens per trained token, and the sampled-reward curve
(written to <out>/dapo_bench.json, and <out>/dapo_bench.png when matplotlib is installed).

    .venv/bin/python bench/dapo_toy.py --steps 40 --repeats 2 --out /tmp/dapo_bench

Seconds are CPU seconds of this single-threaded process (wall time on a shared machine measures the neighbours);
compare ratios, and repeat (runs are interleaved).
"""

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_ppo_variants.toy import addition_dataset, addition_reward, make_toy_checkpoint  # noqa: E402
from trl_ppo_variants.trainers.dapo import DAPOConfig, DAPOTrainer  # noqa: E402


class _Tokens(TrainerCallback):
    """Completion tokens generated (from TRL's per-round mean length) and trained (kept loss tokens)."""

    def __init__(self, trainer):
        self.trainer, self.generated, self.trained = trainer, 0.0, 0.0
        original = trainer._generate_and_score_completions

        def wrapped(inputs):
            metrics = trainer._metrics["train"]
            before = len(metrics["completions/mean_length"])
            out = original(inputs)
            lengths = metrics["completions/mean_length"][before:]
            rows = trainer.args.generation_batch_size
            refill = getattr(trainer, "_refill_num_prompts", None)
            # first round: a generation batch; refill rounds: refill_num_prompts * G rows each
            sizes = [rows] + [(refill or 0) * trainer.num_generations] * (len(lengths) - 1)
            self.generated += sum(l * n for l, n in zip(lengths, sizes))
            self.trained += float(out["num_items_in_batch"])
            return out

        trainer._generate_and_score_completions = wrapped


def run(kind, model_dir, steps, seed, out_dir):
    common = dict(output_dir=os.path.join(out_dir, kind), per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=4, max_steps=steps, learning_rate=5e-4, lr_scheduler_type="constant",
                  logging_steps=1, report_to=[], use_cpu=True, seed=seed, save_strategy="no", disable_tqdm=True,
                  beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo")
    data = addition_dataset(256, seed=0)
    if kind == "grpo":
        trainer = GRPOTrainer(model_dir, addition_reward, args=GRPOConfig(**common), train_dataset=data)
    else:
        # 4 tokens leave the overlong shaping no cache (it would penalise nothing, which DAPOConfig refuses)
        args = DAPOConfig(dynamic_sampling=(kind == "dapo"), max_generation_rounds=0, overlong_penalty=False,
                          **common)
        trainer = DAPOTrainer(model_dir, addition_reward, args=args, train_dataset=data)
    tokens = _Tokens(trainer)
    # CPU time of this (single-threaded) process: robust to other jobs sharing the machine, unlike wall time
    start, wall = time.process_time(), time.perf_counter()
    trainer.train()
    elapsed, wall = time.process_time() - start, time.perf_counter() - wall
    rewards = [h["rewards/addition_reward/mean"] for h in trainer.state.log_history
               if "rewards/addition_reward/mean" in h]
    return {
        "kind": kind, "seconds": elapsed, "wall_seconds": wall, "seconds_per_step": elapsed / steps,
        "generated_tokens": tokens.generated, "trained_tokens": tokens.trained,
        "gen_per_trained": tokens.generated / tokens.trained,
        "seconds_per_generated_token": elapsed / tokens.generated,
        "reward_curve": rewards,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="dapo_bench_"))
    opts = parser.parse_args()
    model_dir = make_toy_checkpoint(os.path.join(opts.out, "model"), seed=0, warm_steps=25)
    results = {"grpo": [], "dapo_no_ds": [], "dapo": []}
    for r in range(opts.repeats):
        for kind in results:
            res = run(kind, model_dir, opts.steps, opts.seed, opts.out)
            results[kind].append(res)
            print(f"[{r}] {kind:11s} {res['seconds_per_step']:.3f} s/step  "
                  f"{res['seconds_per_generated_token'] * 1e3:.3f} ms/gen-token  "
                  f"gen/trained {res['gen_per_trained']:.3f}  reward first5 "
                  f"{sum(res['reward_curve'][:5]) / 5:.3f} last5 {sum(res['reward_curve'][-5:]) / 5:.3f}", flush=True)

    def mean(kind, key):
        return sum(x[key] for x in results[kind]) / len(results[kind])

    summary = {}
    for kind in results:
        summary[kind] = {k: mean(kind, k) for k in ("seconds_per_step", "seconds_per_generated_token",
                                                     "gen_per_trained")}
        curve = [sum(x["reward_curve"][i] for x in results[kind]) / len(results[kind])
                 for i in range(len(results[kind][0]["reward_curve"]))]
        summary[kind]["reward_curve"] = curve
        summary[kind]["mean_reward_last_half"] = sum(curve[len(curve) // 2:]) / len(curve[len(curve) // 2:])
    g = summary["grpo"]
    for kind in ("dapo_no_ds", "dapo"):
        s = summary[kind]
        print(f"{kind} / grpo: seconds per step x{s['seconds_per_step'] / g['seconds_per_step']:.2f}, "
              "seconds per generated token "
              f"x{s['seconds_per_generated_token'] / g['seconds_per_generated_token']:.2f}, "
              f"generated per trained token {s['gen_per_trained']:.2f} vs {g['gen_per_trained']:.2f}, "
              f"mean sampled reward over the second half {s['mean_reward_last_half']:.3f} vs "
              f"{g['mean_reward_last_half']:.3f}")
    with open(os.path.join(opts.out, "dapo_bench.json"), "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for kind, label in (("grpo", "TRL GRPOTrainer"), ("dapo", "DAPO (dynamic sampling)"),
                            ("dapo_no_ds", "DAPO without dynamic sampling")):
            ax.plot(summary[kind]["reward_curve"], label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean reward of the generated completions")
        ax.set_title("toy addition task")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(opts.out, "dapo_bench.png"), dpi=120)
    except ImportError:
        pass
    print("written to", opts.out)


if __name__ == "__main__":
    sys.exit(main())
