"""Step time and peak memory of every trainer of the package against TRL's `GRPOTrainer` (a script, not a test).

Same tiny offline model (`trl_ppo_variants.toy`), same toy batch, same settings, no reference model (beta = 0).

* Seconds per step (process CPU time by default, `--clock wall` for wall time): all trainers are built in ONE process and run round-robin: each round, every trainer runs
  `train()` for `--steps` steps (the order rotates every round); a callback times each optimizer step and the first
  step of each call is dropped (dataloader/optimizer set-up). Per round, each trainer's median step time is divided
  by GRPO's of the same round; the table shows the median over rounds of those paired ratios, so that drift of a
  shared machine hits every trainer alike.
* Peak RSS: one process cannot tell trainers apart (one heap), so each trainer runs `--steps` steps in a FRESH
  subprocess; the table shows the peak RSS and the ratio to GRPO of the peak above the RSS after the imports (the
  part the trainer adds).

Targets (issue 2): RLOO and REINFORCE++(-baseline) <= 1.05x GRPO; ReMax <= (1 + 1/G)x + 5%.
Trainers that do not exist yet, or fail, are skipped with a note. Registry: `bench/algos.py`.

    .venv/bin/python bench/bench_trainers.py --steps 6 --rounds 7 --group-size 4 --batch-size 16

Writes `bench_trainers.md` and `bench_trainers.json` (with the machine description) to `--out`.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(1)

from algos import ALL, MissingTrainer, algorithm_rows, machine_description, target_check  # noqa: E402

DEFAULT = algorithm_rows()


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(name: str, model_dir: str, out_dir: str, opts):
    """The trainer of registry entry `name` with the shared settings and a step-timing callback."""
    from transformers import PrinterCallback, TrainerCallback

    from trl_ppo_variants.toy import addition_dataset, addition_reward

    algo = ALL[name]
    config_cls, trainer_cls = algo.load()
    g = opts.group_size
    kwargs = dict(
        output_dir=os.path.join(out_dir, name), per_device_train_batch_size=opts.batch_size * algo.batch_scale,
        num_generations=algo.group_size(g), max_completion_length=opts.max_completion_length,
        max_steps=opts.steps, learning_rate=1e-4, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        save_strategy="no", disable_tqdm=True,
    )
    kwargs.update(algo.overrides(g))
    if "num_generations" in kwargs and algo.reward == "own":
        kwargs.pop("num_generations")  # TTRL sets it from n_votes
    args = config_cls(**kwargs)
    reward = addition_reward if algo.reward == "addition" else None
    dataset = addition_dataset(opts.batch_size * algo.batch_scale * opts.steps * 4, seed=0)
    trainer = trainer_cls(model_dir, reward, args=args, train_dataset=dataset)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], None

        def on_step_begin(self, *a, **k):
            self._t0 = clock()

        def on_step_end(self, *a, **k):
            self.times.append(clock() - self._t0)

    # CPU time of this process by default: on a shared machine the wall clock mostly measures the other jobs
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.remove_callback(PrinterCallback)  # `disable_tqdm` prints every log dict otherwise
    return trainer, timer


def time_all(names, model_dir, opts):
    trainers, skipped = {}, {}
    with tempfile.TemporaryDirectory() as out_dir:
        for name in names:
            try:
                trainers[name] = build(name, model_dir, out_dir, opts)
            except MissingTrainer as e:
                skipped[name] = str(e)
            except Exception as e:  # report, do not stop the other rows
                skipped[name] = f"construction failed: {type(e).__name__}: {e}"
        if "grpo" not in trainers:
            raise SystemExit(f"GRPO could not be built: {skipped.get('grpo')}")
        rounds = []  # {name: median step seconds}
        order = list(trainers)
        for r in range(opts.rounds):
            medians = {}
            for name in order[r % len(order):] + order[: r % len(order)]:
                trainer, timer = trainers[name]
                if name in skipped:
                    continue
                timer.times.clear()
                try:
                    trainer.train()
                except Exception as e:
                    skipped[name] = f"train failed: {type(e).__name__}: {e}"
                    continue
                steady = timer.times[1:] or timer.times
                medians[name] = statistics.median(steady)
            rounds.append(medians)
            print(f"round {r + 1}/{opts.rounds}: " + ", ".join(f"{k} {v:.3f}s" for k, v in medians.items()),
                  flush=True)
    results = {}
    for name in trainers:
        if name in skipped:
            continue
        per_round = [m[name] for m in rounds if name in m and "grpo" in m]
        ratios = [m[name] / m["grpo"] for m in rounds if name in m and "grpo" in m]
        results[name] = {"step_s": statistics.median(per_round), "time_ratio": statistics.median(ratios),
                         "time_ratios": ratios}
    return results, skipped


def memory_child(name, model_dir, opts):
    """Run in a fresh process: peak RSS of `--steps` steps of one trainer."""
    base = _rss_mb()  # after the imports above
    with tempfile.TemporaryDirectory() as out_dir:
        trainer, _ = build(name, model_dir, out_dir, opts)
        trainer.train()
    peak = _rss_mb("VmHWM")  # not ru_maxrss: Linux carries the parent's high-water mark across fork + exec
    print(json.dumps({"peak_rss_mb": peak, "base_rss_mb": base}))


def memory_all(names, model_dir, opts):
    out = {}
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", name, "--model-dir", model_dir,
               "--steps", str(opts.steps), "--group-size", str(opts.group_size), "--batch-size", str(opts.batch_size),
               "--max-completion-length", str(opts.max_completion_length)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            out[name] = json.loads(lines[-1])
        else:
            out[name] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return out


def table(results, memory, skipped, opts) -> str:
    g = opts.group_size
    base_mem = memory.get("grpo", {})
    rows = ["| trainer | s/step (median) | ratio to GRPO | target | peak RSS (MB) | RSS ratio (above imports) |",
            "|---|---|---|---|---|---|"]
    for name, res in results.items():
        algo = ALL[name]
        mem = memory.get(name, {})
        ratio_mem = None
        if "peak_rss_mb" in mem and "peak_rss_mb" in base_mem:
            ratio_mem = (mem["peak_rss_mb"] - mem["base_rss_mb"]) / max(
                base_mem["peak_rss_mb"] - base_mem["base_rss_mb"], 1e-9)
            res["mem_ratio"] = ratio_mem
        verdict, words = target_check(algo, res, g)
        res["target"] = f"{verdict} ({words})" if verdict else ""
        rows.append(
            f"| {algo.label} | {res['step_s']:.3f} | {res['time_ratio']:.3f} | {res['target']} | "
            f"{mem.get('peak_rss_mb', float('nan')):.0f} | "
            f"{'' if ratio_mem is None else f'{ratio_mem:.2f}'} |"
        )
    notes = [f"- {ALL[n].label if n in ALL else n}: skipped: {why}" for n, why in skipped.items()]
    head = (f"G = {g}, {opts.batch_size} rows per step, max_completion_length = {opts.max_completion_length}, "
            f"{opts.steps} steps per call (first dropped), {opts.rounds} interleaved rounds, {opts.clock} clock; "
            "ratio = median over rounds of the paired per-round ratio.")
    return "\n".join([head, "", *rows, "", *notes]) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per train() call (the first is dropped)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved repetitions")
    p.add_argument("--group-size", type=int, default=4, help="G (num_generations)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per step (per_device_train_batch_size)")
    p.add_argument("--max-completion-length", type=int, default=4)
    p.add_argument("--trainers", nargs="*", default=DEFAULT, help=f"registry names (bench/algos.py); {DEFAULT}")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="step timer: this process's CPU time (robust on a shared machine) or wall time")
    p.add_argument("--no-memory", action="store_true", help="skip the per-trainer subprocess memory runs")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--model-dir", default=None)
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args()

    if opts.memory_child:
        memory_child(opts.memory_child, opts.model_dir, opts)
        return
    from trl_ppo_variants.toy import make_toy_checkpoint

    model_dir = opts.model_dir or make_toy_checkpoint(tempfile.mkdtemp(prefix="bench_toy_"), warm_steps=25)
    names = ["grpo"] + [n for n in opts.trainers if n != "grpo"]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise SystemExit(f"--trainers: unknown {unknown}; known: {sorted(ALL)}")
    results, skipped = time_all(names, model_dir, opts)
    memory = {} if opts.no_memory else memory_all(list(results), model_dir, opts)
    md = table(results, memory, skipped, opts)
    print(md)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "bench_trainers.md"), "w") as f:
        f.write(md)
    with open(os.path.join(opts.out, "bench_trainers.json"), "w") as f:
        # the output folder relative to the repository: results name no folder of the machine that made them
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        settings = {**vars(opts), "out": os.path.relpath(os.path.abspath(opts.out), root)}
        json.dump({"machine": machine_description(), "settings": settings, "results": results, "memory": memory,
                   "skipped": skipped}, f, indent=2)


if __name__ == "__main__":
    main()
