"""The quick path (`make demo-toy`): every algorithm of the package on a toy task, offline, on a laptop CPU, in
about a minute. The main job, on a real pretrained model, is `trl_ppo_variants.demo` (`make demo`).

    python -m trl_ppo_variants.toy_demo [--algo NAME[,NAME...] | --algo all] [--output_dir ./demo_output/toy]

Builds the tiny model and the toy addition task that ship with the package (`trl_ppo_variants/toy.py`), warm-starts
the model briefly (so that it is right on about half of the prompts: RL needs reward variance), then trains a copy of
it with each installed algorithm (or the ones named), with a progress bar. It prints a table (algorithm, sampled reward
before -> after, seconds per step) and writes the reward curves (`reward_curves.png`) and each trained model with its
model card (`<algorithm>/`) to the output folder.

"Reward" in the table is the mean reward of 8 seeded samples (at the training temperature) on each of the 25 prompts
`a+b=` (0 <= a, b <= 4): the same measure for every algorithm (TTRL never sees it during training: it learns from its
own majority vote). The curves are the mean reward of the sampled completions at each step, as logged by the trainer
(TTRL: agreement with the vote).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .algorithms import ALGORITHMS, REGISTRY, installed, parse_algorithm_list  # noqa: E402

#: per-algorithm settings on top of `COMMON` (toy scale: 4 completions per prompt, answers of at most 3 tokens):
#: `Algorithm.toy_demo` in `algorithms.py`, where each is explained
ALGO_SETTINGS: dict[str, dict] = {name: a.toy_demo for name, a in REGISTRY.items()}


def first_number(completion) -> str | None:
    """TTRL's answer extractor for the toy task: the first number, as `toy.addition_reward` reads it (the built-in
    `math` extractor takes the last number, which differs on a truncated completion such as `"7+3"`)."""
    from .rewards import completion_text

    match = re.search(r"-?\d+", completion_text(completion))
    return match.group(0) if match else None


from .demo import RUN_SETTINGS  # noqa: E402 - after the offline environment is set

COMMON = dict(
    per_device_train_batch_size=64,  # 16 prompts x 4 completions: a toy step is overhead-bound, so this is ~free
    num_generations=4,
    max_completion_length=3,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    temperature=0.7,  # near the greedy policy: the toy learns within tens of steps (at 1.0 every algorithm is slow)
    beta=0.0,
    **RUN_SETTINGS,
)

DEFAULT_STEPS = 40
EVAL_SAMPLES = 8  # samples per prompt for the before/after reward: 25 prompts x 8 = 200 completions
WARM_STEPS = 25


def _progress_callback(total: int, label: str):
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=total, desc=f"{label:<22}", unit="step", leave=True, file=sys.stderr)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.bar.set_postfix(reward=f"{logs['reward']:.2f}")

        def on_step_end(self, args, state, control, **kwargs):
            self.bar.update(1)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return Progress()


def build_trainer(algo: str, base_dir: str, output_dir: str, steps: int, seed: int, model=None, callbacks=(),
                  **overrides):
    """A trainer of `algo` on `model` (default: a fresh copy of the toy model in `base_dir`), with `COMMON` and the
    algorithm's settings (`overrides` on top: e.g. a vLLM engine) and a data set of `steps` batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .demo import algorithm_rewards
    from .toy import addition_dataset, addition_reward

    config_cls, trainer_cls = REGISTRY[algo].classes()
    settings = {**COMMON, **ALGO_SETTINGS.get(algo, {}), **overrides}
    settings.update(output_dir=os.path.join(output_dir, algo), max_steps=steps, seed=seed)
    if "n_votes" in settings:  # TTRL: n_votes sets num_generations; the batch counts generated completions
        settings.pop("num_generations")
        settings["per_device_train_batch_size"] = max(settings["per_device_train_batch_size"], 2 * settings.get("n_votes", 8))
    fields = set(config_cls.__dataclass_fields__)
    args = config_cls(**{k: v for k, v in settings.items() if k in fields})
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    reward_funcs, extra = algorithm_rewards(algo, addition_reward)
    return trainer_cls(
        model=model if model is not None else AutoModelForCausalLM.from_pretrained(base_dir),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=addition_dataset(steps * args.per_device_train_batch_size, seed=seed),
        processing_class=tokenizer,
        callbacks=list(callbacks),
        **extra,
    )


def train_one(algo: str, base_dir: str, output_dir: str, steps: int, seed: int) -> dict:
    """Train a fresh copy of the warm-started toy model with `algo`; returns its row of the table and its curve."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    before = sampled_reward(model, tokenizer, COMMON["temperature"], seed)
    trainer = build_trainer(algo, base_dir, output_dir, steps, seed, model=model,
                            callbacks=[_progress_callback(steps, algo)])
    args = trainer.args
    trainer.remove_callback(PrinterCallback)  # the progress bar replaces the per-step dict printout
    torch.manual_seed(seed)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = sampled_reward(trainer.model, tokenizer, args.temperature, seed)
    trainer.save_model(args.output_dir)
    trainer.create_model_card(model_name=f"toy-{algo}")
    curve = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    steps_done = max(trainer.state.global_step, 1)
    return {"algorithm": algo, "before": before, "after": after, "sec_per_step": seconds / steps_done,
            "steps": steps_done, "curve": curve, "model_dir": args.output_dir, "log_history": trainer.state.log_history}


def sampled_completions(model, tokenizer, temperature: float, seed: int, n: int = EVAL_SAMPLES):
    """`n` seeded samples per prompt over the 25 prompts (deterministic for a given model): (texts, answers), the
    samples of a prompt consecutive."""
    import torch

    from .toy import addition_examples

    examples = addition_examples(4)
    enc = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        torch.manual_seed(seed + 12345)
        out = model.generate(**enc, max_new_tokens=COMMON["max_completion_length"], do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts, [e["answer"] for e in examples for _ in range(n)]


def sampled_scores(model, tokenizer, temperature: float, seed: int, n: int = EVAL_SAMPLES) -> tuple[float, float]:
    """Two measures of the same seeded samples (`sampled_completions`): the mean toy reward, and the share that agree
    with their prompt's majority answer (TTRL's `majority_ratio`, the objective it trains on without labels; answers
    read by `first_number`)."""
    from .rewards import majority_vote_rewards
    from .toy import addition_reward

    texts, answers = sampled_completions(model, tokenizer, temperature, seed, n)
    rewards = addition_reward(texts, answers)
    _, agree = majority_vote_rewards([first_number(t) for t in texts], n)
    return sum(rewards) / len(rewards), sum(agree) / len(agree)


def sampled_reward(model, tokenizer, temperature: float, seed: int, n: int = EVAL_SAMPLES) -> float:
    """Mean toy reward of `n` seeded samples per prompt over the 25 prompts (deterministic for a given model)."""
    return sampled_scores(model, tokenizer, temperature, seed, n)[0]


def format_table(rows: list[dict]) -> str:
    from .demo import text_table

    return text_table(["algorithm", "reward before -> after", "s/step"],
                      [(r["algorithm"], r["error"] if "error" in r else
                        [f"{r['before']:.2f} -> {r['after']:.2f}", f"{r['sec_per_step']:.3f}"]) for r in rows])


def plot_curves(rows: list[dict], path: str) -> str | None:
    from .demo import curve_label, pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        curve = r.get("curve") or []
        if not curve:
            continue
        window = 5  # moving average: a toy batch is 16 completions, so one step's mean is noisy
        smooth = [sum(curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1])
                  for i in range(len(curve))]
        ax.plot(range(1, len(curve) + 1), smooth, label=curve_label(r["algorithm"]))
    ax.set_xlabel("step")
    ax.set_ylabel("mean sampled reward (moving average, 5 steps)")
    ax.set_title("trl-ppo-variants demo: toy addition task, tiny Qwen3")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_ppo_variants.toy_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default=None,
                        help="'all' (the default: every installed algorithm) or comma-separated names")
    parser.add_argument("--output_dir", default="./demo_output/toy", help="where the plot and models go")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="RL steps per algorithm")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)

    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        algos = parse_algorithm_list(opts.algo or "all")
    except ValueError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    missing = [a for a in ALGORITHMS if a not in installed()]
    if missing and not opts.algo:
        print(f"demo: not installed, skipped: {', '.join(missing)}", file=sys.stderr)

    import transformers

    from .toy import make_toy_checkpoint

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # weight loading/saving bars would interleave with ours
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass
    os.makedirs(opts.output_dir, exist_ok=True)
    base_dir = os.path.join(opts.output_dir, "base_model")
    print(f"demo: building the tiny model and warm-starting it ({WARM_STEPS} supervised steps) -> {base_dir}")
    make_toy_checkpoint(base_dir, seed=opts.seed, warm_steps=WARM_STEPS)

    rows = []
    for algo in algos:
        try:
            rows.append(train_one(algo, base_dir, opts.output_dir, opts.steps, opts.seed))
        except Exception as e:  # one broken algorithm must not hide the others' results
            rows.append({"algorithm": algo, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"})
    print()
    print(format_table(rows))
    plot = plot_curves([r for r in rows if "error" not in r], os.path.join(opts.output_dir, "reward_curves.png"))
    print()
    if plot:
        print(f"demo: reward curves -> {plot}")
    print(f"demo: trained models (with model cards) -> {os.path.join(opts.output_dir, '<algorithm>')}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
