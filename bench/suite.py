"""The benchmark suite (`make bench`): every trainer of the package against TRL's `GRPOTrainer` (and TRL's
`RLOOTrainer` as a peer) on the tiny offline model and the toy addition task.

What it measures, and how:

* **Seconds per optimizer step**, all trainers in ONE process, interleaved step by step: each trainer's real
  `Trainer.train()` runs in its own thread and a callback parks it after every optimizer step; a scheduler releases
  one trainer at a time, round after round (rotating the order), so that machine drift (other jobs on the cores,
  frequency changes) hits every trainer alike. A step is timed from its release to its `on_step_end` (so it holds
  generation, scoring, advantages, the loss, the optimizer step and the previous step's logging). The ratio to GRPO is
  the median over rounds of the paired per-round ratio, which cancels drift better than a ratio of medians.
* **Peak memory (RSS)** cannot be told apart per trainer inside one process (one heap, one high-water mark), so each
  configuration runs a few steps in a FRESH subprocess, one after the other: peak RSS (`VmHWM`) and the peak above
  the process's RSS after its imports (the part the trainer itself adds: models, optimizer states, activations).
  The subprocess sets glibc's mmap threshold to a fixed 128 KiB (`mallopt`, as `MALLOC_MMAP_THRESHOLD_=131072`):
  every tensor buffer is then mapped on its own and unmapped when freed, so the RSS follows the bytes the trainer
  holds. With glibc's default (a threshold that rises to the largest block freed so far) buffers of up to 32 MiB come
  from the heap and stay in the RSS after they are freed: on SmolLM2 that retention was 0.4-1.3 GB per row and
  differed from row to row (PPO with a LoRA critic: 1.22x GRPO's RSS by default, 1.02x with the fixed threshold; the
  live tensors at the step start differ by the adapter's 60 MB). `--glibc-default-malloc` measures the old way.
  The memory runs use a somewhat larger model (hidden 256, 4 layers by default) so that the part the trainer adds is
  not lost in the ~0.5 GB of the interpreter and libraries; the ratio is taken on that part.
* For DAPO: generated tokens per trained token, generation rounds per step, and the step time per generated token
  (its target). For TTRL: `n_votes = G` (its target) and `n_votes = 2 n_train` (cost of extra votes).
* Reward curves (the logged mean reward per step) and the greedy accuracy on the 25 toy prompts, for every
  trainer over the same steps, as one PNG.

Writes `suite.md`, `suite.json` (with the machine description) and `reward_curves.png` to `--out`
(default `bench/results/`). A trainer whose module does not exist yet, or that fails, is listed as skipped with the
reason. `--quick` is a short smoke run. Run `python bench/suite.py --help`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(TRANSFORMERS_VERBOSITY="error")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import algos  # noqa: E402  (bench/algos.py)

DEFAULT_OUT = os.path.join(HERE, "results")


# ------------------------------------------------------------------------------------------------ tasks
class Task:
    """What a suite run trains on: a model folder, a training set, a reward, and the task's default settings."""

    def __init__(self, name, describe, defaults, rows=None, config=None, threads=1):
        self.name, self.describe, self.defaults, self.rows = name, describe, defaults, rows
        self.config = config or {}  # config fields of every row
        # torch threads of the timing process and the memory runs (one trainer runs at a time in either): the tiny
        # model's matmuls are too small to gain from more than one; 0 = every core
        self.threads = threads

    def num_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def model_dir(self, args, work) -> str:
        if self.name == "smollm2":
            from trl_ppo_variants.smollm2 import smollm2_checkpoint

            return smollm2_checkpoint()
        from trl_ppo_variants.toy import make_toy_checkpoint

        return make_toy_checkpoint(os.path.join(work, "toy_model"), seed=args.seed, warm_steps=25)

    def memory_model_dir(self, args, work, model_dir) -> str:
        """The model the memory runs use: the real one as it is; for the toy, a larger one (see the docstring)."""
        if self.name == "smollm2":
            return model_dir
        from trl_ppo_variants.toy import build_model, build_tokenizer, warm_start

        mem_dir = os.path.join(work, "mem_model")
        tok = build_tokenizer()
        model = build_model(tok, seed=args.seed, hidden_size=args.mem_hidden, num_layers=args.mem_layers)
        warm_start(model, tok, steps=25, seed=args.seed)
        model.save_pretrained(mem_dir)
        tok.save_pretrained(mem_dir)
        return mem_dir

    def data(self, n: int, seed: int):
        if self.name == "smollm2":
            from trl_ppo_variants.smollm2 import word_problem_dataset

            return word_problem_dataset(n, seed=seed, split="train")
        from trl_ppo_variants.toy import addition_dataset

        return addition_dataset(n, seed=seed)

    def reward(self):
        if self.name == "smollm2":
            from trl_ppo_variants.smollm2 import word_problem_reward

            return word_problem_reward
        from trl_ppo_variants.toy import addition_reward

        return addition_reward


#: the rows of the real-model table: every trainer and the KL-in-reward comparison (a step is ~100x the toy's); they
#: run in `algos`' order
SMOLLM2_ROWS = [*algos.algorithm_rows(), "trl_rloo", "grpo_ref", "trl_rloo_ref", "rloo_ref", "rloo_ref_forward",
                "reinforce_pp_ref", "ppo_ref", "ppo_lora_ref", "vapo_lora"]

TASKS = {
    "toy": Task("toy", lambda a: "Toy task, tiny Qwen3 (hidden 64, 2 layers)", {}),
    "smollm2": Task(
        "smollm2",
        lambda a: "SmolLM2-135M-Instruct (offline, fp32) on arithmetic word problems in its chat template",
        # timing groups of 3 rows (+ their baselines): 16 trainers of a 135M model with their optimizer states do not
        # fit in 24 GB at once
        dict(steps=3, warmup=1, max_len=32, lr=2e-5, acc_every=0, mem_steps=2, mem_timeout=900, group_size=3,
             out=os.path.join(DEFAULT_OUT, "smollm2")),
        rows=SMOLLM2_ROWS,
        config={"bf16": False},  # fp32, as the demo: TRL's bf16 autocast on a CPU is another benchmark
        threads=0,
    ),
}


# ------------------------------------------------------------------------------------------------ settings
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for suite.md, suite.json, reward_curves.png")
    p.add_argument("--only", default=None,
                   help="comma-separated row names (grpo is always added); known: " + ", ".join(algos.ALL))
    p.add_argument("--no-ref", action="store_true", help="skip the rows with a reference model (beta = 0.04)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-configuration RSS subprocesses")
    p.add_argument("--memory-only", action="store_true",
                   help="only the memory runs: write memory.json and print each row's trainer RSS and its ratio to "
                        "its baseline row (no timing)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 warm-up + 4 measured steps, 2 memory steps, no reference rows")
    p.add_argument("--steps", type=int, default=30, help="measured steps per trainer (also the curves' length)")
    p.add_argument("--warmup", type=int, default=2, help="steps per trainer excluded from the timings")
    p.add_argument("--batch", type=int, default=16, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (num_generations), G")
    p.add_argument("--max-len", type=int, default=6, help="max_completion_length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acc-every", type=int, default=5, help="greedy accuracy every N steps (0: never)")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mem-hidden", type=int, default=256)
    p.add_argument("--mem-layers", type=int, default=4)
    p.add_argument("--mem-timeout", type=int, default=300)
    p.add_argument("--glibc-default-malloc", action="store_true",
                   help="memory runs with glibc's default (dynamic) mmap threshold: freed buffers of up to 32 MiB stay "
                        "in the RSS (the numbers before 2026-12-04 21:40 were measured so)")
    p.add_argument("--group-size", type=int, default=0,
                   help="time the rows in groups of this many, each with the baselines and peers its rows compare "
                        "against (0: all in one group); ratios stay paired within a group")
    p.add_argument("--memory-from", default=None,
                   help="read the memory results from this memory.json (written by an earlier run with the same "
                        "settings) instead of measuring them")
    p.add_argument("--model", choices=sorted(TASKS), default="toy",
                   help="toy: the tiny model of trl_ppo_variants.toy on single-digit addition (the fast path); "
                        "smollm2: the real SmolLM2-135M-Instruct (offline, trl_ppo_variants.smollm2) on arithmetic "
                        "word problems, with its own defaults (--steps 3 --warmup 1 --max-len 32 --lr 2e-5, "
                        "temperature 1.0, the rows of SMOLLM2_ROWS, results in bench/results/smollm2/)")
    args = p.parse_args(argv)
    task = TASKS[args.model]
    for key, value in task.defaults.items():  # a task's defaults, unless given on the command line
        flag = "--" + key.replace("_", "-")
        if not any(a == flag or a.startswith(flag + "=") for a in (argv if argv is not None else sys.argv[1:])):
            setattr(args, key, value)
    if args.quick:
        args.steps, args.warmup, args.mem_steps, args.no_ref = min(args.steps, 4), 1, 2, True
        args.acc_every = 2 if args.acc_every else 0
    return args


def selected(args) -> list:
    rows = list(algos.ALGOS) + ([] if args.no_ref else list(algos.ALGOS_REF))
    task_rows = TASKS[args.model].rows
    if task_rows is not None:
        rows = [a for a in rows if a.name in task_rows]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in algos.ALL]
        if unknown:
            raise SystemExit(f"--only: unknown rows {unknown}; known: {', '.join(algos.ALL)}")
        wanted = (set(names) | {algos.ALL[n].baseline for n in names} | {"grpo"}
                  | {algos.ALL[n].peer for n in names if algos.ALL[n].peer})
        rows = [a for a in rows if a.name in wanted]
    return rows


def build_trainer(algo, args, model_dir, out_dir, callbacks=(), max_steps=None):
    """Construct the trainer of row `algo` with the shared settings; raises on failure."""
    from transformers import AutoTokenizer

    task = TASKS[args.model]
    config_cls, trainer_cls = algo.load()
    kwargs = dict(
        output_dir=os.path.join(out_dir, algo.name),
        per_device_train_batch_size=args.batch * algo.batch_scale,
        max_completion_length=args.max_len,
        max_steps=max_steps if max_steps is not None else args.warmup + args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        **task.config,
        seed=args.seed,
        save_strategy="no",
        disable_tqdm=True,
    )
    if algo.reward != "own":  # TTRL sets num_generations from n_votes
        kwargs["num_generations"] = args.group
    kwargs.update(algo.overrides(args.group))
    config = config_cls(**kwargs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    common = dict(args=config, train_dataset=task.data(512, args.seed), processing_class=tokenizer,
                  callbacks=list(callbacks))
    if algo.reward == "own":
        return trainer_cls(model_dir, **common)
    return trainer_cls(model_dir, task.reward(), **common)


# ------------------------------------------------------------------------------------------------ interleaving
class Stepper:
    """A `TrainerCallback` that parks its trainer's thread after every optimizer step until released."""

    def __init__(self, name, tokenizer, acc_every):
        from transformers import TrainerCallback

        stepper = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                stepper._accuracy(model, 0)
                stepper._pause()

            def on_step_end(self, args, state, control, model=None, **kwargs):
                stepper._record(state.global_step)
                if stepper.acc_every and state.global_step % stepper.acc_every == 0:
                    stepper._accuracy(model, state.global_step)
                stepper._pause()

        self.callback = _Callback()
        self.name = name
        self.tokenizer = tokenizer
        self.acc_every = acc_every
        self.go = threading.Event()
        self.done = threading.Event()
        self.meter = None
        self._last = None
        self._t0 = None
        self.steps = []  # one dict per optimizer step: seconds + the meter's deltas
        self.accuracy = []  # (step, greedy accuracy)
        self.error = None
        self.finished = False
        self.rng = None  # this trainer's own torch RNG state, swapped in while it runs
        self.keep_rate = None  # DAPO: observed fraction of generated groups with a reward spread

    def _pause(self):
        self.done.set()
        self.go.wait()
        self.go.clear()
        self._last = self.meter.snapshot() if self.meter else None
        self._t0 = time.perf_counter()

    def _record(self, step):
        seconds = time.perf_counter() - self._t0
        row = {"step": step, "seconds": seconds}
        if self.meter is not None:
            row.update(algos.delta(self.meter.snapshot(), self._last))
        self.steps.append(row)

    def _accuracy(self, model, step):
        if self.acc_every and model is not None:
            from trl_ppo_variants.toy import greedy_accuracy

            self.accuracy.append((step, greedy_accuracy(model, self.tokenizer)))

    def release(self, timeout):
        """Let the trainer run one optimizer step (or finish); False if it failed or did not come back in time.

        The trainers share one process-wide torch RNG; each gets its own stream back while it runs, so that its
        sampling (hence its completion lengths, which drive the step time) does not depend on the interleaving:
        from the same seed and checkpoint, every trainer samples the same first completions."""
        import torch

        if self.rng is not None:
            torch.set_rng_state(self.rng)
        self.done.clear()
        self.go.set()
        ok = self.done.wait(timeout)
        self.rng = torch.get_rng_state()
        if not ok:
            self.error = f"no step completed within {timeout} s"
            return False
        return self.error is None and not self.finished


def _quiet(trainer):
    """Drop the callbacks that print every log dict (the suite prints its own progress)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def timing_groups(rows, size: int) -> list[list]:
    """The rows split into groups timed one after the other: at most `size` rows of their own per group, each group
    led by the baselines and peers its rows are compared with (paired per round, so they must run in the same group).
    A baseline's own result comes from the first group that times it."""
    if size <= 0:
        return [list(rows)]
    by_name = {a.name: a for a in rows}
    anchors = {a.baseline for a in rows} | {a.peer for a in rows if a.peer}
    own = [a for a in rows if a.name not in anchors]
    groups = []
    for i in range(0, len(own), size):
        part, lead = own[i:i + size], []
        todo = [n for a in part for n in (a.baseline, a.peer) if n]
        while todo:  # a peer's own baseline too
            name = todo.pop(0)
            if name in by_name and by_name[name] not in lead and by_name[name] not in part:
                lead.append(by_name[name])
                todo += [n for n in (by_name[name].baseline, by_name[name].peer) if n]
        groups.append(sorted(lead, key=list(rows).index) + part)
    placed = {a.name for g in groups for a in g}
    rest = [a for a in rows if a.name not in placed]
    return groups + ([rest] if rest else [])


def run_interleaved(rows, args, model_dir, work):
    """Build every trainer, then step them round-robin in one process. Returns ({name: Stepper}, {name: reason})."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    steppers, trainers, skipped = {}, {}, {}
    for algo in rows:
        stepper = Stepper(algo.name, tokenizer, args.acc_every)
        try:
            torch.manual_seed(args.seed)
            trainer = build_trainer(algo, args, model_dir, work, callbacks=[stepper.callback])
        except algos.MissingTrainer as e:
            skipped[algo.name] = f"skipped: {e}"
            continue
        except Exception as e:
            skipped[algo.name] = f"construction failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        stepper.meter = algos.Meter(trainer)
        _quiet(trainer)
        steppers[algo.name], trainers[algo.name] = stepper, trainer

    threads = {}
    for name, stepper in steppers.items():
        def target(trainer=trainers[name], stepper=stepper):
            try:
                trainer.train()
            except BaseException as e:  # reported in the table; the other trainers go on
                stepper.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                traceback.print_exc()
            finally:
                stepper.finished = True
                stepper.done.set()

        threads[name] = threading.Thread(target=target, name=f"bench-{name}", daemon=True)
        torch.manual_seed(args.seed)
        threads[name].start()
        stepper.done.wait(600)  # parked in on_train_begin (or failed)
        torch.manual_seed(args.seed)  # every trainer's first step starts from the same RNG state
        stepper.rng = torch.get_rng_state()

    total = args.warmup + args.steps
    live = [n for n, s in steppers.items() if s.error is None and not s.finished]
    t_start = time.perf_counter()
    for r in range(total):
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for name in order:
            steppers[name].release(timeout=600)
        live = [n for n in live if steppers[n].error is None and not steppers[n].finished]
        print(f"  round {r + 1}/{total} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    for name, stepper in steppers.items():  # let train() return
        if not stepper.finished:
            stepper.go.set()
        threads[name].join(timeout=120)
    for name, stepper in steppers.items():
        if stepper.error is not None:
            skipped[name] = f"failed during training: {stepper.error}"
    curves = {}
    for name, trainer in trainers.items():
        curves[name] = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h and "step" in h]
        dapo = [h for h in trainer.state.log_history if "dapo/groups_generated" in h and h.get("step", 0) > args.warmup]
        if dapo:  # DAPO: the fraction of generated groups with a reward spread over the measured steps
            total = sum(h["dapo/groups_generated"] for h in dapo)
            dropped = sum(h["dapo/groups_generated"] * (h["dapo/frac_dropped_all_correct"]
                                                        + h["dapo/frac_dropped_all_wrong"]) for h in dapo)
            steppers[name].keep_rate = (total - dropped) / total
    return steppers, curves, skipped


# ------------------------------------------------------------------------------------------------ memory
def _status_kib(field_name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return None


# What every configuration's memory child has imported before its baseline is read (the forkserver preloads it).
PRELOAD = ["torch", "transformers", "datasets", "trl", "trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer",
           "trl_ppo_variants.toy", "trl_ppo_variants.smollm2", "trl_ppo_variants.trainers.base", "algos", "suite"]


def return_freed_memory() -> bool:
    """Make glibc map every allocation over 128 KiB on its own and unmap it when freed (and trim the heap past 128 KiB
    of free space), so that the RSS follows the bytes held; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>; setting either fixes it (no dynamic adjustment)
    return bool(mallopt(m_mmap_threshold, 128 * 1024)) and bool(mallopt(m_trim_threshold, 128 * 1024))


def _memory_worker(name, model_dir, argv, out_path):
    """In a process forked from the forkserver (libraries imported, nothing else): RSS now, then a few training
    steps of row `name`, then the high-water mark. Linux starts a forked child's `VmHWM` at its RSS at fork."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    result = {}
    try:
        import torch

        args = parse_args(argv)
        allocator = "glibc default" if args.glibc_default_malloc else (
            "mmap threshold 128 KiB" if return_freed_memory() else "default (not glibc)")
        torch.set_num_threads(TASKS[args.model].num_threads())
        algo = algos.ALL[name]
        algo.load()  # its module is imported before the baseline, like the libraries
        with tempfile.TemporaryDirectory() as work:
            base_kib = _status_kib("VmRSS")
            trainer = build_trainer(algo, args, model_dir, work, max_steps=args.mem_steps)
            _quiet(trainer)
            trainer.train()
            peak_kib = _status_kib("VmHWM")
        result = {"baseline_mb": base_kib / 1024, "peak_mb": peak_kib / 1024, "delta_mb": (peak_kib - base_kib) / 1024,
                  "allocator": allocator}
    except BaseException as e:
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip the interpreter's slow teardown


def measure_memory(rows, args, argv, mem_model_dir, work):
    """{name: {baseline_mb, peak_mb, delta_mb} or {error}}: one fresh process per configuration, one at a time.

    The processes are forked from a forkserver that has only imported the libraries (`PRELOAD`), so each starts
    clean without paying the ~10 s of importing TRL again."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = {}
    for algo in rows:
        out = os.path.join(work, f"mem_{algo.name}.json")
        t0 = time.perf_counter()
        # not a daemon: a reward function may start its own worker process (math-verify does); killed on timeout below
        proc = ctx.Process(target=_memory_worker, args=(algo.name, mem_model_dir, argv, out))
        proc.start()
        proc.join(args.mem_timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            results[algo.name] = {"error": f"timed out after {args.mem_timeout} s"}
        elif not os.path.exists(out):
            results[algo.name] = {"error": f"exit code {proc.exitcode}"}
        else:
            with open(out) as f:
                results[algo.name] = json.load(f)
        shown = {k: round(v) if isinstance(v, float) else v for k, v in results[algo.name].items()}
        print(f"  memory {algo.name}: {shown} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


# ------------------------------------------------------------------------------------------------ report
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _bootstrap_ci(ratios, n=2000, level=0.9, seed=0):
    """Percentile bootstrap interval of the median of the per-round ratios: how much the shared machine's noise
    leaves the ratio uncertain."""
    import random

    if len(ratios) < 3:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return [meds[int(n * (1 - level) / 2)], meds[int(n * (1 + level) / 2) - 1]]


def summarize(rows, steppers, memory, skipped, args):
    """One result dict per row (ratios against the row's baseline, paired per round)."""
    results = []
    measured = {n: s.steps[args.warmup:] for n, s in steppers.items()}
    for algo in rows:
        res = {"name": algo.name, "label": algo.label, "baseline": algo.baseline}
        if algo.peer:
            res["peer_label"] = algos.ALL[algo.peer].label
        if algo.name in skipped:
            res["status"] = skipped[algo.name]
        if algo.name not in measured or algo.name in skipped:
            res.setdefault("status", "not run")
            results.append(res)
            continue
        steps = measured[algo.name]
        base = measured.get(algo.baseline) if algo.baseline not in skipped else None
        res["status"] = "ok"
        res["steps_measured"] = len(steps)
        res["median_step_s"] = _median([s["seconds"] for s in steps])
        gen = sum(s["gen_tokens"] for s in steps)
        trained = sum(s["trained_tokens"] for s in steps)
        res["gen_tokens_per_step"] = gen / len(steps) if steps else None
        res["gen_per_trained_token"] = gen / trained if trained else None
        res["rounds_per_step"] = sum(s["gen_calls"] for s in steps) / len(steps) if steps else None
        gen_time = sum(s["gen_time"] for s in steps)
        res["gen_tokens_per_s"] = gen / gen_time if gen_time else None
        res["rollout_share"] = (sum(s["rollout_time"] for s in steps) / sum(s["seconds"] for s in steps)
                                if steps else None)
        if steppers[algo.name].keep_rate is not None:
            res["keep_rate"] = steppers[algo.name].keep_rate
        if base:
            pairs = list(zip(steps, base))
            ratios = [a["seconds"] / b["seconds"] for a, b in pairs]
            res["time_ratio"] = _median(ratios)
            res["time_ratio_ci90"] = _bootstrap_ci(ratios)
            per_token = [(a["seconds"] / a["gen_tokens"]) / (b["seconds"] / b["gen_tokens"])
                         for a, b in pairs if a["gen_tokens"] and b["gen_tokens"]]
            res["per_gen_token_ratio"] = _median(per_token)
            res["per_gen_token_ratio_ci90"] = _bootstrap_ci(per_token)
        peer = measured.get(algo.peer) if algo.peer and algo.peer not in skipped else None
        if peer:  # paired per round, like the baseline's ratio
            peer_ratios = [a["seconds"] / b["seconds"] for a, b in zip(steps, peer)]
            res["peer_ratio"] = _median(peer_ratios)
            res["peer_ratio_ci90"] = _bootstrap_ci(peer_ratios)
        mem = memory.get(algo.name)
        if mem is not None:
            res["memory"] = mem
            bmem = memory.get(algo.baseline)
            if "delta_mb" in mem and bmem and "delta_mb" in bmem and bmem["delta_mb"] > 0:
                res["mem_ratio"] = mem["delta_mb"] / bmem["delta_mb"]
                res["peak_rss_ratio"] = mem["peak_mb"] / bmem["peak_mb"]
        verdict, words = algos.target_check(algo, res, args.group)
        res["target"], res["verdict"] = words, verdict
        judged = algos.target_bound(algo, args.group)
        reaches = judged and (res.get(judged[0] + "_ci90") or [judged[1]])[0] <= judged[1]
        if algo.peer and res.get("peer_ratio") is not None and res["peer_ratio"] >= 1.0:  # beaten by the peer
            reaches = reaches and (res.get("peer_ratio_ci90") or [1.0])[0] < 1.0
        if verdict == "MISS" and reaches:
            res["verdict"] = "MISS (within noise: the 90% CI reaches the bound)"
        results.append(res)
    return results


def _fmt(x, spec=".2f", suffix=""):
    return "" if x is None else f"{x:{spec}}{suffix}"


def markdown(results, machine, args):
    task = TASKS[args.model]
    memory_model = ("the same model" if task.name == "smollm2"
                    else f"a hidden-{args.mem_hidden}, {args.mem_layers}-layer model")
    lines = [
        f"{task.describe(args)}; batch {args.batch} completions, G = {args.group}, "
        f"max_completion_length {args.max_len}, lr {args.lr:g}; {args.warmup} warm-up + {args.steps} measured steps "
        f"per trainer, interleaved in one process; memory: {args.mem_steps} steps in a fresh process per row on "
        f"{memory_model}. {machine['date']}, {machine['cpu']}, "
        f"{machine['cores_usable']} cores, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"trl {machine['trl']} (1-min load average at start {machine.get('load_average_1min', '?')}).",
        "",
        "| trainer | s/step (median) | time vs GRPO [90% CI] | trainer RSS MB (vs GRPO) | peak RSS MB | gen tok/s "
        "| gen tok / trained tok | rounds / step | target | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']} | | | | | | | | |")
            continue
        mem = r.get("memory", {})
        if "error" in mem:
            mem_cell, peak_cell = f"error: {mem['error'][:60]}", ""
        else:
            mem_cell = _fmt(mem.get("delta_mb"), ".0f") + (
                f" ({r['mem_ratio']:.2f}x)" if r.get("mem_ratio") is not None else "")
            peak_cell = _fmt(mem.get("peak_mb"), ".0f")
        ratio = _fmt(r.get("time_ratio"), ".2f", "x")
        if r.get("time_ratio_ci90") and r["name"] != r["baseline"]:
            ratio += " [{:.2f}, {:.2f}]".format(*r["time_ratio_ci90"])
        if r["name"] == "dapo" and r.get("per_gen_token_ratio") is not None:
            ratio += f" ({r['per_gen_token_ratio']:.2f}x per generated token"
            ratio += " [{:.2f}, {:.2f}])".format(*r["per_gen_token_ratio_ci90"]) if r.get(
                "per_gen_token_ratio_ci90") else ")"
        if r["baseline"] != "grpo":
            ratio += " (vs GRPO beta=0.04)" if ratio else ""
        if r.get("peer_ratio") is not None:
            ratio += f"; {r['peer_ratio']:.2f}x {r['peer_label']}"
            ratio += " [{:.2f}, {:.2f}]".format(*r["peer_ratio_ci90"]) if r.get("peer_ratio_ci90") else ""
        lines.append(
            f"| {r['label']} | {_fmt(r['median_step_s'], '.3f')} | {ratio} | {mem_cell} | {peak_cell} "
            f"| {_fmt(r.get('gen_tokens_per_s'), '.0f')} | {_fmt(r.get('gen_per_trained_token'))} | {_fmt(r.get('rounds_per_step'))} "
            f"| {r.get('target', '')} | {r.get('verdict', '')} |"
        )
    return "\n".join(lines) + "\n"


def plot(curves, accuracy, labels, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_accuracy = any(accuracy.values())
    fig, axes = plt.subplots(1, 2 if with_accuracy else 1, figsize=(13 if with_accuracy else 8, 4.8), squeeze=False)
    ax1 = axes[0][0]
    colors = plt.get_cmap("tab20").colors
    for ax in axes[0]:
        ax.set_prop_cycle(color=colors)
    for name, pts in curves.items():
        if not pts:
            continue
        xs, ys = zip(*pts)
        k = 5  # trailing moving average: the per-step reward of 4 prompts is noisy
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        (line,) = ax1.plot(xs, smooth, label=labels[name])
        ax1.plot(xs, ys, color=line.get_color(), alpha=0.15)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("mean reward (logged; 5-step moving average)")
    ax1.set_title("training reward (TTRL: its majority-vote reward)")
    if with_accuracy:
        ax2 = axes[0][1]
        for name, pts in accuracy.items():
            if pts:
                xs, ys = zip(*pts)
                ax2.plot(xs, ys, marker="o", label=labels[name])
        ax2.set_xlabel("optimizer step")
        ax2.set_ylabel("greedy accuracy on the 25 toy prompts")
        ax2.set_title("held-out greedy accuracy")
    (axes[0][-1]).legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_table(rows, memory) -> dict:
    """Print each row's trainer RSS (VmHWM above the RSS after imports) and its ratio to its baseline row's."""
    for algo in rows:
        mem, base = memory.get(algo.name, {}), memory.get(algo.baseline, {})
        if "delta_mb" not in mem:
            print(f"{algo.label}: {mem.get('error', 'not measured')}")
            continue
        ratio = f" ({mem['delta_mb'] / base['delta_mb']:.2f}x {algos.ALL[algo.baseline].label})" \
            if "delta_mb" in base and algo.baseline != algo.name else ""
        print(f"{algo.label}: trainer RSS {mem['delta_mb']:.0f} MB{ratio}, peak {mem['peak_mb']:.0f} MB")
    return memory


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)

    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(TASKS[args.model].num_threads())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    task = TASKS[args.model]
    t_all = time.perf_counter()
    machine = algos.machine_description()
    rows = selected(args)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as work:
        model_dir = task.model_dir(args, work)
        available, missing = [], {}
        for algo in rows:
            try:
                algo.load()
                available.append(algo)
            except algos.MissingTrainer as e:
                missing[algo.name] = f"skipped: {e}"
                print(f"SKIP {algo.name}: {e}", flush=True)
        memory = {}
        if args.memory_from:
            with open(args.memory_from) as f:
                memory = json.load(f)
            print(f"memory: read from {args.memory_from}", flush=True)
        elif not args.no_memory:  # first, while no trainer thread exists in this process
            mem_dir = task.memory_model_dir(args, work, model_dir)
            print(f"memory: {len(available)} fresh processes, {args.mem_steps} steps each", flush=True)
            memory = measure_memory(available, args, argv, mem_dir, work)
            with open(os.path.join(args.out, "memory.json"), "w") as f:  # kept if the timing fails
                json.dump(memory, f, indent=1)
        if args.memory_only:
            return memory_table(rows, memory)
        steppers, curves, skipped, by_name = {}, {}, dict(missing), {}
        groups = timing_groups(available, args.group_size)
        for i, group in enumerate(groups):
            print(f"timing {len(group)} rows interleaved" + (f" (group {i + 1}/{len(groups)})" if len(groups) > 1
                                                             else "") + f": {args.warmup} + {args.steps} steps each",
                  flush=True)
            g_steppers, g_curves, g_skipped = run_interleaved(group, args, model_dir, work)
            own = [a for a in group if a.name not in by_name]
            for res in summarize(own, g_steppers, memory, {**g_skipped, **missing}, args):
                by_name[res["name"]] = res
            for a in own:
                if a.name in g_steppers:
                    steppers[a.name] = g_steppers[a.name]
                if a.name in g_curves:
                    curves[a.name] = g_curves[a.name]
                if a.name in g_skipped:
                    skipped[a.name] = g_skipped[a.name]
            del g_steppers
            gc.collect()  # this group's trainers, before the next group's are built
    results = [by_name.get(a.name) or summarize([a], {}, memory, skipped, args)[0] for a in rows]
    machine["load_average_1min_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    machine["suite_seconds"] = round(time.perf_counter() - t_all, 1)
    # the output folder relative to the repository: results name no folder of the machine that made them
    settings = {**vars(args), "out": os.path.relpath(os.path.abspath(args.out), os.path.dirname(HERE))}
    payload = {
        "machine": machine,
        "settings": settings,
        "method": {
            "time": "all trainers in one process, interleaved one optimizer step at a time (rotating order); "
                    "ratio = median over rounds of the paired per-round ratio to the baseline row",
            "memory": "fresh subprocess per row; delta_mb = VmHWM - VmRSS after imports; ratio on delta_mb",
        },
        "results": results,
        "steps": {n: s.steps for n, s in steppers.items()},
        "reward_curves": curves,
        "greedy_accuracy": {n: s.accuracy for n, s in steppers.items()},
    }
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump(payload, f, indent=1)
    table = markdown(results, machine, args)
    with open(os.path.join(args.out, "suite.md"), "w") as f:
        f.write(table)
    if not args.no_plot:
        labels = {a.name: a.label for a in rows}
        main_rows = {a.name for a in algos.ALGOS}  # the beta = 0.04 rows would double the lines
        plot({n: c for n, c in curves.items() if n in main_rows},
             {n: s.accuracy for n, s in steppers.items() if n in main_rows}, labels,
             os.path.join(args.out, "reward_curves.png"))
    print(table)
    for r in results:
        if r.get("verdict"):
            print(f"{r['verdict']}: {r['label']}: {r['target']} (measured {r.get('time_ratio', 0):.2f}x"
                  + (f", {r['per_gen_token_ratio']:.2f}x per generated token, {r['rounds_per_step']:.2f} rounds/step, "
                     f"{r['gen_per_trained_token']:.2f} gen tok / trained tok" if r["name"] == "dapo"
                     and r.get("per_gen_token_ratio") else "")
                  + (f", {r['peer_ratio']:.2f}x {r['peer_label']}" if r.get("peer_ratio") is not None else "")
                  + (f"; observed keep rate {r['keep_rate']:.2f}: any sizing generates >= 1/{r['keep_rate']:.2f} = "
                     f"{1 / r['keep_rate']:.2f} prompts per trained prompt" if r.get("keep_rate") else "")
                  + (f", memory {r['mem_ratio']:.2f}x" if r.get("mem_ratio") is not None else "") + ")")
        elif r["status"] != "ok":
            print(f"SKIP: {r['label']}: {r['status']}")
    print(f"wrote {args.out}/suite.md, suite.json" + ("" if args.no_plot else ", reward_curves.png")
          + f" in {time.perf_counter() - t_all:.0f} s")
    return payload


if __name__ == "__main__":
    main()
