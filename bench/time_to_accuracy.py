"""Time to accuracy on the real model (issues 18 and 35): how soon each method gets as good as `trl.GRPOTrainer` gets
in 20 steps, with the held-out evaluation kept off the clock, on one seed or on several.

    python bench/time_to_accuracy.py                       # one seed, every method, in one process
    python bench/time_to_accuracy.py --seeds 0-4 --methods grpo,dapo,reinforce_pp,rloo --jobs 2 --eval-points 4 \
        --eval-prompts 64 --eval-samples 4 --out bench/results/smollm2/time_to_accuracy_2026-12-06  # the table
    python bench/time_to_accuracy.py --seeds 0,1,2,3,4 --methods dapo_nopen \
        --variant dapo_nopen=dapo:overlong_penalty=False --out DIR   # a variant, against the stored references
    python bench/time_to_accuracy.py --report DIR          # rebuild the multi-seed report from DIR's runs
    python bench/time_to_accuracy.py --num-generations 16  # groups of 16 (SPEED screens 4 of them)
    python bench/time_to_accuracy.py --methods grpo,grpo_speed --grpo-steps 2 --eval-points 1 --eval-prompts 4 \
        --eval-samples 1                                   # a short check (a few minutes)
    .venv-vllm/bin/python bench/time_to_accuracy.py --seeds 0,1 --methods grpo_async,dapo,dapo_async --clock wall \
        --threads 2 --eval-points 2 --eval-prompts 640 --eval-samples 1 --out DIR  # overlapped generation (issue 42)

Protocol (SmolLM2-135M-Instruct on the demo's word problems, the demo's settings: 16 completions a step in groups of
G = 4, 24 new tokens, temperature 0.7, lr 3e-5 constant, no KL, fp32 on the CPU; held-out accuracy:
`--eval-prompts` questions x `--eval-samples` samples at the training temperature,
`trl_ppo_variants.smollm2.heldout_accuracy`, the demo's measure, with its standard error over questions):

1. The reference, `trl.GRPOTrainer`, trains `--grpo-steps` (20) steps; its held-out accuracy is measured every
   `grpo_steps // eval_points` steps and after the last. Its training time `T` (evaluations excluded) is the budget,
   its last accuracy `A` the target.
2. Every other method trains from the same checkpoint with the same seed until its training clock reaches `T` (or
   `--max-steps-factor` x the reference's steps). It is evaluated at the last step end at or before each of
   `T / eval_points, 2 T / eval_points, ...` (the next step's time predicted by the mean step so far; a step that
   runs long is evaluated right after), so "reached by 0.5 T" is decided by an evaluation at a clock <= 0.5 T; it
   stops at the step end nearest to `T` (within half a step of it, its clock recorded) and is evaluated there.
3. Per method: the time to reach `A` (the training clock at the first evaluation at or above `A`: an upper bound,
   exact to one evaluation interval), as seconds and as a multiple of `T`; the accuracy at the budget (its last
   evaluation); the peak and final accuracy; generated tokens per trained token; steps and seconds per step.

The clock (`--clock`, default `work`): the CPU time of the training process (`time.process_time`) with torch on one
thread (`--threads 1`, inter-op threads too), evaluations excluded, step by step in units of a fixed probe's CPU time
measured right after each step (`WorkClock`, `SpeedProbe`: a no-grad forward of the model on a fixed 4 x 64 batch,
off the clock). On a machine shared with other jobs, wall time measures the neighbours: a process waiting for a core
accrues no CPU time, so CPU time is robust to them, but not to a core that runs slower (on this virtual machine the
same forward/backward took 1.8x the CPU time from one hour to the next: neighbours on the host's cores and caches);
the probe slows down with the step, and the ratio stays the step's work. One thread also lets two runs share 2 cores:
`--jobs 2`. CPU and wall time are recorded alongside (`curve_cpu`, `curve_wall`, every step's `probe_cpu_s`);
`--clock cpu` or `--clock wall` uses one of them as the budget instead (`wall`: a quiet machine).

Several seeds (`--seeds 0,1,2,3,4`): every (seed, method) runs in its own process (`--jobs` at a time, the seed's
reference first), writes `DIR/seed<s>/<method>.json` (its curve, every evaluation with its per-question scores, every
step's log: TRL's metrics, the clocks, generated/trained tokens and the sequences with a non-zero advantage) and
`<method>.log`, and is skipped when that file exists (`--force` reruns it): a stopped run resumes, and new methods are
added against the stored references. After every run the report is rebuilt: `DIR/time_to_accuracy.json` (every run,
the per-seed table, the means with bootstrap intervals over seeds), `time_to_accuracy.md` and
`time_to_accuracy.png` (mean held-out accuracy against training time as a fraction of each seed's budget, with a 90%
band, and each seed's curves). `--variant NAME=BASE:field=value,...` defines a method from another with some settings
changed (`dapo_nopen=dapo:overlong_penalty=False`).

Generation on a vLLM server (`grpo_server`, `dapo_server`; overlapped with training: `grpo_async`, `dapo_async`,
`max_staleness=1`): the script starts one `trl-ppo-variants vllm-serve` of the model (unpinned; `--server-url` names
another instead) and the runs use it one after the other, each syncing its policy before its first generation; run it
with vLLM's environment (`.venv-vllm`). Before an evaluation an overlapped run waits for its queued batch on the clock,
so that the evaluation, off the clock, gives the overlap no generation time. An overlapped DAPO queues its whole
first round a step ahead, over-sampled or not; `dapo_async_batch` limits it to the dataloader's batch
(`max_oversample_factor=1`), what could be queued ahead before the first round was planned ahead. The wall
clock (`--clock wall`, a quiet machine) is the one that sees the overlap: the CPU clocks count the trainer's process
only. The report adds the area under each accuracy-over-time curve over the budget (`curve_auc`: the mean accuracy
over the budget) beside the crossing time; 640 questions x 1 sample hold an evaluation's standard error to <= 0.02.

One seed (no `--seeds`): the methods run one after the other in this process, the old single-seed command; it writes
`time_to_accuracy.json`, `.md` and `.png` to `--out` (default `bench/results/smollm2/`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(TRANSFORMERS_VERBOSITY="error", DS_ACCELERATOR="cpu")

DEFAULT_OUT = os.path.join(HERE, "results", "smollm2")
REFERENCE = "grpo"
CLOCKS = ("work", "cpu", "wall")
#: the clocks read off a timer (the work clock is built from the CPU clock and the probe)
TIMED = ("cpu", "wall")
#: the confidence level of every interval of the multi-seed report
LEVEL = 0.9


# ------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class Method:
    """A row of the table: an algorithm (`trl` for TRL's GRPO, else a name of `trl_ppo_variants.algorithms`, or
    `grpo_ours` for `trl_ppo_variants.GRPOTrainer`) and the settings it adds."""

    name: str
    label: str
    algorithm: str
    settings: dict = field(default_factory=dict)


#: the settings of a method that generates on the `vllm-serve` process the benchmark starts (`--server-url`)
SERVER = {"use_vllm": True, "vllm_mode": "server"}

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
    # generation on a vLLM server, synchronous or overlapped with training (issue 42); `dapo_async_batch`: the first
    # round held to the dataloader's batch, the only one queued ahead before first rounds were planned ahead
    Method("grpo_server", "GRPO, server", "grpo_ours", dict(SERVER)),
    Method("grpo_async", "GRPO, server, max_staleness=1", "grpo_ours", {**SERVER, "max_staleness": 1}),
    Method("dapo_server", "DAPO, server", "dapo", dict(SERVER)),
    Method("dapo_async", "DAPO, server, max_staleness=1", "dapo", {**SERVER, "max_staleness": 1}),
    Method("dapo_async_batch", "DAPO, server, max_staleness=1, first round = batch", "dapo",
           {**SERVER, "max_staleness": 1, "max_oversample_factor": 1.0}),
]}
DEFAULT_METHODS = ("grpo", "grpo_speed", "dapo", "dapo_speed", "rloo", "rloo_speed", "reinforce_pp", "ppo")


def uses_server(method: Method) -> bool:
    """Whether `method` generates on the benchmark's vLLM server."""
    return method.settings.get("vllm_mode") == "server"


@contextlib.contextmanager
def benchmark_server(methods: list[Method], opts):
    """The vLLM server of the methods that generate on one (`uses_server`): `trl-ppo-variants vllm-serve` of the
    model, unpinned, started here when `opts.server_url` names none, its URL in `opts.server_url` until it stops, its
    log in `opts.out`/server.log (not committed). One server serves the runs one after the other: each run syncs its
    policy before its first generation."""
    if opts.server_url or not any(uses_server(m) for m in methods):
        yield opts.server_url
        return
    sys.path.insert(0, HERE)
    from vllm_speed import start_server, stop_server

    from trl_ppo_variants.smollm2 import smollm2_checkpoint

    os.makedirs(opts.out, exist_ok=True)
    proc, opts.server_url = start_server(smollm2_checkpoint(), None, os.path.join(opts.out, "server.log"))
    try:
        yield opts.server_url
    finally:
        stop_server(proc)
        opts.server_url = None


def trainer_classes(method: Method):
    if method.algorithm == "trl":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    if method.algorithm == "grpo_ours":
        from trl_ppo_variants import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    from trl_ppo_variants import algorithms

    entry = algorithms.get(method.algorithm)
    if entry is None:
        raise ValueError(f"method {method.name}: unknown algorithm {method.algorithm!r}")
    return entry.classes()


def parse_variant(spec: str, known: dict[str, Method]) -> Method:
    """`NAME=BASE:field=value,field=value` -> a Method named NAME with BASE's algorithm and settings plus these
    (values read as Python literals, else kept as strings). ValueError with the expected form otherwise."""
    form = "expected NAME=BASE:field=value[,field=value...], e.g. dapo_nopen=dapo:overlong_penalty=False"
    name, sep, rest = spec.partition("=")
    base_name, sep2, body = rest.partition(":")
    name, base_name = name.strip(), base_name.strip()
    if not (sep and sep2 and name and base_name and body.strip()) or not name.replace("_", "").isalnum():
        raise ValueError(f"--variant {spec!r}: {form}")
    if base_name not in known:
        raise ValueError(f"--variant {spec!r}: unknown base {base_name!r}; expected one of {', '.join(known)}")
    if name == REFERENCE:
        raise ValueError(f"--variant {spec!r}: {REFERENCE!r} is the reference and cannot be redefined")
    changes = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not (eq and key.strip()):
            raise ValueError(f"--variant {spec!r}: {item!r} is not field=value; {form}")
        try:
            changes[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            changes[key.strip()] = value.strip()
    base = known[base_name]
    label = f"{base.label} [{', '.join(f'{k}={v}' for k, v in changes.items())}]"
    return Method(name, label, base.algorithm, {**base.settings, **changes})


def known_methods(variants=()) -> dict[str, Method]:
    """METHODS plus the `--variant` definitions (a variant may build on an earlier one)."""
    known = dict(METHODS)
    for spec in variants:
        method = parse_variant(spec, known)
        known[method.name] = method
    return known


def select_methods(spec: str | None, known: dict[str, Method] | None = None) -> list[Method]:
    """The methods of `--methods` (comma-separated names), the reference first; ValueError names an unknown one."""
    known = known or METHODS
    names = list(DEFAULT_METHODS) if not spec else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; expected names among {', '.join(known)}")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    names.sort(key=lambda n: n != REFERENCE)
    return [known[n] for n in names]


# ------------------------------------------------------------------------------------------------ the task
@dataclass
class Task:
    """What the benchmark trains on: a model folder, a train set, a reward, a held-out measure, shared settings.
    `evaluate(model, tokenizer)` returns the held-out accuracy, or a dict with `acc` and `correct` (the number of
    correct samples of each question) and `samples` (samples per question)."""

    model_dir: str
    train_dataset: object
    reward: object
    evaluate: object
    common: dict
    describe: str = ""


def smollm2_task(seed: int, eval_prompts: int, eval_samples: int, train_size: int = 2048,
                 num_generations: int | None = None) -> Task:
    """The demo's task and settings (`trl_ppo_variants.demo.COMMON`): SmolLM2-135M-Instruct on word problems.
    `num_generations` other than the demo's 4 keeps its 4 prompts a step (the batch grows with the group)."""
    from trl_ppo_variants.demo import COMMON, TRAIN_SEED_OFFSET
    from trl_ppo_variants.smollm2 import (
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
        correct = sampled_correct(model, tokenizer, heldout["prompt"], heldout["answer"], samples=eval_samples,
                                  temperature=common["temperature"], max_new_tokens=common["max_completion_length"],
                                  seed=seed, reward=word_problem_reward)
        return {"acc": sum(correct) / (len(correct) * eval_samples), "correct": correct, "samples": eval_samples}

    return Task(smollm2_checkpoint(), word_problem_dataset(train_size, seed=seed + TRAIN_SEED_OFFSET),
                word_problem_reward, evaluate, common,
                f"SmolLM2-135M-Instruct, word problems, {eval_prompts} held-out questions x {eval_samples} samples")


#: rows `sampled_correct` decodes together by default (its questions x samples)
ROWS_PER_BATCH = 128


def sampled_correct(model, tokenizer, prompts, answers, *, samples: int, temperature: float, max_new_tokens: int,
                    seed: int, reward, questions_per_batch: int | None = None, do_sample: bool = True) -> list[int]:
    """The number of correct completions of each prompt among `samples` sampled ones: the measure of
    `trl_ppo_variants.smollm2.heldout_accuracy` (plain sampling at `temperature`, seeded, the global RNG left as it
    was, the model in eval mode), at about 0.6x its cost. Each prompt is run through the model once and its KV cache
    repeated for its samples (`heldout_accuracy` runs it once per sample: on SmolLM2 a 50-token prompt costs as much
    as 20 generated tokens), and `questions_per_batch * samples` rows are decoded together (6.4 ms a row-token at 128
    rows against 8.3 at 64, one CPU thread; default: `ROWS_PER_BATCH // samples` questions).
    `reward(completions, answer=...)` scores them (None counts as wrong).

    prompts: chat conversations (rendered with the chat template and the generation prompt) or strings; answers: one
    per prompt. Returns one int in [0, samples] per prompt."""
    import torch

    if len(prompts) != len(answers):
        raise ValueError(f"answers: expected one per prompt ({len(prompts)}), got {len(answers)}")
    texts = [p if isinstance(p, str) else
             tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    questions_per_batch = questions_per_batch or max(1, ROWS_PER_BATCH // samples)
    correct: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(texts), questions_per_batch):
                chunk = texts[start:start + questions_per_batch]
                enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                                add_special_tokens=False).to(device)
                ids, mask = enc["input_ids"], enc["attention_mask"]
                # the prompt but its last token into the cache (generate runs the last one, then samples), with the
                # positions generate gives a left-padded row
                positions = (mask[:, :-1].cumsum(-1) - 1).clamp(min=0)
                prefill = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions,
                                use_cache=True, logits_to_keep=1)
                # transformers >= 5.18 names the cache `cache`; vLLM's environment pins an older one
                renamed = hasattr(prefill, "cache")
                cache = prefill.cache if renamed else prefill.past_key_values
                cache.batch_repeat_interleave(samples)
                sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else \
                    dict(do_sample=False)
                out = model.generate(input_ids=ids.repeat_interleave(samples, 0),
                                     attention_mask=mask.repeat_interleave(samples, 0),
                                     **{"cache" if renamed else "past_key_values": cache},
                                     max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
                completions = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
                refs = [a for a in answers[start:start + questions_per_batch] for _ in range(samples)]
                scores = [0.0 if s is None else float(s) for s in reward(completions, answer=refs)]
                correct += [round(sum(scores[i:i + samples])) for i in range(0, len(scores), samples)]
    finally:
        model.train(was_training)
    return correct


def as_evaluation(result) -> dict:
    """A task's evaluation as a dict with `acc` (and `se` when per-question scores came with it)."""
    if not isinstance(result, dict):
        return {"acc": float(result)}
    out = dict(result)
    if "correct" in out:
        out["se"] = heldout_se(out["correct"], out["samples"])
    return out


def heldout_se(correct: list[int], samples: int) -> float:
    """Standard error of a held-out accuracy over its questions: the standard deviation of the per-question
    accuracies `correct[q] / samples` (ddof 1) over sqrt(#questions). The question is the sampling unit, so the
    spread between questions (a question the model always or never gets) counts as well as the sampling noise of
    each question's `samples` draws; it lies between the binomial sqrt(p (1 - p) / (Q samples)) (questions alike)
    and sqrt(p (1 - p) / Q) (every question all right or all wrong). NaN for fewer than 2 questions."""
    if len(correct) < 2:
        return math.nan
    return statistics.stdev(c / samples for c in correct) / math.sqrt(len(correct))


def paired_se(correct_a: list[int], correct_b: list[int], samples: int) -> float:
    """Standard error of the difference of two held-out accuracies on the same questions (`heldout_se` of the
    per-question differences `(correct_a[q] - correct_b[q]) / samples`): a question both runs find easy, or both
    hard, cancels, so it is at most sqrt(se_a^2 + se_b^2) when the runs agree on which questions are hard. NaN for
    fewer than 2 questions or question lists of different lengths."""
    if len(correct_a) != len(correct_b):
        return math.nan
    return heldout_se([a - b for a, b in zip(correct_a, correct_b)], samples)


def final_evaluation(run: dict) -> dict:
    """The run's evaluation at its last curve point (the one at the budget), or {} when it kept no per-question
    scores."""
    evaluations = [e for e in run.get("evaluations", []) if "correct" in e]
    return evaluations[-1] if evaluations else {}


# ------------------------------------------------------------------------------------------------ the clock
class TrainClock:
    """Training time with the evaluations taken out: `now()` is the time since `start()` minus the time spent
    inside `evaluating()` blocks. `timer` is injectable: `time.perf_counter` (wall) or `time.process_time` (CPU
    time of this process)."""

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


TIMERS = {"cpu": time.process_time, "wall": time.perf_counter}


class WorkClock:
    """Training time in probe units: each step's CPU time divided by the CPU time of a fixed probe (a forward pass of
    the model on a fixed batch, `SpeedProbe`) measured right after it. CPU time is robust to waiting for a core but
    not to running slower on one: on this shared virtual machine the same forward/backward took 1.8x the CPU time
    from one hour to the next (neighbours on the host's cores and caches). The probe slows down with it, so the ratio
    is the step's work at a fixed speed."""

    def __init__(self):
        self.total = 0.0
        self.last_cpu = 0.0

    def step(self, cpu_now: float, probe_s: float) -> float:
        """Add the step that ended at `cpu_now` on the CPU clock, with the probe's `probe_s` right after it; returns
        the work so far."""
        self.total += (cpu_now - self.last_cpu) / probe_s
        self.last_cpu = cpu_now
        return self.total


class SpeedProbe:
    """A fixed unit of work on the model being trained: a no-grad forward of `rows` x `tokens` fixed token ids in
    eval mode (the train mode and every RNG are left as they were). Its cost depends on the shapes, not on the
    weights, so it measures the machine's current speed on this model. About 0.6 s of CPU on SmolLM2-135M, one
    thread (2-3% of a step, off the clock)."""

    def __init__(self, model, vocab_size: int, rows: int = 4, tokens: int = 64):
        import torch

        self.model = model
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (rows, tokens), generator=generator)

    def measure(self) -> dict:
        import torch

        was_training = self.model.training
        self.model.eval()
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            with torch.no_grad():
                self.model(input_ids=self.ids.to(next(self.model.parameters()).device))
        finally:
            self.model.train(was_training)
        return {"probe_cpu_s": time.process_time() - c0, "probe_wall_s": time.perf_counter() - w0}


def time_grid(budget: float, points: int) -> list[float]:
    """The evaluation points of a method other than the reference: `budget * i / points`, i = 1..points."""
    return [budget * i / points for i in range(1, points + 1)]


def grid_action(now: float, mean_step: float, points: list[float]) -> tuple[int, bool]:
    """At a step end with clock `now` and steps of `mean_step` so far: (how many of the ascending `points` this step
    end stands for, whether to stop). An inner point is due at the last step end at or before it, i.e. when the
    next step is predicted to pass it (`now + mean_step > point`; a point already passed is due too). The run stops
    at the step end nearest to the last point, the budget (`now + mean_step / 2 >= budget`), which stands for every
    point."""
    *inner, budget = points
    if now + mean_step / 2 >= budget:
        return len(points), True
    return sum(1 for p in inner if now + mean_step > p), False


def step_grid_due(step: int, every_steps: int) -> bool:
    """The reference's grid: evaluate after every `every_steps` steps."""
    return step % every_steps == 0


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float:
    """The training time of the first point of `curve` ((seconds, accuracy), in order) at or above `target`, or
    infinity when none is (an upper bound of the true time, exact to one evaluation interval)."""
    return next((t for t, acc in curve if acc >= target - 1e-12), math.inf)


# ------------------------------------------------------------------------------------------------ one run
class StepCounter:
    """Per optimizer step: the completion tokens and sequences that reached the loss, and those sequences with a
    non-zero advantage (the ones that carry a gradient: GRPO's groups without a reward spread have advantage 0), by
    wrapping the trainer's `_compute_loss` on the instance."""

    def __init__(self, trainer):
        self.reset()
        loss = trainer._compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            mask = inputs["completion_mask"]
            self.trained_tokens += int(mask.sum().item())
            self.trained_sequences += int(mask.shape[0])
            adv = inputs.get("advantages")
            if adv is not None:
                nonzero = adv.detach().abs() > 0
                if nonzero.dim() > 1:
                    nonzero = (nonzero & mask.bool()).any(dim=1)
                self.effective_sequences += int(nonzero.sum().item())
            return loss(model, inputs, *args, **kwargs)

        trainer._compute_loss = compute_loss

    def reset(self):
        self.trained_tokens = 0
        self.trained_sequences = 0
        self.effective_sequences = 0

    def take(self) -> dict:
        out = {"trained_tokens": self.trained_tokens, "trained_sequences": self.trained_sequences,
               "effective_sequences": self.effective_sequences}
        self.reset()
        return out


#: config fields that name a folder of the machine that ran (a temporary one): not part of what was measured
MACHINE_FOLDERS = ("output_dir", "logging_dir")


def jsonable_args(args) -> dict:
    """The scalar fields of a config (what a run used, for the record), without the machine's folders."""
    return {k: v for k, v in vars(args).items()
            if (isinstance(v, (int, float, str, bool)) or v is None) and k not in MACHINE_FOLDERS}


def run_method(method: Method, task: Task, *, steps: int, seed: int, output_dir: str, budget_s: float | None,
               eval_points: int, before: float, clock: str = "work", progress=print,
               server_url: str | None = None) -> dict:
    """Train `method`: the reference for `steps` steps (step grid), the others until `budget_s` of training time on
    `clock` (time grid). Returns its row: `curve` [(time, accuracy)] on `clock`, `curve_work`/`curve_cpu`/`curve_wall`,
    the evaluations, every step's log (`steps_log`, with the probe), tokens, steps, time. A method that generates on
    the server (`uses_server`) does so on the one at `server_url`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    sys.path.insert(0, HERE)
    from algos import Meter

    config_cls, trainer_cls = trainer_classes(method)
    settings = {**task.common, **method.settings}
    settings.update(output_dir=os.path.join(output_dir, method.name), max_steps=steps, seed=seed, logging_steps=1)
    if uses_server(method):
        if not server_url:
            raise ValueError(f"method {method.name}: generates on a vLLM server; expected --server-url or --seeds "
                             "(which starts one)")
        settings["vllm_server_base_url"] = server_url
    args = config_cls(**settings)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    model = AutoModelForCausalLM.from_pretrained(task.model_dir, dtype=torch.float32)
    trainer = trainer_cls(model=model, reward_funcs=task.reward, args=args, train_dataset=task.train_dataset,
                          processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    meter = Meter(trainer)
    counter = StepCounter(trainer)
    clocks = {name: TrainClock(TIMERS[name]) for name in TIMED}
    work = WorkClock()
    probe = SpeedProbe(model, len(tokenizer))
    curves = {name: [(0.0, before)] for name in CLOCKS}
    evaluations, steps_log = [], []
    every_steps = None if budget_s is not None else max(1, steps // eval_points)
    points = None if budget_s is None else time_grid(budget_s, eval_points)
    state_ = {"done": 0, "gen_tokens": 0}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            for c in clocks.values():
                c.start()

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            now = {name: c.now() for name, c in clocks.items()}
            with clocks["cpu"].evaluating(), clocks["wall"].evaluating():
                speed = probe.measure()
            now["work"] = work.step(now["cpu"], speed["probe_cpu_s"])
            step = state.global_step
            steps_log.append({"step": step, **{f"clock_{name}": now[name] for name in CLOCKS}, **speed,
                              "gen_tokens": meter.gen_tokens - state_["gen_tokens"], **counter.take()})
            state_["gen_tokens"] = meter.gen_tokens
            if points is None:
                stop, due = False, step_grid_due(step, every_steps) or step >= steps
            else:
                count, stop = grid_action(now[clock], now[clock] / step, points)
                due = count > state_["done"] or stop or step >= steps
                state_["done"] = max(state_["done"], count)
            if due:
                rollout = getattr(trainer, "_async", None)
                if rollout is not None:
                    # on the clock: the evaluation must not give the overlapped generation time it would not have
                    rollout.wait_idle()
                cost = {name: TIMERS[name]() for name in TIMED}
                with clocks["cpu"].evaluating(), clocks["wall"].evaluating():
                    result = as_evaluation(task.evaluate(model, tokenizer))
                result.update({f"eval_{name}_s": TIMERS[name]() - t0 for name, t0 in cost.items()})
                for name in CLOCKS:
                    curves[name].append((now[name], result["acc"]))
                evaluations.append({"step": step, **{f"clock_{name}": now[name] for name in CLOCKS}, **result})
                progress(f"  {method.name}: step {step}, {now[clock]:.0f} {CLOCK_UNITS[clock]} of training ({clock}; "
                         f"{now['cpu']:.0f} s cpu, {now['wall']:.0f} s wall), held-out accuracy {result['acc']:.3f}")
            control.should_training_stop = control.should_training_stop or stop

    trainer.add_callback(Watch())
    torch.manual_seed(seed)
    trainer.train()
    history = trainer.state.log_history
    logs = {h["step"]: h for h in history if "step" in h and "train_runtime" not in h}
    for entry in steps_log:
        entry.update({k: v for k, v in logs.get(entry["step"], {}).items() if k != "step"})
    curve = curves[clock]
    return {"method": method.name, "label": method.label, "settings": dict(method.settings),
            "args": jsonable_args(args), "clock": clock, "curve": curve,
            **{f"curve_{name}": curves[name] for name in CLOCKS}, "evaluations": evaluations, "steps_log": steps_log,
            "steps": trainer.state.global_step, "train_seconds": curve[-1][0],
            **{f"train_seconds_{name}": curves[name][-1][0] for name in CLOCKS},
            "gen_tokens": meter.gen_tokens, "trained_tokens": meter.trained_tokens, "gen_calls": meter.gen_calls,
            "gen_per_trained_token": meter.gen_tokens / meter.trained_tokens if meter.trained_tokens else math.nan,
            "rewards": [h["reward"] for h in history if "reward" in h]}


# ------------------------------------------------------------------------------------------------ one seed's table
def summarize(rows: list[dict]) -> dict:
    """Add the table's columns to every row against the reference (the first row): time to reach its final accuracy
    (seconds and x of its time) and the accuracy at the budget (the last evaluation: a method stops at the step end
    nearest the budget, or earlier at its step limit). Returns the reference's target and budget."""
    ref = rows[0]
    target, budget = ref["curve"][-1][1], ref["train_seconds"]
    for row in rows:
        reach = time_to_reach(row["curve"], target)
        row["time_to_target"] = reach
        row["time_ratio"] = reach / budget if budget > 0 else math.nan
        row["acc_at_budget"] = row["curve"][-1][1]
        row["sec_per_step"] = row["train_seconds"] / max(row["steps"], 1)
    return {"target": target, "budget_s": budget}


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def format_table(rows: list[dict], target: float, budget: float, grpo_steps: int, unit: str = "s") -> str:
    def fmt_time(row):
        if math.isinf(row["time_to_target"]):
            return "not reached"
        return f"{row['time_to_target']:.0f} {unit} ({row['time_ratio']:.2f}x)"

    header = ["method", f"time to {target:.3f} (GRPO's {grpo_steps}-step acc.)",
              f"acc. at GRPO's {budget:.0f} {unit}", "gen. tokens / trained token", "steps", f"{unit}/step"]
    body = [[r["label"], fmt_time(r), f"{r['acc_at_budget']:.3f}", f"{r['gen_per_trained_token']:.2f}",
             str(r["steps"]), f"{r['sec_per_step']:.1f}"] for r in rows]
    return markdown_table(header, body)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    return plt


def plot(rows: list[dict], target: float, path: str, title: str, clock: str = "work") -> str | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for r in rows:
        ts, accs = zip(*r["curve"])
        ref = r["method"] == REFERENCE
        ax.plot(ts, accs, marker="o", ms=3, lw=2.2 if ref else 1.3, color="black" if ref else None,
                label=r["label"])
    ax.axhline(target, color="tab:red", ls="--", lw=1, label=f"GRPO's final accuracy {target:.3f}")
    ax.set_xlabel(f"training time ({CLOCK_WORDS[clock]}), evaluation excluded ({CLOCK_UNITS[clock]})")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CLOCK_WORDS = {"work": "CPU time of a 1-thread process in units of a fixed probe's",
               "cpu": "CPU time of a 1-thread process", "wall": "wall time"}
CLOCK_UNITS = {"work": "pu", "cpu": "s", "wall": "s"}


def machine() -> dict:
    import torch
    import transformers
    import trl

    return {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def evaluate_before(task: Task) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    base = AutoModelForCausalLM.from_pretrained(task.model_dir)
    return as_evaluation(task.evaluate(base, tokenizer))


def method_steps(grpo_steps: int, max_steps_factor: float, reference: bool) -> int:
    return grpo_steps if reference else max(grpo_steps, int(math.ceil(grpo_steps * max_steps_factor)))


def run_benchmark(task: Task, methods: list[Method], *, grpo_steps: int, eval_points: int, seed: int, out: str,
                  max_steps_factor: float = 3.0, clock: str = "work", progress=print,
                  server_url: str | None = None) -> dict:
    """The whole protocol on one seed in this process (module docstring); writes the JSON, the table and the plot
    to `out`, returns the JSON."""
    import tempfile

    os.makedirs(out, exist_ok=True)
    before = evaluate_before(task)["acc"]
    progress(f"time-to-accuracy: held-out accuracy before training {before:.3f}")
    rows, budget = [], None
    work = tempfile.mkdtemp(prefix="tta-")
    for method in methods:
        progress(f"time-to-accuracy: {method.label}")
        steps = method_steps(grpo_steps, max_steps_factor, budget is None)
        try:
            row = run_method(method, task, steps=steps, seed=seed, output_dir=work, budget_s=budget,
                             eval_points=eval_points, before=before, clock=clock, progress=progress,
                             server_url=server_url)
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
                               out=out, clock=clock)
    return result


def write_results(rows: list[dict], task: Task, *, before: float, grpo_steps: int, eval_points: int, seed: int,
                  out: str, clock: str = "work") -> dict:
    """The JSON, the table and the plot of the methods run so far (`rows`, the reference first) to `out`."""
    ok = [r for r in rows if "error" not in r]
    summary = summarize(ok)
    table = format_table(ok, summary["target"], summary["budget_s"], grpo_steps, CLOCK_UNITS[clock])
    failed = [f"{r['label']}: {r['error']}" for r in rows if "error" in r]
    result = {"task": task.describe, "before": before, "grpo_steps": grpo_steps, "eval_points": eval_points,
              "seed": seed, "clock": clock,
              "common": {k: v for k, v in task.common.items() if isinstance(v, (int, float, str))},
              **summary, "rows": rows, "failed": failed, "machine": machine()}
    with open(os.path.join(out, "time_to_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "time_to_accuracy.md"), "w") as f:
        f.write(table + "\n" + "".join(f"\nfailed: {x}" for x in failed) + "\n")
    plot(ok, summary["target"], os.path.join(out, "time_to_accuracy.png"),
         f"{task.describe}; budget = GRPO's {grpo_steps} steps ({summary['budget_s']:.0f} {CLOCK_UNITS[clock]})",
         clock=clock)
    result["table"] = table
    return result


# ------------------------------------------------------------------------------------------------ statistics
def quantile_bounds(sorted_values: list[float], level: float) -> tuple[float, float]:
    """The percentile interval of a sorted bootstrap distribution of M values: entries floor(a M) and
    ceil((1 - a) M) - 1 with a = (1 - level) / 2 (M = 4, level 0.5: the 2nd and 3rd values)."""
    m = len(sorted_values)
    a = (1 - level) / 2
    lo = min(m - 1, math.floor(a * m + 1e-9))
    hi = max(0, math.ceil((1 - a) * m - 1e-9) - 1)
    return sorted_values[lo], sorted_values[hi]


def _mean(xs):
    return sum(xs) / len(xs)


def bootstrap_ci(values: list[float], stat=_mean, level: float = LEVEL, resamples: int = 20000, seed: int = 0,
                 exact_up_to: int = 6) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat(values)` over resamples with replacement (here: over seeds). With at
    most `exact_up_to` values every one of the n^n ordered resamples is taken (the exact bootstrap distribution:
    3125 for 5 seeds), else `resamples` seeded random ones. Infinite values (a target not reached) propagate into
    the statistic. (nan, nan) for no values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    if n <= exact_up_to:
        draws = itertools.product(values, repeat=n)
    else:
        rng = random.Random(seed)
        draws = ([values[rng.randrange(n)] for _ in range(n)] for _ in range(resamples))
    stats = sorted(stat(list(d)) for d in draws)
    return quantile_bounds(stats, level)


def curve_at(curve: list[tuple[float, float]], budget: float, xs: list[float]) -> list[float]:
    """A held-out curve ((seconds, accuracy), in order) read at the training times `xs` (fractions of `budget`):
    linear between evaluations, held at its last value after its last evaluation (a run that stopped short of a
    point keeps its last measured accuracy)."""
    pts = [(t / budget, a) for t, a in curve]
    out = []
    for x in xs:
        if x >= pts[-1][0]:
            out.append(pts[-1][1])
            continue
        j = next(i for i, (t, _) in enumerate(pts) if t >= x)
        if j == 0:
            out.append(pts[0][1])
            continue
        (t0, a0), (t1, a1) = pts[j - 1], pts[j]
        out.append(a0 + (a1 - a0) * (x - t0) / (t1 - t0) if t1 > t0 else a1)
    return out


def curve_auc(curve: list[tuple[float, float]], budget: float) -> float:
    """The area under a held-out curve from 0 to `budget`, over `budget`: its mean accuracy over the budget, read as
    `curve_at` reads it (linear between evaluations, held after the last). Exact: the trapezoids between the
    evaluations' clocks (issue 42's summary beside the crossing time: a run that learns early and one that crosses
    the target just in time differ here, not in their crossing)."""
    xs = sorted({0.0, 1.0, *(t / budget for t, _ in curve if 0.0 < t / budget < 1.0)})
    ys = curve_at(curve, budget, xs)
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))


def seed_metrics(ref: dict, row: dict) -> dict:
    """One run's numbers against its seed's reference `ref`: the target (the reference's last accuracy), the budget
    (its training time), the time to reach the target (seconds and x budget; inf when never), the accuracy at the
    budget (the last evaluation) and its difference to the target, the peak (its accuracy, when in x budget) and the
    final accuracy; the stopping clock in x budget (`stop_ratio`: a lower bound of the time ratio of a run that did
    not reach the target); the area under the curve over the budget (`auc`, `curve_auc`) and its difference to the
    reference's."""
    target, budget = ref["curve"][-1][1], ref["train_seconds"]
    reach = time_to_reach(row["curve"], target)
    auc = curve_auc(row["curve"], budget)
    last, ref_last = final_evaluation(row), final_evaluation(ref)
    se = next((e["se"] for e in reversed(row.get("evaluations", [])) if "se" in e), math.nan)
    diff_se = paired_se(last["correct"], ref_last["correct"], last["samples"]) \
        if last and ref_last and last["samples"] == ref_last["samples"] else math.nan
    accs = [a for _, a in row["curve"]]
    peak = max(accs[1:]) if len(accs) > 1 else accs[0]
    peak_at = next(t for t, a in row["curve"][1:] if a == peak) if len(accs) > 1 else 0.0
    return {"target": target, "budget_s": budget, "time_to_target": reach, "time_ratio": reach / budget,
            "reached_by_half": reach <= 0.5 * budget, "acc_at_budget": accs[-1], "diff_at_budget": accs[-1] - target,
            "peak": peak, "peak_at": peak_at / budget, "final": accs[-1], "drop_from_peak": peak - accs[-1],
            "stop_ratio": row["curve"][-1][0] / budget, "steps": row["steps"],
            "sec_per_step": row["train_seconds"] / max(row["steps"], 1),
            "cpu_per_step": row.get("train_seconds_cpu", math.nan) / max(row["steps"], 1),
            "gen_per_trained_token": row.get("gen_per_trained_token", math.nan),
            "se_at_budget": se, "diff_se": diff_se, "auc": auc, "diff_auc": auc - curve_auc(ref["curve"], budget)}


def noise_of_mean(ses: list[float]) -> float:
    """The standard error that the evaluations alone put on a mean over seeds of independent evaluations with
    standard errors `ses`: sqrt(sum se^2) / n (NaN when one is unknown)."""
    return math.sqrt(sum(se * se for se in ses)) / len(ses) if ses else math.nan


def method_summary(per_seed: list[dict], level: float = LEVEL) -> dict:
    """Means over seeds with bootstrap intervals (`bootstrap_ci`) of one method's `seed_metrics`: the time ratio
    (median, and the mean with a target never reached counted at its stopping ratio: a lower bound, `censored`),
    the accuracy at the budget and its paired difference to the reference's target, the peak, the final accuracy;
    the seeds that reached the target by half the budget."""
    ratios = [m["time_ratio"] for m in per_seed]
    censored = [r if math.isfinite(r) else m["stop_ratio"] for r, m in zip(ratios, per_seed)]
    out = {"seeds": len(per_seed), "reached_by_half": sum(m["reached_by_half"] for m in per_seed),
           "not_reached": sum(not math.isfinite(r) for r in ratios),
           "time_ratio_median": statistics.median(ratios),
           "time_ratio_median_ci": bootstrap_ci(ratios, statistics.median, level),
           "time_ratio_mean": _mean(censored), "time_ratio_mean_ci": bootstrap_ci(censored, level=level),
           "time_ratio_mean_is_lower_bound": any(not math.isfinite(r) for r in ratios)}
    for key in ("acc_at_budget", "diff_at_budget", "peak", "final", "drop_from_peak", "target", "auc", "diff_auc"):
        values = [m[key] for m in per_seed]
        out[key] = _mean(values)
        out[key + "_ci"] = bootstrap_ci(values, level=level)
    for key in ("steps", "sec_per_step", "cpu_per_step", "gen_per_trained_token", "peak_at"):
        out[key] = _mean([m[key] for m in per_seed])
    out["noise_se_acc"] = noise_of_mean([m.get("se_at_budget", math.nan) for m in per_seed])
    out["noise_se_diff"] = noise_of_mean([m.get("diff_se", math.nan) for m in per_seed])
    return out


def goal_met(summary: dict, min_seeds: int = 4, ratio: float = 0.5) -> bool:
    """Issue 35's goal: the target reached in at most `ratio` x the budget on at least `min_seeds` seeds, and the
    mean accuracy at the budget at least the reference's (mean paired difference >= 0)."""
    return summary["reached_by_half"] >= min_seeds and summary["diff_at_budget"] >= -1e-12


def goal_verdict(summary: dict, seeds: int = 5, min_seeds: int = 4) -> str:
    """The goal column: `goal_met` over `seeds` seeds ("MET" / "missed"); with fewer seeds run, "missed" once the
    seeds left cannot make `min_seeds`, else "undecided (n of 5 seeds)"."""
    if summary["seeds"] >= seeds:
        return "MET" if goal_met(summary, min_seeds) else "missed"
    if summary["reached_by_half"] + seeds - summary["seeds"] < min_seeds:
        return "missed"
    return f"undecided ({summary['seeds']} of {seeds} seeds)"


# ------------------------------------------------------------------------------------------------ several seeds
def result_path(out: str, seed: int, method: str) -> str:
    return os.path.join(out, f"seed{seed}", f"{method}.json")


def protocol(opts) -> dict:
    """The settings every run of a multi-seed folder must share with its seed's reference."""
    return {"grpo_steps": opts.grpo_steps, "eval_points": opts.eval_points, "eval_prompts": opts.eval_prompts,
            "eval_samples": opts.eval_samples, "num_generations": opts.num_generations, "clock": opts.clock,
            "threads": opts.threads, "max_steps_factor": opts.max_steps_factor}


def run_job(method: Method, seed: int, opts, progress=print) -> dict:
    """One (seed, method) run of a multi-seed folder, written to `result_path`: the reference evaluates the model
    before training too; another method reads its seed's reference for the budget and that accuracy."""
    import tempfile

    out = opts.out
    task = smollm2_task(seed, opts.eval_prompts, opts.eval_samples, num_generations=opts.num_generations)
    reference = method.name == REFERENCE
    if reference:
        before = evaluate_before(task)
        budget = None
    else:
        with open(result_path(out, seed, REFERENCE)) as f:
            ref = json.load(f)
        if ref["protocol"] != protocol(opts):
            raise ValueError(f"seed {seed}: the stored reference ran with {ref['protocol']}, this run with "
                             f"{protocol(opts)}: use another --out or the same settings")
        before, budget = ref["before"], ref["train_seconds"]
    progress(f"time-to-accuracy: seed {seed}, {method.label}, held-out accuracy before training {before['acc']:.3f}"
             + ("" if reference else f", budget {budget:.0f} {CLOCK_UNITS[opts.clock]} ({opts.clock})"))
    row = run_method(method, task, steps=method_steps(opts.grpo_steps, opts.max_steps_factor, reference), seed=seed,
                     output_dir=tempfile.mkdtemp(prefix="tta-"), budget_s=budget, eval_points=opts.eval_points,
                     before=before["acc"], clock=opts.clock, progress=progress, server_url=opts.server_url)
    row.update(seed=seed, before=before, protocol=protocol(opts), task=task.describe,
               common={k: v for k, v in task.common.items() if isinstance(v, (int, float, str))},
               machine=machine())
    path = result_path(out, seed, method.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(row, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return row


def job_command(opts, seed: int, method: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--job", "--seeds", str(seed), "--methods", method,
           "--out", opts.out, "--grpo-steps", str(opts.grpo_steps), "--eval-points", str(opts.eval_points),
           "--eval-prompts", str(opts.eval_prompts), "--eval-samples", str(opts.eval_samples),
           "--max-steps-factor", str(opts.max_steps_factor), "--clock", opts.clock, "--threads", str(opts.threads)]
    if opts.num_generations is not None:
        cmd += ["--num-generations", str(opts.num_generations)]
    if opts.server_url:
        cmd += ["--server-url", opts.server_url]
    for spec in opts.variant:
        cmd += ["--variant", spec]
    return cmd


def job_order(seeds: list[int], methods: list[str], order: str = "seed") -> list[tuple[int, str]]:
    """The (seed, method) runs in the order they start: seed by seed (`"seed"`), or method by method (`"method"`:
    every seed's reference, then every seed's next method, so that each method's table fills over seeds first)."""
    if order == "seed":
        return [(s, m) for s in seeds for m in methods]
    if order == "method":
        return [(s, m) for m in methods for s in seeds]
    raise ValueError(f"--order: expected 'seed' or 'method', got {order!r}")


def marker_path(out: str, seed: int, method: str) -> str:
    """A running run's marker (its process id), so that another `run_seeds` on the folder adopts it, not reruns it."""
    return result_path(out, seed, method)[:-len(".json")] + ".running"


def live_pid(marker: str) -> int | None:
    """The process id in `marker` if that process still runs, else None."""
    try:
        with open(marker) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


class Adopted:
    """A run started by an earlier `run_seeds` that still runs: polled by its process id (its exit status is not
    ours to read: its result file says whether it succeeded)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode = None

    def poll(self):
        try:
            os.kill(self.pid, 0)
        except OSError:
            self.returncode = 0
        return self.returncode


def next_job(pending: list[tuple[int, str]], running: list[tuple[int, str]], done) -> tuple[int, str] | None:
    """The first pending (seed, method) that can start: a reference at once, another method once its seed's
    reference is done (`done(seed)`) and not running."""
    for seed, method in pending:
        if method == REFERENCE or (done(seed) and (seed, REFERENCE) not in running):
            return seed, method
    return None


def run_seeds(opts, methods: list[Method], seeds: list[int], progress=print) -> int:
    """Every (seed, method) without a result, `opts.jobs` processes at a time; the report after each."""
    os.makedirs(opts.out, exist_ok=True)
    jobs = job_order(seeds, [m.name for m in methods], opts.order)
    pending = [j for j in jobs if opts.force or not os.path.exists(result_path(opts.out, *j))]
    progress(f"time-to-accuracy: {len(jobs) - len(pending)} of {len(jobs)} runs already in {opts.out}")
    running: dict = {}
    for job in list(pending):
        pid = live_pid(marker_path(opts.out, *job))
        if pid is not None:
            pending.remove(job)
            running[Adopted(pid)] = job
            progress(f"time-to-accuracy: seed {job[0]} {job[1]} is running already (pid {pid}): adopted")
    failures = 0
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads),
               TOKENIZERS_PARALLELISM="false")
    while pending or running:
        while len(running) < opts.jobs:
            job = next_job(pending, list(running.values()),
                           lambda s: os.path.exists(result_path(opts.out, s, REFERENCE)))
            if job is None:
                break
            pending.remove(job)
            # another launcher on the folder may have run or started it since this one listed its jobs
            if os.path.exists(result_path(opts.out, *job)):
                continue
            pid = live_pid(marker_path(opts.out, *job))
            if pid is not None:
                running[Adopted(pid)] = job
                progress(f"time-to-accuracy: seed {job[0]} {job[1]} is running already (pid {pid}): adopted")
                continue
            log = result_path(opts.out, *job)[:-len(".json")] + ".log"
            os.makedirs(os.path.dirname(log), exist_ok=True)
            with open(log, "w") as handle:
                proc = subprocess.Popen(job_command(opts, *job), stdout=handle, stderr=subprocess.STDOUT, env=env)
            running[proc] = job
            with open(marker_path(opts.out, *job), "w") as f:
                f.write(str(proc.pid))
            progress(f"time-to-accuracy: started seed {job[0]} {job[1]} (pid {proc.pid}, log {log})")
        if not running:
            progress(f"time-to-accuracy: {len(pending)} runs cannot start (their seed's reference failed): "
                     f"{pending}")
            failures += len(pending)
            break
        time.sleep(2)
        for proc in [p for p in running if p.poll() is not None]:
            seed, method = running.pop(proc)
            if os.path.exists(marker_path(opts.out, seed, method)):
                os.remove(marker_path(opts.out, seed, method))
            ok = proc.returncode == 0 and os.path.exists(result_path(opts.out, seed, method))
            failures += not ok
            progress(f"time-to-accuracy: seed {seed} {method} {'done' if ok else f'FAILED (rc {proc.returncode})'}")
            if not ok and method == REFERENCE:
                dropped = [j for j in pending if j[0] == seed]
                pending = [j for j in pending if j[0] != seed]
                progress(f"time-to-accuracy: seed {seed}: dropped {dropped} (no reference)")
                failures += len(dropped)
            try:
                report(opts.out)
            except Exception as e:  # a report that cannot be built yet must not stop the runs
                progress(f"time-to-accuracy: report not written: {type(e).__name__}: {e}")
    return failures


def load_runs(out: str) -> dict[int, dict[str, dict]]:
    """{seed: {method: run}} of a multi-seed folder."""
    runs: dict[int, dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "seed*", "*.json"))):
        with open(path) as f:
            row = json.load(f)
        runs.setdefault(int(row["seed"]), {})[row["method"]] = row
    return runs


def fmt_ci(value: float, ci, digits: int = 3, suffix: str = "") -> str:
    def f(x):
        return "inf" if math.isinf(x) else f"{x:.{digits}f}{suffix}"

    return f"{f(value)} [{f(ci[0])}, {f(ci[1])}]"


def fmt_ratio(m: dict, unit: str = "s") -> str:
    if math.isinf(m["time_ratio"]):
        return "not reached"
    return f"{m['time_to_target']:.0f} {unit} ({m['time_ratio']:.2f}x)"


def report(out: str, level: float = LEVEL) -> dict:
    """The multi-seed report of `out` (module docstring): JSON, markdown and plot; returns the JSON."""
    runs = load_runs(out)
    seeds = sorted(s for s in runs if REFERENCE in runs[s])
    order = [REFERENCE] + sorted({m for s in seeds for m in runs[s]} - {REFERENCE},
                                 key=lambda m: (list(METHODS).index(m) if m in METHODS else len(METHODS), m))
    per_seed = {m: {s: seed_metrics(runs[s][REFERENCE], runs[s][m]) for s in seeds if m in runs[s]} for m in order}
    summaries = {m: method_summary(list(per_seed[m].values()), level) for m in order if per_seed[m]}
    labels = {m: next(runs[s][m]["label"] for s in seeds if m in runs[s]) for m in order}
    ref0 = runs[seeds[0]][REFERENCE]
    clock = ref0["protocol"]["clock"]
    unit = CLOCK_UNITS[clock]

    lines = [f"# Time to accuracy over {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
             f"{ref0['task']}; {ref0['common'].get('per_device_train_batch_size')} completions a step, "
             f"G = {ref0['common'].get('num_generations')}, {ref0['common'].get('max_completion_length')} new "
             f"tokens, T = {ref0['common'].get('temperature')}, lr {ref0['common'].get('learning_rate')} "
             f"{ref0['common'].get('lr_scheduler_type')}, beta {ref0['common'].get('beta')}. Budget: "
             f"trl.GRPOTrainer's {ref0['protocol']['grpo_steps']} steps on the {clock} clock "
             f"({CLOCK_WORDS[clock]}, evaluations excluded); target: its held-out accuracy after them. Intervals: "
             f"{level:.0%} percentile bootstrap over seeds (exact, every resample of {len(seeds)}).", "",
             "## Over seeds", ""]
    header = ["method", "seeds", "target by 0.5x budget", "time ratio: median", "time ratio: mean",
              "acc. at budget: mean", "minus GRPO's target", "AUC: mean", "AUC minus GRPO's", "peak: mean",
              "final: mean", "peak - final", "steps", f"{unit}/step", "CPU s/step", "gen. tok / trained tok", "goal"]
    body = []
    for m in order:
        if m not in summaries:
            continue
        s = summaries[m]
        mean = fmt_ci(s["time_ratio_mean"], s["time_ratio_mean_ci"], 2, "x")
        body.append([labels[m], str(s["seeds"]), f"{s['reached_by_half']}/{s['seeds']}",
                     fmt_ci(s["time_ratio_median"], s["time_ratio_median_ci"], 2, "x"),
                     (">= " if s["time_ratio_mean_is_lower_bound"] else "") + mean,
                     fmt_ci(s["acc_at_budget"], s["acc_at_budget_ci"]),
                     fmt_ci(s["diff_at_budget"], s["diff_at_budget_ci"], suffix=""),
                     fmt_ci(s["auc"], s["auc_ci"]), fmt_ci(s["diff_auc"], s["diff_auc_ci"]),
                     fmt_ci(s["peak"], s["peak_ci"]), fmt_ci(s["final"], s["final_ci"]),
                     f"{s['drop_from_peak']:.3f}", f"{s['steps']:.1f}", f"{s['sec_per_step']:.1f}",
                     f"{s['cpu_per_step']:.1f}",
                     f"{s['gen_per_trained_token']:.2f}",
                     "-" if m == REFERENCE else goal_verdict(s)])
    lines += [markdown_table(header, body), "",
              "time ratio: the training time at the first evaluation at or above GRPO's target, over GRPO's budget "
              "(mean: a seed that never reached it counted at its stopping clock, so the mean is then a lower bound, "
              "'>='). AUC: the area under the held-out accuracy curve over the budget, over the budget (the mean "
              "accuracy over the budget, `curve_auc`). goal (issue 35): the target by 0.5x the budget on >= 4 of 5 "
              "seeds and a mean accuracy at the budget >= GRPO's (mean difference >= 0).", "", "## Per seed", ""]
    header = ["seed", "before", "method", f"budget ({clock}, {unit})", "time to target", "acc. at budget", "AUC",
              "peak (at x)", "final", "steps", f"{unit}/step", "CPU s/step", "gen. tok / trained tok", "held-out SE"]
    body = []
    for s in seeds:
        for m in order:
            if s not in per_seed[m]:
                continue
            x, run = per_seed[m][s], runs[s][m]
            se = [e["se"] for e in run.get("evaluations", []) if "se" in e]
            body.append([str(s), f"{runs[s][REFERENCE]['before']['acc']:.3f}", labels[m], f"{x['budget_s']:.0f}",
                         fmt_ratio(x, unit), f"{x['acc_at_budget']:.3f}", f"{x['auc']:.3f}",
                         f"{x['peak']:.3f} ({x['peak_at']:.2f}x)",
                         f"{x['final']:.3f}", str(x["steps"]), f"{x['sec_per_step']:.1f}", f"{x['cpu_per_step']:.1f}",
                         f"{x['gen_per_trained_token']:.2f}", f"{max(se):.3f}" if se else "-"])
    lines += [markdown_table(header, body), "",
              "held-out SE: the largest standard error over questions of the run's evaluations (`heldout_se`).", "",
              "## Evaluation noise", ""]
    header = ["method", "SE at budget: one seed", "paired SE vs GRPO: one seed", "SE of the mean (evaluations)",
              "SE of the mean difference (evaluations)", "0.05 in SEs of the mean difference"]
    body = []
    for m in order:
        if m not in summaries:
            continue
        runs_m = list(per_seed[m].values())
        ses = [x["se_at_budget"] for x in runs_m]
        dses = [x["diff_se"] for x in runs_m]
        s = summaries[m]
        reference = m == REFERENCE
        body.append([labels[m], f"{min(ses):.3f}-{max(ses):.3f}",
                     "-" if reference else f"{min(dses):.3f}-{max(dses):.3f}", f"{s['noise_se_acc']:.3f}",
                     "-" if reference else f"{s['noise_se_diff']:.3f}",
                     "-" if reference or not s["noise_se_diff"] > 0 else f"{0.05 / s['noise_se_diff']:.1f}"])
    lines += [markdown_table(header, body), "",
              "What the held-out evaluation alone adds (besides the spread between seeds, which the bootstrap "
              "intervals above hold): the standard error over questions of each run's accuracy at the budget, of "
              "its difference to GRPO's on the same questions (`paired_se`), and of their means over the seeds "
              "(`noise_of_mean`: sqrt(sum se^2) / n).", "",
              "## Curves (held-out accuracy at each evaluation: clock x budget = accuracy)", ""]
    for s in seeds:
        for m in order:
            if m in runs[s]:
                budget = runs[s][REFERENCE]["train_seconds"]
                pts = " ".join(f"{t / budget:.2f}={a:.3f}" for t, a in runs[s][m]["curve"])
                lines.append(f"- seed {s}, {labels[m]}: {pts}")
    md = "\n".join(lines) + "\n"
    result = {"seeds": seeds, "methods": order, "labels": labels, "level": level, "clock": clock,
              "protocol": ref0["protocol"], "summary": summaries,
              "per_seed": {m: {str(s): v for s, v in per_seed[m].items()} for m in order},
              "runs": {str(s): runs[s] for s in sorted(runs)}}
    with open(os.path.join(out, "time_to_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "time_to_accuracy.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "time_to_accuracy_steps.md"), "w") as f:
        f.write(steps_report(runs, seeds, order, labels))
    plot_seeds(runs, seeds, order, labels, os.path.join(out, "time_to_accuracy.png"), clock, level)
    result["markdown"] = md
    return result


#: the per-step columns of the diagnosis tables: (heading, how to read it off a `steps_log` entry)
STEP_COLUMNS = (
    ("clock", lambda e, budget: e["clock"] / budget),  # x budget
    ("task reward", lambda e, b: _first(e, "rewards/word_problem_reward/mean", "reward")),
    ("entropy", lambda e, b: e.get("entropy")),
    ("clip low", lambda e, b: e.get("clip_ratio/low_mean")),
    ("clip high", lambda e, b: e.get("clip_ratio/high_mean")),
    ("groups with spread", lambda e, b: _spread_share(e)),
    ("kept / generated", lambda e, b: _kept(e)),
    ("eff. seqs", lambda e, b: e.get("effective_sequences")),
    ("trained seqs", lambda e, b: e.get("trained_sequences")),
    ("mean len", lambda e, b: e.get("completions/mean_length")),
    ("cut at max", lambda e, b: e.get("completions/clipped_ratio")),
    ("overlong pen.", lambda e, b: e.get("dapo/overlong_penalty")),
    ("penalized", lambda e, b: e.get("dapo/frac_overlong_penalized")),
    ("gen/trained tok", lambda e, b: e["gen_tokens"] / e["trained_tokens"] if e.get("trained_tokens") else None),
    ("staleness", lambda e, b: e.get("async/staleness")),  # overlapped generation: the mean over the step's rounds
)


def _first(entry: dict, *keys):
    return next((entry[k] for k in keys if k in entry), None)


def _spread_share(entry: dict):
    """The share of the step's generated groups with a reward spread: 1 - TRL's `frac_reward_zero_std` (over every
    group generated, DAPO's dropped ones included)."""
    zero = entry.get("frac_reward_zero_std")
    return None if zero is None else 1 - zero


def _kept(entry: dict):
    kept, generated = _first(entry, "dapo/groups_kept", "selection/groups_kept"), \
        _first(entry, "dapo/groups_generated", "selection/groups_generated")
    return None if kept is None else f"{kept:.0f}/{generated:.0f}"


def steps_table(run: dict, budget: float) -> str:
    """One run's steps (`steps_log`) as a markdown table of `STEP_COLUMNS`, with each held-out evaluation on the row
    of its step."""
    held = {e["step"]: e["acc"] for e in run.get("evaluations", [])}
    clock = run.get("clock", "cpu")
    body = []
    for entry in run["steps_log"]:
        entry = {**entry, "clock": entry[f"clock_{clock}"]}
        cells = [str(entry["step"])]
        for _, read in STEP_COLUMNS:
            value = read(entry, budget)
            cells.append("" if value is None else value if isinstance(value, str) else
                         f"{value:.0f}" if isinstance(value, int) else f"{value:.3g}")
        cells.append(f"{held[entry['step']]:.3f}" if entry["step"] in held else "")
        body.append(cells)
    return markdown_table(["step"] + [h for h, _ in STEP_COLUMNS] + ["held-out"], body)


def run_diagnosis(run: dict) -> dict:
    """One run's signs of a post-peak fall (issue 35), read off its evaluations and `steps_log`: the held-out peak
    (and its step), the final accuracy and the drop between them; the entropy at the first step, at the peak's step
    and at the last; the mean of the trained completions with a non-zero advantage (the effective batch) and the
    steps with none (no gradient at all); the largest clip fractions (0 when every update is on-policy); the share of
    completions DAPO's overlong shaping lowered over the first 3 steps; the mean length at the first and last step.
    A value a run did not log is None."""
    evals = run.get("evaluations", [])
    steps = run["steps_log"]
    by_step = {e["step"]: e for e in steps}
    peak = max(evals, key=lambda e: (e["acc"], -e["step"])) if evals else None

    def at(entry, key):
        return None if entry is None else entry.get(key)

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    effective = [e.get("effective_sequences") for e in steps]
    clips = [v for e in steps for v in (e.get("clip_ratio/low_mean"), e.get("clip_ratio/high_mean")) if v is not None]
    return {"peak": None if peak is None else peak["acc"], "peak_step": None if peak is None else peak["step"],
            "final": evals[-1]["acc"] if evals else None,
            "drop": None if peak is None else peak["acc"] - evals[-1]["acc"],
            "entropy_first": at(steps[0], "entropy"),
            "entropy_at_peak": at(by_step.get(peak["step"]) if peak else None, "entropy"),
            "entropy_last": at(steps[-1], "entropy"),
            "effective_mean": mean(effective), "steps_without_gradient": sum(1 for v in effective if v == 0),
            "clip_max": max(clips) if clips else None,
            "overlong_share_first3": mean([e.get("dapo/frac_overlong_penalized") for e in steps[:3]]),
            "length_first": at(steps[0], "completions/mean_length"), "length_last": at(steps[-1], "completions/mean_length")}


def diagnosis_table(runs, seeds, order, labels) -> str:
    """`run_diagnosis` of every run, one row each, seed by seed."""
    def cell(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    body = []
    for s in seeds:
        for m in order:
            if m in runs[s] and runs[s][m].get("steps_log"):
                d = run_diagnosis(runs[s][m])
                body.append([str(s), labels[m], f"{cell(d['peak'])} (step {cell(d['peak_step'])})", cell(d["final"]),
                             cell(d["drop"]), f"{cell(d['entropy_first'], 2)} / {cell(d['entropy_at_peak'], 2)} / "
                             f"{cell(d['entropy_last'], 2)}", cell(d["effective_mean"], 1),
                             cell(d["steps_without_gradient"]), cell(d["clip_max"], 2),
                             cell(d["overlong_share_first3"], 2),
                             f"{cell(d['length_first'], 1)} -> {cell(d['length_last'], 1)}"])
    return markdown_table(["seed", "method", "held-out peak", "final", "peak - final", "entropy first / at peak / last",
                           "eff. seqs a step", "steps without gradient", "clip max", "overlong-penalized, steps 1-3",
                           "mean length"], body)


def steps_report(runs, seeds, order, labels) -> str:
    """A one-row-a-run diagnosis (`diagnosis_table`), then every run's per-step table (`steps_table`), seed by
    seed."""
    parts = ["# Time to accuracy, step by step", "", "## Every run at a glance", "",
             diagnosis_table(runs, seeds, order, labels), "",
             "eff. seqs a step: trained completions with a non-zero advantage (of 16); steps without gradient: steps "
             "where none had one; clip max: the largest clip fraction (low or high) of any step; overlong-penalized: "
             "the share of completions DAPO's overlong shaping lowered, mean of steps 1-3.", "",
             "clock: training time x the seed's budget; task reward: the mean task reward of the step's generated "
             "completions; entropy, clip low/high: TRL's (the share of tokens whose ratio was clipped; 0 when every "
             "update is on-policy); groups with spread: share of the generated groups whose task rewards differ; "
             "kept / generated: DAPO's groups trained / generated; eff. seqs: trained completions with a non-zero "
             "advantage; mean len, cut at max: completion length and the share cut at max_completion_length; "
             "overlong pen., penalized: DAPO's mean shaping and the share it lowers; staleness: overlapped "
             "generation's `async/staleness` (the mean over the step's generation rounds); held-out: the evaluation "
             "after that step.", ""]
    for s in seeds:
        budget = runs[s][REFERENCE]["train_seconds"]
        for m in order:
            if m in runs[s] and runs[s][m].get("steps_log"):
                parts += [f"## seed {s}, {labels[m]}", "", steps_table(runs[s][m], budget), ""]
    return "\n".join(parts)


def plot_seeds(runs, seeds, order, labels, path: str, clock: str, level: float) -> str | None:
    """Mean curves with bootstrap bands (left) and every seed's curves (right panels), training time in x budget."""
    plt = _pyplot()
    if plt is None:
        return None
    xs = [i / 20 for i in range(21)]
    fig = plt.figure(figsize=(13, 5.2))
    grid = fig.add_gridspec(2, 1 + (len(seeds) + 1) // 2, width_ratios=[2.4] + [1] * ((len(seeds) + 1) // 2))
    ax = fig.add_subplot(grid[:, 0])
    colors = {m: ("black" if m == REFERENCE else f"C{i}") for i, m in enumerate(order)}
    for m in order:
        ys = [curve_at(runs[s][m]["curve"], runs[s][REFERENCE]["train_seconds"], xs) for s in seeds if m in runs[s]]
        if not ys:
            continue
        mean = [_mean(col) for col in zip(*ys)]
        band = [bootstrap_ci(list(col), level=level) for col in zip(*ys)]
        ax.plot(xs, mean, color=colors[m], lw=2.2 if m == REFERENCE else 1.4, label=f"{labels[m]} ({len(ys)})")
        ax.fill_between(xs, [b[0] for b in band], [b[1] for b in band], color=colors[m], alpha=0.12)
    targets = [runs[s][REFERENCE]["curve"][-1][1] for s in seeds]
    ax.axhline(_mean(targets), color="tab:red", ls="--", lw=1, label=f"GRPO's target, mean {_mean(targets):.3f}")
    ax.axvline(0.5, color="grey", ls=":", lw=1)
    ax.set_xlabel(f"training time / GRPO's budget ({CLOCK_WORDS[clock]})")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"mean over seeds, {level:.0%} bootstrap band", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    for i, s in enumerate(seeds):
        sub = fig.add_subplot(grid[i % 2, 1 + i // 2])
        budget = runs[s][REFERENCE]["train_seconds"]
        for m in order:
            if m in runs[s]:
                ts, accs = zip(*runs[s][m]["curve"])
                sub.plot([t / budget for t in ts], accs, marker="o", ms=2, color=colors[m],
                         lw=1.8 if m == REFERENCE else 1.0)
        sub.axhline(runs[s][REFERENCE]["curve"][-1][1], color="tab:red", ls="--", lw=0.8)
        sub.set_title(f"seed {s}", fontsize=8)
        sub.tick_params(labelsize=7)
        sub.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ command line
def parse_seeds(spec: str) -> list[int]:
    """`0,1,2` or `0-4` -> seeds; ValueError naming the option otherwise."""
    seeds = []
    try:
        for part in spec.split(","):
            lo, dash, hi = part.strip().partition("-")
            seeds += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    except ValueError:
        raise ValueError(f"--seeds: expected integers like 0,1,2 or 0-4, got {spec!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: expected distinct integers like 0,1,2 or 0-4, got {spec!r}")
    return seeds


def set_threads(threads: int):
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or inter-op work already started: the intra-op setting still holds
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=None, help=f"comma-separated, among {', '.join(METHODS)} and the "
                        f"--variant names (default: {','.join(DEFAULT_METHODS)}); trl.GRPOTrainer ('grpo') is always "
                        "run first")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=BASE:field=value[,field=value...]: a method with some settings changed (repeat)")
    parser.add_argument("--grpo-steps", type=int, default=20, help="the reference's steps (its time is the budget)")
    parser.add_argument("--eval-points", type=int, default=8, help="held-out evaluations per run (besides step 0)")
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--max-steps-factor", type=float, default=3.0,
                        help="a method stops at this many times the reference's steps even within the budget")
    parser.add_argument("--num-generations", type=int, default=None,
                        help="group size G (default the demo's 4; the batch stays 4 prompts a step): SPEED's own "
                             "runs screen 4 of 16-24")
    parser.add_argument("--clock", choices=CLOCKS, default="work",
                        help="the budget's clock: work (this process's CPU time over a fixed probe's, robust to a "
                             "shared machine; meant with --threads 1), cpu (CPU time) or wall")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (intra- and inter-op)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of a one-seed run")
    parser.add_argument("--seeds", default=None, help="several seeds (0,1,2 or 0-4): one process per (seed, method), "
                        "results in --out/seed<s>/, the report in --out")
    parser.add_argument("--jobs", type=int, default=1, help="with --seeds: runs at a time")
    parser.add_argument("--force", action="store_true", help="with --seeds: rerun the runs already stored")
    parser.add_argument("--order", choices=("seed", "method"), default="seed",
                        help="with --seeds: start the runs seed by seed, or method by method")
    parser.add_argument("--report", metavar="DIR", default=None, help="only rebuild the multi-seed report of DIR")
    parser.add_argument("--server-url", default=None,
                        help="the vLLM server of the methods that generate on one (grpo_async, ...); default: one "
                             "`trl-ppo-variants vllm-serve` started for the run (run this script with .venv-vllm)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one (seed, method): run_seeds' child
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(argv)

    def fail(message: str) -> int:
        print(f"time_to_accuracy: error: {message}", file=sys.stderr)
        return 2

    if opts.report:
        print(report(opts.report)["markdown"])
        return 0
    try:
        known = known_methods(opts.variant)
        methods = select_methods(opts.methods, known)
        seeds = parse_seeds(opts.seeds) if opts.seeds else None
    except ValueError as e:
        return fail(str(e))
    if min(opts.grpo_steps, opts.eval_points, opts.eval_prompts, opts.eval_samples, opts.threads, opts.jobs) < 1:
        return fail("--grpo-steps, --eval-points, --eval-prompts, --eval-samples, --threads, --jobs: expected "
                    "integers >= 1")
    if seeds is not None and opts.out is None:
        opts.out = os.path.join(DEFAULT_OUT, f"time_to_accuracy_{time.strftime('%Y-%m-%d')}")
    opts.out = opts.out or DEFAULT_OUT
    if opts.job:
        if len(seeds or []) != 1 or not opts.methods or "," in opts.methods:
            return fail("--job: expected one seed and one method")
        set_threads(opts.threads)
        import transformers

        transformers.logging.set_verbosity_error()
        run_job(known[opts.methods.strip()], seeds[0], opts, progress=lambda s: print(s, flush=True))
        return 0
    if seeds is not None:
        with benchmark_server(methods, opts):
            failures = run_seeds(opts, methods, seeds, progress=lambda s: print(s, flush=True))
        if os.path.exists(result_path(opts.out, seeds[0], REFERENCE)) or load_runs(opts.out):
            print(report(opts.out)["markdown"])
        return 1 if failures else 0
    set_threads(opts.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    task = smollm2_task(opts.seed, opts.eval_prompts, opts.eval_samples, num_generations=opts.num_generations)
    with benchmark_server(methods, opts):
        result = run_benchmark(task, methods, grpo_steps=opts.grpo_steps, eval_points=opts.eval_points,
                               seed=opts.seed, out=opts.out, max_steps_factor=opts.max_steps_factor, clock=opts.clock,
                               progress=lambda s: print(s, flush=True), server_url=opts.server_url)
    print()
    print(result["table"])
    print(f"\ntime_to_accuracy: results -> {opts.out}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
