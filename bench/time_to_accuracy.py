"""Time to accuracy on the real model (issue 18): how soon each method gets as good as `trl.GRPOTrainer` gets in 20
steps, with the held-out evaluation kept off the clock.

    python bench/time_to_accuracy.py                       # every method, the demo's settings (~2 h on 2 cores)
    python bench/time_to_accuracy.py --num-generations 16  # the same with groups of 16 (SPEED screens 4 of them)
    python bench/time_to_accuracy.py --methods grpo,grpo_speed --grpo-steps 2 --eval-points 1 --eval-prompts 4 \
        --eval-samples 1                                   # a short check (~4 min on a quiet 2-core machine)

Protocol (SmolLM2-135M-Instruct on the demo's word problems, the demo's settings: 16 completions a step in groups of
G = 4, 24 new tokens, temperature 0.7, lr 3e-5, fp32 on the CPU; held-out accuracy: 32 questions x 4 samples at the
training temperature, `trl_ppo_variants.smollm2.heldout_accuracy`, the demo's measure):

1. The reference, `trl.GRPOTrainer`, trains `--grpo-steps` (20) steps; its held-out accuracy is measured every
   `grpo_steps / eval_points` steps and after the last. Its training wall time `T` (evaluations excluded) is the
   budget, its last accuracy `A` the target.
2. Every other method trains from the same checkpoint with the same seed until its training clock passes `T` (or
   `--max-steps-factor` x the reference's steps); its accuracy is measured whenever its clock passes a multiple of
   `T / eval_points`, and when it stops.
3. Per method: the time to reach `A` (the training clock at the first evaluation at or above `A`: an upper bound,
   exact to one evaluation interval), as seconds and as a multiple of `T`; the accuracy at equal wall time (its last
   evaluation, at `T`); generated tokens per trained token (every completion token generated, screenings and dropped
   groups included, over the completion tokens that reached the loss); steps and seconds per step.

The clock: a `TrainerCallback` stops it for each evaluation (model in eval mode, its own seeded RNG; the training RNG
is left as it was), so the held-out measure neither costs nor changes the training. Methods run one after the other
in one process, each on a fresh copy of the model.

Writes `time_to_accuracy.json` (every curve, every setting, the machine), `time_to_accuracy.md` (the table) and
`time_to_accuracy.png` (held-out accuracy against training wall time, one curve per method) to `--out` (default
`bench/results/smollm2/`). Wall-clock numbers need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(TRANSFORMERS_VERBOSITY="error", DS_ACCELERATOR="cpu")

DEFAULT_OUT = os.path.join(HERE, "results", "smollm2")
REFERENCE = "grpo"


# ------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Method:
    """A row of the table: an algorithm (`trl` for TRL's GRPO, else a name `trl_ppo_variants.cli` loads, or
    `grpo_ours` for `trl_ppo_variants.GRPOTrainer`) and the settings it adds."""

    name: str
    label: str
    algorithm: str
    settings: dict = field(default_factory=dict)


METHODS = {m.name: m for m in [
    Method("grpo", "trl.GRPOTrainer", "trl"),
    Method("grpo_speed", "GRPO + screening (SPEED)", "grpo_ours", {"prompt_selection": "speed"}),
    Method("dapo", "DAPO", "dapo"),
    Method("dapo_speed", "DAPO + screening (SPEED)", "dapo", {"prompt_selection": "speed"}),
    Method("rloo", "RLOO", "rloo", {"beta": 0.0}),
    Method("rloo_speed", "RLOO + screening (SPEED)", "rloo", {"beta": 0.0, "prompt_selection": "speed"}),
    Method("reinforce_pp", "REINFORCE++", "reinforce_pp", {"kl_in_reward_coef": 0.0}),
    Method("ppo", "PPO", "ppo", {"kl_in_reward_coef": 0.0, "critic_backbone": "full"}),  # as measured (full critic)
    # not in the default set: GRESO needs prompts seen before, which 20 steps of a 2048-prompt set rarely are
    Method("grpo_greso", "GRPO + GRESO", "grpo_ours", {"prompt_selection": "greso"}),
    Method("grpo_speed_greso", "GRPO + SPEED + GRESO", "grpo_ours", {"prompt_selection": "speed+greso"}),
    Method("grpo_ds", "GRPO + dynamic sampling", "grpo_ours", {"prompt_selection": "dynamic_sampling"}),
]}
DEFAULT_METHODS = ("grpo", "grpo_speed", "dapo", "dapo_speed", "rloo", "rloo_speed", "reinforce_pp", "ppo")


def trainer_classes(method: Method):
    if method.algorithm == "trl":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    if method.algorithm == "grpo_ours":
        from trl_ppo_variants import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    from trl_ppo_variants.cli import load_algorithm

    return load_algorithm(method.algorithm)


def select_methods(spec: str | None) -> list[Method]:
    """The methods of `--methods` (comma-separated names), the reference first; ValueError names an unknown one."""
    names = list(DEFAULT_METHODS) if not spec else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; expected names among {', '.join(METHODS)}")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    names.sort(key=lambda n: n != REFERENCE)
    return [METHODS[n] for n in names]


# ------------------------------------------------------------------------------------------------ the task
@dataclass
class Task:
    """What the benchmark trains on: a model folder, a train set, a reward, a held-out measure, shared settings."""

    model_dir: str
    train_dataset: object
    reward: object
    evaluate: object  # (model, tokenizer) -> held-out accuracy
    common: dict
    describe: str = ""


def smollm2_task(seed: int, eval_prompts: int, eval_samples: int, train_size: int = 2048,
                 num_generations: int | None = None) -> Task:
    """The demo's task and settings (`trl_ppo_variants.demo.COMMON`): SmolLM2-135M-Instruct on word problems.
    `num_generations` other than the demo's 4 keeps its 4 prompts a step (the batch grows with the group)."""
    from trl_ppo_variants.demo import COMMON, TRAIN_SEED_OFFSET
    from trl_ppo_variants.smollm2 import (
        heldout_accuracy,
        smollm2_checkpoint,
        word_problem_dataset,
        word_problem_reward,
    )

    heldout = word_problem_dataset(eval_prompts, seed=seed, split="test")
    common = dict(COMMON)
    if num_generations is not None:
        prompts = common["per_device_train_batch_size"] // common["num_generations"]
        common.update(num_generations=num_generations, per_device_train_batch_size=prompts * num_generations)

    def evaluate(model, tokenizer):
        return heldout_accuracy(model, tokenizer, heldout["prompt"], heldout["answer"], samples=eval_samples,
                                temperature=common["temperature"], max_new_tokens=common["max_completion_length"],
                                seed=seed)

    return Task(smollm2_checkpoint(), word_problem_dataset(train_size, seed=seed + TRAIN_SEED_OFFSET),
                word_problem_reward, evaluate, common,
                f"SmolLM2-135M-Instruct, word problems, {eval_prompts} held-out questions x {eval_samples} samples")


# ------------------------------------------------------------------------------------------------ the clock
class TrainClock:
    """Training wall time with the evaluations taken out: `now()` is the time since `start()` minus the time spent
    inside `evaluating()` blocks. `timer` is injectable (tests)."""

    def __init__(self, timer=time.perf_counter):
        self.timer = timer
        self.started = None
        self.excluded = 0.0

    def start(self):
        self.started = self.timer()
        self.excluded = 0.0

    def now(self) -> float:
        return self.timer() - self.started - self.excluded

    def evaluating(self):
        clock = self

        class Paused:
            def __enter__(self):
                self.t0 = clock.timer()

            def __exit__(self, *exc):
                clock.excluded += clock.timer() - self.t0
                return False

        return Paused()


def eval_schedule(step: int, clock_s: float, *, every_steps: int | None = None, every_s: float | None = None,
                  done: int = 0) -> bool:
    """Whether to evaluate after this step: on a step grid (the reference: every `every_steps` steps) or on a time
    grid (the others: when the clock has passed the next multiple of `every_s`; `done` evaluations so far)."""
    if every_steps is not None:
        return step % every_steps == 0
    return clock_s >= (done + 1) * every_s


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float:
    """The training time of the first point of `curve` ((seconds, accuracy), in order) at or above `target`, or
    infinity when none is (an upper bound of the true time, exact to one evaluation interval)."""
    return next((t for t, acc in curve if acc >= target - 1e-12), math.inf)


# ------------------------------------------------------------------------------------------------ one run
def run_method(method: Method, task: Task, *, steps: int, seed: int, output_dir: str, budget_s: float | None,
               eval_points: int, before: float, progress=print) -> dict:
    """Train `method`: the reference for `steps` steps (step grid), the others until `budget_s` of training time
    (time grid). Returns its row: curve [(seconds, accuracy)], tokens, steps, time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    sys.path.insert(0, HERE)
    from algos import Meter

    config_cls, trainer_cls = trainer_classes(method)
    settings = {**task.common, **method.settings}
    settings.update(output_dir=os.path.join(output_dir, method.name), max_steps=steps, seed=seed, logging_steps=1)
    args = config_cls(**settings)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    model = AutoModelForCausalLM.from_pretrained(task.model_dir, dtype=torch.float32)
    trainer = trainer_cls(model=model, reward_funcs=task.reward, args=args, train_dataset=task.train_dataset,
                          processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    meter = Meter(trainer)
    clock = TrainClock()
    curve = [(0.0, before)]
    every_steps = None if budget_s is not None else max(1, steps // eval_points)
    every_s = None if budget_s is None else budget_s / eval_points

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            now = clock.now()
            stop = budget_s is not None and now >= budget_s
            last = stop or state.global_step >= steps
            if last or eval_schedule(state.global_step, now, every_steps=every_steps, every_s=every_s,
                                     done=len(curve) - 1):
                with clock.evaluating():
                    curve.append((now, task.evaluate(model, tokenizer)))
                progress(f"  {method.name}: step {state.global_step}, {now:.0f} s of training, held-out accuracy "
                         f"{curve[-1][1]:.3f}")
            control.should_training_stop = control.should_training_stop or stop

    trainer.add_callback(Watch())
    torch.manual_seed(seed)
    trainer.train()
    history = trainer.state.log_history
    return {"method": method.name, "label": method.label, "settings": {k: v for k, v in method.settings.items()},
            "curve": curve, "steps": trainer.state.global_step, "train_seconds": curve[-1][0],
            "gen_tokens": meter.gen_tokens, "trained_tokens": meter.trained_tokens, "gen_calls": meter.gen_calls,
            "gen_per_trained_token": meter.gen_tokens / meter.trained_tokens if meter.trained_tokens else math.nan,
            "rewards": [h["reward"] for h in history if "reward" in h]}


def summarize(rows: list[dict]) -> dict:
    """Add the table's columns to every row against the reference (the first row): time to reach its final accuracy
    (seconds and x of its time) and the accuracy at equal wall time (the last evaluation: a method stops at the
    first step end past the budget, or earlier at its step limit). Returns the reference's target and budget."""
    ref = rows[0]
    target, budget = ref["curve"][-1][1], ref["train_seconds"]
    for row in rows:
        reach = time_to_reach(row["curve"], target)
        row["time_to_target"] = reach
        row["time_ratio"] = reach / budget if budget > 0 else math.nan
        row["acc_at_budget"] = row["curve"][-1][1]
        row["sec_per_step"] = row["train_seconds"] / max(row["steps"], 1)
    return {"target": target, "budget_s": budget}


def format_table(rows: list[dict], target: float, budget: float, grpo_steps: int) -> str:
    def fmt_time(row):
        if math.isinf(row["time_to_target"]):
            return "not reached"
        return f"{row['time_to_target']:.0f} s ({row['time_ratio']:.2f}x)"

    header = ["method", f"time to {target:.3f} (GRPO's {grpo_steps}-step acc.)", f"acc. at GRPO's {budget:.0f} s",
              "gen. tokens / trained token", "steps", "s/step"]
    body = [[r["label"], fmt_time(r), f"{r['acc_at_budget']:.3f}", f"{r['gen_per_trained_token']:.2f}",
             str(r["steps"]), f"{r['sec_per_step']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def plot(rows: list[dict], target: float, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for r in rows:
        ts, accs = zip(*r["curve"])
        ref = r["method"] == REFERENCE
        ax.plot(ts, accs, marker="o", ms=3, lw=2.2 if ref else 1.3, color="black" if ref else None,
                label=r["label"])
    ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"GRPO's final accuracy {target:.3f}")
    ax.set_xlabel("training wall time, evaluation excluded (s)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> dict:
    import torch
    import transformers
    import trl

    return {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def run_benchmark(task: Task, methods: list[Method], *, grpo_steps: int, eval_points: int, seed: int, out: str,
                  max_steps_factor: float = 3.0, progress=print) -> dict:
    """The whole protocol (module docstring); writes the JSON, the table and the plot to `out`, returns the JSON."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(out, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    base = AutoModelForCausalLM.from_pretrained(task.model_dir)
    before = task.evaluate(base, tokenizer)
    del base
    progress(f"time-to-accuracy: held-out accuracy before training {before:.3f}")
    rows, budget = [], None
    work = tempfile.mkdtemp(prefix="tta-")
    for method in methods:
        progress(f"time-to-accuracy: {method.label}")
        steps = grpo_steps if budget is None else max(grpo_steps, int(math.ceil(grpo_steps * max_steps_factor)))
        try:
            row = run_method(method, task, steps=steps, seed=seed, output_dir=work, budget_s=budget,
                             eval_points=eval_points, before=before, progress=progress)
        except Exception as e:  # one broken method must not hide the others
            if budget is None:
                raise
            progress(f"  {method.name}: failed: {type(e).__name__}: {e}")
            rows.append({"method": method.name, "label": method.label, "error": f"{type(e).__name__}: {e}"})
        else:
            rows.append(row)
            if budget is None:
                budget = row["train_seconds"]
        # after every method, so that a run stopped part-way keeps what it measured
        result = write_results(rows, task, before=before, grpo_steps=grpo_steps, eval_points=eval_points, seed=seed,
                               out=out)
    return result


def write_results(rows: list[dict], task: Task, *, before: float, grpo_steps: int, eval_points: int, seed: int,
                  out: str) -> dict:
    """The JSON, the table and the plot of the methods run so far (`rows`, the reference first) to `out`."""
    ok = [r for r in rows if "error" not in r]
    summary = summarize(ok)
    table = format_table(ok, summary["target"], summary["budget_s"], grpo_steps)
    failed = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
    result = {"task": task.describe, "before": before, "grpo_steps": grpo_steps, "eval_points": eval_points,
              "seed": seed, "common": {k: v for k, v in task.common.items() if isinstance(v, (int, float, str))},
              **summary, "rows": rows, "failed": failed, "machine": machine()}
    with open(os.path.join(out, "time_to_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "time_to_accuracy.md"), "w") as f:
        f.write(table + "\n" + "".join(f"\nfailed: {x}" for x in failed) + "\n")
    plot(ok, summary["target"], os.path.join(out, "time_to_accuracy.png"),
         f"{task.describe}; budget = GRPO's {grpo_steps} steps ({summary['budget_s']:.0f} s)")
    result["table"] = table
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=None, help=f"comma-separated, among {', '.join(METHODS)} (default: "
                        f"{','.join(DEFAULT_METHODS)}); trl.GRPOTrainer ('grpo') is always run first")
    parser.add_argument("--grpo-steps", type=int, default=20, help="the reference's steps (its time is the budget)")
    parser.add_argument("--eval-points", type=int, default=8, help="held-out evaluations per run (besides step 0)")
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--max-steps-factor", type=float, default=3.0,
                        help="a method stops at this many times the reference's steps even within the budget")
    parser.add_argument("--num-generations", type=int, default=None,
                        help="group size G (default the demo's 4; the batch stays 4 prompts a step): SPEED's own "
                             "runs screen 4 of 16-24")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=DEFAULT_OUT)
    opts = parser.parse_args(argv)
    try:
        methods = select_methods(opts.methods)
    except ValueError as e:
        print(f"time_to_accuracy: error: {e}", file=sys.stderr)
        return 2
    if min(opts.grpo_steps, opts.eval_points, opts.eval_prompts, opts.eval_samples) < 1:
        print("time_to_accuracy: error: --grpo-steps, --eval-points, --eval-prompts, --eval-samples: expected "
              "integers >= 1", file=sys.stderr)
        return 2
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)  # a real model: every core (the demo does the same)
    task = smollm2_task(opts.seed, opts.eval_prompts, opts.eval_samples, num_generations=opts.num_generations)
    result = run_benchmark(task, methods, grpo_steps=opts.grpo_steps, eval_points=opts.eval_points, seed=opts.seed,
                           out=opts.out, max_steps_factor=opts.max_steps_factor,
                           progress=lambda s: print(s, flush=True))
    print()
    print(result["table"])
    print(f"\ntime_to_accuracy: results -> {opts.out}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
