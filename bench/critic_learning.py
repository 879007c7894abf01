"""Learning on the real model with a LoRA critic (issue 21): PPO and VAPO with `critic_backbone="lora"` against the same
trainers with the full critic and against `trl.GRPOTrainer`, with the demo's settings (`trl_ppo_variants/demo.py`:
16 completions a step in groups of 4, 24 new tokens, temperature 0.7, lr 3e-5, 8 policy steps, VAPO's 4 value
pre-training steps on top; held-out accuracy of 32 questions x 4 samples), one fresh model per run. Issue 28 chose
PPO's default critic from its seeds 0-2 (the LoRA critic; `ppo` here is the full critic, named in its row).

    python bench/critic_learning.py [--seeds 0,1] [--variants grpo,ppo,ppo_lora,vapo,vapo_lora,...] [--out DIR]

Prints, per seed and variant, the held-out accuracy before -> after, the gain, the explained variance of the critic at
every step (`value/explained_variance`: of the rollout-time values against the returns, so step 1's is the fresh
critic's) and the seconds per step; then, per variant, the mean gain over the seeds and its ratio to the full critic's
and to GRPO's gain, each on the seeds both ran (the issue's targets: >= 80% and >= 50%). Results go to
`<out>/critic_learning.json` after every run (a stopped run resumes where it stopped). Seconds per step depend on
what else runs on the machine; accuracy does not (seeded).

The demo runs PPO without a KL (no reference model), so its LoRA critic's frozen weights are a copy of the initial
policy's, the same weights a shared reference model holds: the values, and so the learning, are those of the shared
mode (the memory is not: see the real-model benchmark rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(DS_ACCELERATOR="cpu", TRANSFORMERS_VERBOSITY="error")

#: variant -> (the demo's algorithm, config fields on top of its settings)
VARIANTS = {
    "grpo": ("grpo", {}),
    # the backbone named in every PPO/VAPO row, so that a row keeps its meaning whatever the default (PPO's default
    # was "full" until issue 28, "lora" since)
    "ppo": ("ppo", {"critic_backbone": "full"}),
    "vapo": ("vapo", {"critic_backbone": "full"}),
    # the LoRA critic at its default learning rate: ten times the full critic's (PPO 3e-4, VAPO 6e-4), LoRA's usual
    # ratio to full fine-tuning
    "ppo_lora": ("ppo", {"critic_backbone": "lora"}),
    "vapo_lora": ("vapo", {"critic_backbone": "lora"}),
    # at the full critic's rate (the default before 2026-12-04: PPO 3e-5, VAPO 6e-5)
    "ppo_lora_lr1": ("ppo", {"critic_backbone": "lora", "critic_learning_rate": 3e-5}),
    "vapo_lora_lr1": ("vapo", {"critic_backbone": "lora", "critic_learning_rate": 6e-5}),
    # why VAPO's LoRA critic loses: its policy advantages without the length-adaptive lambda (decoupled GAE alone,
    # lam_policy 0.95: not one-step TD errors of the critic), and with three times the value pre-training
    "vapo_lora_lam095": ("vapo", {"critic_backbone": "lora", "length_adaptive_alpha": None, "lam_policy": 0.95}),
    "vapo_lora_pretrain12": ("vapo", {"critic_backbone": "lora", "value_pretrain_steps": 12}),
    # issue 28: the full critic at a higher rate (bench/critic_fit.py: at 3e-5 it fits the returns slowly, explained
    # variance 0.06 after 8 steps on fixed rollouts)
    "ppo_lr1e-4": ("ppo", {"critic_backbone": "full", "critic_learning_rate": 1e-4}),
}
DEFAULT_OUT = os.path.join(HERE, "results", "smollm2_critic")


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--variants", default="grpo,ppo,ppo_lora,vapo,vapo_lora")
    parser.add_argument("--steps", type=int, default=None, help="policy steps (default: the demo's)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    opts = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ppo_variants import demo
    from trl_ppo_variants.smollm2 import smollm2_checkpoint, word_problem_dataset

    transformers.logging.set_verbosity_error()
    os.makedirs(opts.out, exist_ok=True)
    path = os.path.join(opts.out, "critic_learning.json")
    results = json.load(open(path)) if os.path.exists(path) else {"runs": {}, "before": {}}
    steps = opts.steps or demo.DEFAULT_STEPS
    results["settings"] = {"steps": steps, "eval_prompts": demo.EVAL_PROMPTS, "eval_samples": demo.EVAL_SAMPLES,
                           "common": {k: v for k, v in demo.COMMON.items() if isinstance(v, (int, float, str))},
                           "algo_settings": {v: demo.ALGO_SETTINGS.get(a, {}) for v, (a, _) in VARIANTS.items()},
                           "variants": {v: o for v, (_, o) in VARIANTS.items()}, "threads": torch.get_num_threads()}
    model_dir = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    class Bar:  # demo.train_one reports progress to a tqdm bar
        n = 0

        def update(self, k):
            self.n += k

        def set_postfix(self, **kwargs):
            pass

        def set_description(self, text):
            print(f"  {text}", flush=True)

    for seed in [int(s) for s in opts.seeds.split(",")]:
        heldout = word_problem_dataset(demo.EVAL_PROMPTS, seed=seed, split="test")
        opts_run = argparse.Namespace(steps=steps, seed=seed, output_dir=os.path.join(opts.out, "runs"),
                                      eval_samples=demo.EVAL_SAMPLES, save_models=False)
        if str(seed) not in results["before"]:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            args0 = demo.training_args("grpo", steps, seed, opts_run.output_dir)
            results["before"][str(seed)] = demo.evaluate(base, tokenizer, heldout, args0, seed, demo.EVAL_SAMPLES)
            del base
        before = results["before"][str(seed)]
        for variant in opts.variants.split(","):
            key = f"{variant}/{seed}"
            if key in results["runs"]:
                continue
            algo, overrides = VARIANTS[variant]
            print(f"{key}: training", flush=True)
            start = time.perf_counter()
            row = demo.train_one(algo, model_dir, heldout, opts_run, Bar(), **overrides)
            row.update(variant=variant, seed=seed, before=before, gain=row["after"] - before,
                       minutes=(time.perf_counter() - start) / 60)
            results["runs"][key] = row
            ev = " ".join("nan" if e is None else f"{e:.2f}" for e in row["explained_variance"])
            print(f"{key}: {before:.3f} -> {row['after']:.3f} ({row['gain']:+.3f}), {row['sec_per_step']:.1f} s/step"
                  + (f", explained variance per step: {ev}" if ev else ""), flush=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    print(summary(results))
    return results


def summary(results: dict) -> str:
    """The table: per variant, the gain of each seed, its mean, and its ratios to the full critic's and GRPO's."""
    runs = results["runs"]
    by_variant = {}
    for row in runs.values():
        by_variant.setdefault(row["variant"], []).append(row)
    mean = {v: sum(r["gain"] for r in rows) / len(rows) for v, rows in by_variant.items()}
    gains = {v: {r["seed"]: r["gain"] for r in rows} for v, rows in by_variant.items()}

    def ratio(variant, other):
        """The variant's mean gain over the mean gain of `other` on the seeds both ran."""
        seeds = sorted(set(gains.get(variant, {})) & set(gains.get(other, {})))
        if not seeds:
            return ""
        den = sum(gains[other][s] for s in seeds)
        if den <= 0:  # a share of a gain that is not one means nothing
            return "n/a"
        return f"{sum(gains[variant][s] for s in seeds) / den:.0%}"
    lines = ["| variant | seeds | held-out before -> after | gain (mean) | vs full critic | vs GRPO | explained variance "
             "per step (seed-mean) | s/step |", "|---|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        rows = sorted(by_variant.get(variant, []), key=lambda r: r["seed"])
        if not rows:
            continue
        evs = [r["explained_variance"] for r in rows if r["explained_variance"]]
        ev = ""
        if evs:
            width = min(len(e) for e in evs)
            ev = " ".join(f"{sum(e[i] or 0.0 for e in evs) / len(evs):.2f}" for i in range(width))
        lines.append("| {} | {} | {} | {:+.3f} | {} | {} | {} | {:.1f} |".format(
            variant, ",".join(str(r["seed"]) for r in rows),
            "; ".join(f"{r['before']:.3f} -> {r['after']:.3f}" for r in rows), mean[variant],
            ratio(variant, variant.split("_lora")[0]) if "_lora" in variant else "",
            ratio(variant, "grpo") if variant != "grpo" else "", ev, sum(r["sec_per_step"] for r in rows) / len(rows)))
    return "\n".join(lines)


if __name__ == "__main__":
    run()
