"""GPU benchmark: GRPO and every trainer of the package at a realistic shape, in one process, within a time budget.

Offline by construction: the model is Qwen3-0.6B's architecture (hidden 1024, 28 layers, 16 heads, 8 KV heads,
head_dim 128, intermediate 3072, vocab 151936, tied embeddings) with RANDOM weights built from a config, and the
tokenizer is the package's local character tokenizer (the model's vocabulary is padded to 151936; the ids past the
tokenizer's decode to nothing). With random weights the end-of-sequence token is almost never sampled, so every
completion runs to `max_completion_length`: the token counts are fixed and the throughputs comparable. The reward is
a seeded coin flip per completion, so that groups have reward variance (DAPO's filter keeps almost every group and
is measured on its bookkeeping, not on a degenerate all-zero batch); TTRL brings its own vote reward.

Per trainer (one after the other, GPU memory released in between): seconds per optimizer step (median of the
measured steps, after warm-up), generated tokens per second (completion tokens / time inside generation), training
tokens per second (completion tokens reaching the loss / (step time - rollout time): forward, backward, optimizer),
peak GPU memory (`torch.cuda.max_memory_allocated`), generation rounds per step, and the step-time ratio to GRPO.
Results are written after every trainer (`gpu_bench.json`, `gpu_bench.md` in `--out`, default `$OUT` or
`bench/results/gpu`), so a run stopped by the budget keeps what it measured. Trainers that do not fit the remaining
budget are listed as skipped.

    python bench/gpu_bench.py                 # the H200 run (bf16, 64 prompts x 8 completions x 512 tokens)
    python bench/gpu_bench.py --tiny          # a CPU smoke test of the same code path (fp32, tiny shape)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(TRANSFORMERS_VERBOSITY="error")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/algos.py; the package itself is the installed one (on the GPU: its wheel)

import algos  # noqa: E402

T_START = time.perf_counter()

# Qwen/Qwen3-0.6B config.json values
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu")
TINY = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, max_position_embeddings=512)

# Run order: the baseline first, then every algorithm of the package (the registry's order), TRL's RLOO (a peer) last.
DEFAULT_ROWS = [*algos.algorithm_rows(), "trl_rloo"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: hidden 64, 2 layers, 2x4x8, fp32")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results", "gpu"))
    p.add_argument("--algos", default=",".join(DEFAULT_ROWS), help="comma-separated rows (see bench/algos.py)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget of this script, from its start (imports included)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per optimizer step")
    p.add_argument("--gens", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-len", type=int, default=512, help="max_completion_length")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--micro-batch", type=int, default=32, help="completions per forward/backward micro-batch")
    p.add_argument("--steps", type=int, default=2, help="measured steps per trainer (fewer when the budget is short)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per trainer")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.gens, args.max_len, args.prompt_len = 2, 4, 8, 8
        args.micro_batch, args.steps, args.warmup = 8, 1, 1
    if args.dtype is None:
        import torch

        args.dtype = "bf16" if torch.cuda.is_available() and not args.tiny else "fp32"
    n = args.prompts * args.gens
    if n % args.micro_batch:
        raise SystemExit(f"--micro-batch: expected a divisor of prompts x gens = {n}, got {args.micro_batch}")
    return args


def coin_reward(completions, completion_ids=None, **kwargs):
    """A seeded coin flip per completion (hash of its token ids): reward variance without a trained model. The ids,
    not the text: most ids of the padded vocabulary decode to nothing, so many texts are equal (empty)."""
    out = []
    for i, c in enumerate(completions):
        key = str(list(completion_ids[i])) if completion_ids is not None else (c if isinstance(c, str) else
                                                                               c[-1]["content"])
        out.append(float(hashlib.sha1(key.encode()).digest()[0] & 1))
    return out


def build_checkpoint(args, path):
    """Random-weight Qwen3 of the chosen shape + the local tokenizer, saved to `path` (trainers load from a path)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from trl_ppo_variants.toy import build_tokenizer

    tok = build_tokenizer()
    shape = TINY if args.tiny else QWEN3_06B
    if len(tok) > shape["vocab_size"]:
        raise SystemExit(f"tokenizer has {len(tok)} tokens, more than the model's vocabulary {shape['vocab_size']}")
    config = Qwen3Config(**shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with torch.device(device):  # initialising 0.6B parameters on the GPU takes a second, on CPU much longer
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


def dataset(args, n_rows):
    """Prompts of `prompt_len` characters (= tokens for the character tokenizer): filler, then `a+b=`."""
    import random

    from datasets import Dataset

    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    rows = []
    for _ in range(n_rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        tail = f"{a}+{b}="
        rows.append({"prompt": "".join(rng.choice(letters) for _ in range(max(0, args.prompt_len - len(tail)))) + tail,
                     "answer": str(a + b)})
    return Dataset.from_list(rows)


def build_trainer(algo, args, model_dir, work, total_steps, callback):
    import torch
    from transformers import AutoTokenizer

    config_cls, trainer_cls = algo.load()
    n = args.prompts * args.gens
    bf16 = args.dtype == "bf16"
    kwargs = dict(
        output_dir=os.path.join(work, algo.name),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=n // args.micro_batch,  # one generation of all prompts x gens per step
        max_completion_length=args.max_len,
        max_steps=total_steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        seed=args.seed,
        save_strategy="no",
        disable_tqdm=True,
        bf16=bf16,
        gradient_checkpointing=args.grad_ckpt,
        model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        use_cpu=not torch.cuda.is_available(),
    )
    if algo.reward != "own":
        kwargs["num_generations"] = args.gens
    overrides = algo.overrides(args.gens)
    if algo.name == "vapo":
        overrides["value_pretrain_steps"] = 1  # one critic-only step, inside the warm-up
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    tok = AutoTokenizer.from_pretrained(model_dir)
    common = dict(args=config, train_dataset=dataset(args, args.prompts * (total_steps + 2)), processing_class=tok,
                  callbacks=[callback])
    trainer = trainer_cls(model_dir, **common) if algo.reward == "own" else trainer_cls(model_dir, coin_reward,
                                                                                         **common)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def step_timer(sync):
    """A callback recording the wall time between consecutive optimizer steps (first from `on_train_begin`)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.snaps, self.meter, self._t = [], [], None, None

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self._t = time.perf_counter()
            self.snaps.append(self.meter.snapshot())

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            now = time.perf_counter()
            self.times.append(now - self._t)
            self.snaps.append(self.meter.snapshot())
            self._t = now

    return StepTimer()


def run_row(algo, args, model_dir, work, steps, warmup):
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer = step_timer(sync)
    t0 = time.perf_counter()
    trainer = build_trainer(algo, args, model_dir, work, warmup + steps, timer)
    timer.meter = algos.Meter(trainer, sync=sync)
    load_s = time.perf_counter() - t0
    try:
        trainer.train()
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    per_step = [algos.delta(b, a) for a, b in zip(timer.snaps, timer.snaps[1:])]
    measured = list(zip(timer.times, per_step))[warmup:] or list(zip(timer.times, per_step))[-1:]
    secs = [t for t, _ in measured]
    gen_tok = sum(d["gen_tokens"] for _, d in measured)
    gen_time = sum(d["gen_time"] for _, d in measured)
    trained = sum(d["trained_tokens"] for _, d in measured)
    train_time = sum(t - d["rollout_time"] for t, d in measured)
    return {
        "name": algo.name, "label": algo.label, "status": "ok",
        "steps_measured": len(measured), "warmup_steps": warmup if len(timer.times) > warmup else 0,
        "step_s": statistics.median(secs), "step_s_all": timer.times, "load_s": load_s,
        "gen_tokens_per_s": gen_tok / gen_time if gen_time else None,
        "train_tokens_per_s": trained / train_time if train_time > 0 else None,
        "gen_tokens_per_step": gen_tok / len(measured), "trained_tokens_per_step": trained / len(measured),
        "rounds_per_step": sum(d["gen_calls"] for _, d in measured) / len(measured),
        "rollout_s_per_step": sum(d["rollout_time"] for _, d in measured) / len(measured),
        "peak_mem_gib": peak, "peak_reserved_gib": reserved,
    }


def write(results, meta, out):
    os.makedirs(out, exist_ok=True)
    base = next((r for r in results if r["name"] == "grpo" and r["status"] == "ok"), None)
    for r in results:
        if base and r["status"] == "ok":
            r["time_ratio"] = r["step_s"] / base["step_s"]
            if r.get("peak_mem_gib") and base.get("peak_mem_gib"):
                r["mem_ratio"] = r["peak_mem_gib"] / base["peak_mem_gib"]
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    s = meta["settings"]
    lines = [
        f"{meta['machine'].get('gpu', 'CPU (' + meta['machine']['cpu'] + ')')}, {meta['machine']['date']}; "
        f"torch {meta['machine']['torch']}, transformers {meta['machine']['transformers']}, trl {meta['machine']['trl']}. "
        f"Model: Qwen3-0.6B shape ({meta['params'] / 1e6:.0f}M parameters, random weights), {s['dtype']}; "
        f"{s['prompts']} prompts x {s['gens']} completions x {s['max_len']} tokens (prompt {s['prompt_len']}), "
        f"micro-batch {s['micro_batch']}, one generation per optimizer step, HF `generate` (no vLLM).",
        "",
        "| trainer | s/step | vs GRPO | gen tok/s | train tok/s | rollout s/step | peak GiB (vs GRPO) | rounds/step "
        "| steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']} | | | | | | | |")
            continue
        f2 = (lambda x, spec=".2f": "" if x is None else f"{x:{spec}}")
        mem = f2(r.get("peak_mem_gib"), ".1f") + (f" ({r['mem_ratio']:.2f}x)" if r.get("mem_ratio") else "")
        steps = f"{r['steps_measured']}" + ("" if r["warmup_steps"] else " (no warm-up)")
        lines.append(
            f"| {r['label']} | {f2(r['step_s'])} | {f2(r.get('time_ratio'))}x | {f2(r['gen_tokens_per_s'], '.0f')} "
            f"| {f2(r['train_tokens_per_s'], '.0f')} | {f2(r['rollout_s_per_step'])} | {mem} "
            f"| {f2(r['rounds_per_step'])} | {steps} |")
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(min(4, torch.get_num_threads()) if not args.tiny else 1)
    names = [n.strip() for n in args.algos.split(",") if n.strip()]
    unknown = [n for n in names if n not in algos.ALL]
    if unknown:
        raise SystemExit(f"--algos: unknown rows {unknown}; known: {', '.join(algos.ALL)}")
    meta = {"machine": algos.machine_description(), "settings": vars(args), "params": 0}
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as work:
        model_dir = os.path.join(work, "model")
        meta["params"] = build_checkpoint(args, model_dir)
        print(f"model built and saved in {time.perf_counter() - T_START:.0f} s since start", flush=True)
        grpo_step = None
        for i, name in enumerate(names):
            algo = algos.ALL[name]
            try:
                algo.load()
            except algos.MissingTrainer as e:
                results.append({"name": name, "label": algo.label, "status": f"skipped: {e}"})
                write(results, meta, args.out)
                continue
            left = args.budget_s - (time.perf_counter() - T_START)
            steps, warmup = args.steps, args.warmup
            if grpo_step is not None:  # fit the rest of the budget: fewer steps, then no warm-up, then skip
                guess = grpo_step * algo.cost + 15  # + loading the model
                while steps > 1 and (warmup + steps) * guess > left:
                    steps -= 1
                if (warmup + steps) * guess > left:
                    warmup = 0
                if steps * guess > left:
                    results.append({"name": name, "label": algo.label,
                                    "status": f"skipped: time budget ({left:.0f} s left, ~{guess:.0f} s per step)"})
                    write(results, meta, args.out)
                    continue
            print(f"[{time.perf_counter() - T_START:.0f} s] {name}: {warmup} warm-up + {steps} steps", flush=True)
            try:
                row = run_row(algo, args, model_dir, work, steps, warmup)
            except Exception as e:
                traceback.print_exc()
                row = {"name": name, "label": algo.label,
                       "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if name == "grpo" and row["status"] == "ok":
                grpo_step = row["step_s"]
            results.append(row)
            print(write(results, meta, args.out).splitlines()[-1], flush=True)
    meta["total_s"] = time.perf_counter() - T_START
    table = write(results, meta, args.out)
    print(table)
    print(f"wrote {args.out}/gpu_bench.json and gpu_bench.md in {meta['total_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
