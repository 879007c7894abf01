"""Where a training step's time goes with vLLM colocate on CPU against HF `generate` (a benchmark, not a test).

    .venv-vllm/bin/python bench/vllm_speed.py [--sizes demo,large] [--steps 3] [--out bench/results]

SmolLM2-135M-Instruct (`trl_ppo_variants.smollm2`, fp32) on its word problems, GRPO (`beta=0`) as this package's
`GRPOTrainer` ("ours") and `trl.GRPOTrainer` ("trl", its colocate engine built with this package's CPU fixes:
`vllm_cpu.cpu_colocate_engine`; without them TRL's first sync fails). Sizes: "demo" (`make demo`'s step: 16
completions of at most 24 tokens) and "large" (64 completions of at most 128 tokens, where generation dominates).

Each step is split by timing the trainer's own calls (wall clock, the first step of each run dropped as warm-up):
`sync` (the weight sync into the engine; vLLM only), `generation` (TRL's `_generate_single_turn` less the sync),
`scoring` (the rest of `_generate_and_score_completions`: rewards, the old-policy forward of TRL's importance-sampling
correction, advantages), `training` (the rest of the step: the loss's forward, backward, optimizer). The sync is split
further: `reload_init` / `reload_finalize` (vLLM's layerwise reload around the load: the CPU layers' weights are
unpacked, then packed again for oneDNN), `load` (TRL's per-parameter `load_weights`), `head` (the tied head packed
again).

One vLLM engine per process: the HF runs take one worker process, the vLLM runs another, whose runs share the one
engine (`tests/scripts/vllm_colocate.share_one_engine`). Writes `vllm_speed.json` and `vllm_speed.md` to `--out`.
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

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

SIZES = {"demo": {"per_device_train_batch_size": 16, "max_completion_length": 24},
         "large": {"per_device_train_batch_size": 64, "max_completion_length": 128}}
PHASES = ("sync", "generation", "scoring", "training", "step")
SYNC_PARTS = ("reload_init", "load", "reload_finalize", "head")
#: the engine's share of memory (SmolLM2 needs ~0.15 of a 2-core CI machine's; every run shares one engine)
ENGINE = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.15, "vllm_max_model_length": 512}


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
        timed(vllm_cpu, "repack_tied_head", current, "head")

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


def build(which: str, use_vllm: bool, size: str, steps: int, model_dir: str):
    """GRPO ("ours" or "trl") on SmolLM2's word problems at `size`."""
    import trl

    from trl_ppo_variants import vllm_cpu
    from trl_ppo_variants.smollm2 import word_problem_dataset, word_problem_reward
    from trl_ppo_variants.trainers.grpo import GRPOConfig, GRPOTrainer

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if which == "ours" else (trl.GRPOConfig, trl.GRPOTrainer)
    settings = SIZES[size]
    args = config_cls(
        output_dir=tempfile.mkdtemp(prefix="vllm_speed_"), num_generations=4, learning_rate=3e-5, temperature=0.7,
        beta=0.0, max_steps=steps, seed=0, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", disable_tqdm=True, use_vllm=use_vllm, **(ENGINE if use_vllm else {}), **settings)
    prompts = settings["per_device_train_batch_size"] // 4 * steps
    with vllm_cpu.cpu_colocate_engine(args):  # ours does this itself; trl.GRPOTrainer needs it on CPU
        return trainer_cls(model_dir, word_problem_reward, args=args, train_dataset=word_problem_dataset(prompts, seed=0))


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


def worker(backend: str, jobs: list[tuple[str, str]], steps: int, out: str, profile_sync: bool = False) -> None:
    """Run the (size, trainer) jobs with one backend in this process (vLLM: one engine shared by every job)."""
    import torch

    from trl_ppo_variants.smollm2 import smollm2_checkpoint

    torch.manual_seed(0)
    model_dir = smollm2_checkpoint()
    if backend == "vllm":
        sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
        from vllm_colocate import share_one_engine

        share_one_engine()
    results = []
    for size, which in jobs:
        start = time.perf_counter()
        trainer = build(which, backend == "vllm", size, steps, model_dir)
        built = time.perf_counter() - start
        per_step = []
        instrument(trainer, per_step)
        trainer.train()
        results.append({"backend": backend, "trainer": which, "size": size, "build_seconds": built,
                        "steps": per_step})
        if backend == "vllm" and profile_sync:
            results[-1]["sync_profile"] = sync_profile(trainer)
        print(json.dumps(results[-1]), flush=True)
        with open(out, "w") as f:  # after every job: an interrupted run keeps what ran
            json.dump(results, f)
        del trainer


def summarise(run: dict) -> dict:
    """Median of each phase over the steps after the first (the first: warm-up)."""
    kept = run["steps"][1:] or run["steps"]
    return {key: statistics.median(s[key] for s in kept) for key in (*PHASES, *SYNC_PARTS)}


def table(results: list[dict]) -> str:
    lines = ["| size | trainer | engine | step (s) | sync | generation | scoring | training | sync parts: reload init / "
             "load / reload finalize / tied head |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in results:
        m = summarise(run)
        parts = " / ".join(f"{m[k]:.2f}" for k in SYNC_PARTS) if run["backend"] == "vllm" else "-"
        lines.append(f"| {run['size']} | {run['trainer']} | {run['backend']} | {m['step']:.2f} | "
                     f"{m['sync']:.2f} | {m['generation']:.2f} | {m['scoring']:.2f} | {m['training']:.2f} | {parts} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,large")
    parser.add_argument("--trainers", default="ours,trl", help="ours and/or trl")
    parser.add_argument("--large-trainers", default="ours", help="trainers at the large size (its steps are long)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--profile-sync", action="store_true", help="cProfile one more sync after each vLLM run")
    parser.add_argument("--only", choices=["hf", "vllm"], help="run one backend only")
    parser.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-jobs", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    jobs = [(size, which) for size in opts.sizes.split(",")
            for which in (opts.large_trainers if size == "large" else opts.trainers).split(",")]
    if opts.worker:
        worker(opts.worker, [tuple(job.split(":")) for job in opts.worker_jobs.split(",")], opts.steps,
               opts.worker_out, opts.profile_sync)
        return 0
    results = []
    for backend in [opts.only] if opts.only else ["hf", "vllm"]:
        out = tempfile.mktemp(suffix=".json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", backend, "--worker-jobs",
                        ",".join(f"{size}:{which}" for size, which in jobs), "--steps", str(opts.steps),
                        "--worker-out", out, *(["--profile-sync"] if opts.profile_sync else [])], check=False)
        if os.path.exists(out):
            with open(out) as f:
                results.extend(json.load(f))
    import torch

    from trl_ppo_variants.vllm_cpu import engine_runs_on_cpu

    order = {"demo": 0, "large": 1}
    results.sort(key=lambda r: (order[r["size"]], r["trainer"], r["backend"]))
    text = table(results)
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    meta = {"model": "SmolLM2-135M-Instruct (fp32)", "steps": opts.steps, "torch_threads": torch.get_num_threads(),
            "vllm_on_cpu": engine_runs_on_cpu(), "cpu_count": os.cpu_count(), "sizes": SIZES}
    with open(os.path.join(opts.out, "vllm_speed.json"), "w") as f:
        json.dump({"meta": meta, "runs": results}, f, indent=1)
    with open(os.path.join(opts.out, "vllm_speed.md"), "w") as f:
        f.write(f"# vLLM colocate on CPU vs HF generate: one GRPO step ({meta['model']})\n\n"
                f"Seconds, wall clock, median over steps 2-{opts.steps} of each run; {meta['cpu_count']} CPUs.\n\n"
                f"{text}\n")
    return 0


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    sys.exit(main())
