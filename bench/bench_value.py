"""PPO and VAPO against TRL's `GRPOTrainer`: seconds per step, peak memory, and the critic after value pre-training.

A script, not a test. Same tiny offline model and toy task (`trl_ppo_variants.toy`), same batch, no reference model
(beta = 0, no KL in the reward) for every row.

* Seconds per step: per round, each row gets a fresh trainer that runs `--warmup + --steps` optimizer steps; the first
  `--warmup` are dropped and the median of the rest is divided by GRPO's median of the same round. The table shows
  the median over rounds of these paired ratios (a shared machine's drift hits every row alike).
  Rows: "VAPO" = policy phase (pre-training done after step 1), "VAPO pre-training" = critic-only steps.
* Peak memory: each row runs in a fresh subprocess; the peak RSS (VmHWM) above the RSS after imports is compared
  (on a GPU: `torch.cuda.max_memory_allocated`). On the toy model both are dominated by framework overhead: the
  ratio says that nothing is duplicated per step, not what a 7B critic costs (parameters + grads + Adam states of a
  second network: about 2x GRPO's model-state memory before activations).
* Explained variance of the critic, `1 - Var[R - V] / Var[R]` on a fresh 128-completion rollout (returns with
  lam_critic = 1: the outcome reward), before and after `--pretrain-steps` steps of value pre-training; with the toy
  reward (whether the sampled sum is right: the critic must do the arithmetic) and with a reward the prompt alone
  determines (first operand even: the critic must read the prompt), which shows how fast the critic can learn.

Targets (issue 4): time <= 1.8x, memory <= 1.6x GRPO.

    .venv/bin/python bench/bench_value.py --steps 6 --rounds 3 --pretrain-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

for _k, _v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("WANDB_DISABLED", "true"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

torch.set_num_threads(1)

ROWS = ("grpo", "ppo", "vapo", "vapo_pretrain")
LABELS = {"grpo": "GRPO (TRL)", "ppo": "PPO", "vapo": "VAPO", "vapo_pretrain": "VAPO pre-training"}


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def first_operand_even_reward(completions, prompts, **kwargs):
    """1 when the prompt's first operand is even: a reward the prompt alone determines (a learnable value)."""
    return [float(int(p.lstrip()[0]) % 2 == 0) for p in prompts]


def build(row: str, model_dir: str, out_dir: str, opts, max_steps: int, callbacks=(), reward=None):
    from trl import GRPOConfig, GRPOTrainer

    from trl_ppo_variants.toy import addition_dataset, addition_reward
    from trl_ppo_variants.trainers.ppo import PPOConfig, PPOTrainer
    from trl_ppo_variants.trainers.vapo import VAPOConfig, VAPOTrainer

    common = dict(output_dir=out_dir, per_device_train_batch_size=opts.batch_size, num_generations=opts.group_size,
                  max_completion_length=opts.max_completion_length, max_steps=max_steps, learning_rate=1e-4,
                  logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, beta=0.0,
                  use_cpu=not torch.cuda.is_available(), temperature=1.0)
    if row == "grpo":
        cfg, cls = GRPOConfig(**common), GRPOTrainer
    elif row == "ppo":
        cfg, cls = PPOConfig(**common, kl_in_reward_coef=0.0, critic_backbone="full"), PPOTrainer
    else:
        pretrain = max_steps - 1 if row == "vapo_pretrain" else 1
        cfg, cls = VAPOConfig(**common, value_pretrain_steps=pretrain, critic_learning_rate=opts.critic_lr), VAPOTrainer
    dataset = addition_dataset(opts.batch_size * max_steps * 2, seed=0)
    return cls(model_dir, reward or addition_reward, args=cfg, train_dataset=dataset, callbacks=list(callbacks))


def step_times(row, model_dir, opts) -> list[float]:
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    clock = Clock()
    total = opts.warmup + opts.steps + (1 if row == "vapo_pretrain" else 0)  # the last VAPO step leaves pre-training
    with tempfile.TemporaryDirectory() as out:
        build(row, model_dir, out, opts, total, [clock]).train()
    return clock.times[opts.warmup : opts.warmup + opts.steps]


def child_memory(row, model_dir, opts) -> None:
    """Run in a fresh process: print the peak memory (MB) the trainer adds."""
    import trl  # noqa: F401  (imports first: the baseline includes the frameworks)

    import trl_ppo_variants.trainers.vapo  # noqa: F401

    cuda = torch.cuda.is_available()
    base = _rss_mb("VmRSS")
    with tempfile.TemporaryDirectory() as out:
        build(row, model_dir, out, opts, opts.warmup + opts.steps + 1).train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _rss_mb("VmHWM") - base
    print(json.dumps({"row": row, "peak_mb": peak, "kind": "cuda allocated" if cuda else "RSS above imports"}))


def memory(row, model_dir, opts) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--model", model_dir,
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(opts).items() if k not in ("child", "model", "out")]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory run of {row} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def explained_variance_after_pretraining(model_dir, opts, reward=None) -> dict:
    """EV of the critic on a fresh 128-row rollout, before and after `pretrain_steps` of value pre-training."""
    from trl_ppo_variants.critic import explained_variance
    from trl_ppo_variants.toy import addition_dataset

    probe = [dict(r) for r in addition_dataset(128 // opts.group_size, seed=123) for _ in range(opts.group_size)]

    def ev(trainer):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        rows = []
        for start in range(0, len(probe), opts.batch_size):
            rows.append(trainer._generate_and_score_completions(probe[start : start + opts.batch_size]))
        width = max(b["returns"].shape[1] for b in rows)

        def cat(key):
            return torch.cat([torch.nn.functional.pad(b[key], (0, width - b[key].shape[1])) for b in rows])

        return explained_variance(cat("old_values"), cat("returns"), cat("value_mask")).item()

    with tempfile.TemporaryDirectory() as out:
        trainer = build("vapo_pretrain", model_dir, out, opts, opts.pretrain_steps + 1, reward=reward)
        before = ev(trainer)
        trainer.train()
        pretrain_logged = [h.get("value/explained_variance") for h in trainer.state.log_history
                           if "value/explained_variance" in h]
        after = ev(trainer)
    return {"before": before, "after": after, "steps": opts.pretrain_steps, "logged_per_step": pretrain_logged}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=4)
    parser.add_argument("--pretrain-steps", type=int, default=20)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--model", default=None, help="model directory (default: the toy model, built here)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()

    from trl_ppo_variants.toy import make_toy_checkpoint

    model_dir = opts.model or make_toy_checkpoint(tempfile.mkdtemp(prefix="bench_value_"), seed=0, warm_steps=25)
    if opts.child:
        child_memory(opts.child, model_dir, opts)
        return

    medians = {row: [] for row in ROWS}
    for r in range(opts.rounds):
        order = ROWS[r % len(ROWS):] + ROWS[: r % len(ROWS)]
        for row in order:
            medians[row].append(statistics.median(step_times(row, model_dir, opts)))
    ratios = {row: statistics.median(m / g for m, g in zip(medians[row], medians["grpo"])) for row in ROWS}
    mem = {row: memory(row, model_dir, opts) for row in ROWS}
    ev = explained_variance_after_pretraining(model_dir, opts)
    ev_easy = explained_variance_after_pretraining(model_dir, opts, reward=first_operand_even_reward)

    print(f"\nbatch {opts.batch_size}, G {opts.group_size}, {opts.steps} timed steps x {opts.rounds} rounds, "
          f"{mem['grpo']['kind']}\n")
    print("| trainer | s/step (median) | time vs GRPO | peak MB | memory vs GRPO | target |")
    print("|---|---|---|---|---|---|")
    results = {}
    for row in ROWS:
        t = statistics.median(medians[row])
        m = mem[row]["peak_mb"] / mem["grpo"]["peak_mb"]
        target = "" if row == "grpo" else ("PASS" if ratios[row] <= 1.8 and m <= 1.6 else "MISS")
        results[row] = {"s_per_step": t, "time_ratio": ratios[row], "peak_mb": mem[row]["peak_mb"], "mem_ratio": m}
        print(f"| {LABELS[row]} | {t:.3f} | {ratios[row]:.2f}x | {mem[row]['peak_mb']:.0f} | {m:.2f}x | {target} |")
    print(f"\nCritic explained variance on a fresh 128-completion rollout, before -> after {ev['steps']} value "
          "pre-training steps:")
    print(f"- toy addition reward (correctness of the sampled answer): {ev['before']:.3f} -> {ev['after']:.3f}")
    print(f"- prompt-determined reward (first operand even): {ev_easy['before']:.3f} -> {ev_easy['after']:.3f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"rows": results, "explained_variance": ev, "explained_variance_prompt_reward": ev_easy,
                       "options": vars(opts)}, f, indent=1)


if __name__ == "__main__":
    main()
