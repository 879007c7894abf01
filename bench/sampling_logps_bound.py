"""How far the sampling log-probs recorded during HF `generate` (`sampling_logps_source="generate"`) are from the
training forward's (issue 28, item 6): the step-0 KL in the reward with policy == reference, which is exactly their
mean difference, over prompt paddings and completion lengths, in fp32 and under bf16 autocast over fp32 weights, with
and without a LoRA adapter.

    python bench/sampling_logps_bound.py [--model toy|smollm2] [--pad-words 0,1,...,6] [--lengths 4,8,16,32]
                                         [--seeds 0,1] [--out FILE]

Each cell is one fresh `RLOOTrainer` (`beta=0.05`, temperature 0.9, repetition penalty 1.2, 8 prompts x 4 completions
on one process by default (`--batch`), CPU) trained for one optimizer step. Prompt i is lengthened by `i % (P + 1)`
words ("a ") for a padding of P words, so a batch holds rows left-padded by 0 to P words (the toy tokenizer reads a
word as 2 tokens; the word problems of SmolLM2 differ in length already, so they are padded at P = 0 too). Every
completion is forced to the full length (`min_new_tokens`: a logits processor, so not in the recorded raw logits). A
spy on `sampling_logps` takes the recorded log-probs and runs the training forward (TRL's
`_get_per_token_logps_and_entropies`, under the trainer's autocast) on the same batch before the update. Measured per
cell, over the loss tokens:

- `max_token`: max |recorded - forward| per token;
- `max_sequence`: max over completions of |sum of (recorded - forward)| (what one reward is shifted by, / the KL
  coefficient);
- `kl`: the logged `kl_in_reward` of the step (the mean per-token k1 against the reference; the reference's forward
  equals the policy's here, so this is the mean of recorded - forward).

A cell with `sampling_logps_source="forward"` is run per precision as a control (its KL must be 0). Prints a table (max
over seeds of each number) and bench/README.md's bf16 table and writes every cell to `--out` (default
`bench/results/sampling_logps_bound.json` for the toy model, `..._smollm2.json` for SmolLM2, `..._eager.json` with
`--attn eager`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env(TRANSFORMERS_VERBOSITY="error")

RESULTS = os.path.join(HERE, "results")
#: LoRA target modules per model (Llama / Qwen3 attention projections); LoRA's B starts at 0: policy == reference
LORA_TARGETS = ["q_proj", "v_proj"]


def padded_prompts(model: str, pad_words: int, n: int = 64):
    """The model's training prompts, prompt i lengthened by `i % (pad_words + 1)` words in front."""
    from datasets import Dataset

    if model == "toy":
        from trl_ppo_variants.toy import addition_dataset

        rows = [dict(row) for row in addition_dataset(n, seed=0)]
    else:
        from trl_ppo_variants.smollm2 import word_problem_dataset

        rows = [dict(row) for row in word_problem_dataset(n, seed=0)]
    for i, row in enumerate(rows):
        words = "a " * (i % (pad_words + 1))
        if isinstance(row["prompt"], list):  # a conversation: the question is the last message
            last = dict(row["prompt"][-1], content=words + row["prompt"][-1]["content"])
            row["prompt"] = row["prompt"][:-1] + [last]
        else:
            row["prompt"] = words + row["prompt"]
    return Dataset.from_list(rows)


def measure(model_dir: str, model: str, pad_words: int, length: int, bf16: bool, lora: bool, seed: int = 0,
            source: str = "generate", output_dir: str | None = None, attn: str | None = None, batch: int = 32) -> dict:
    """One cell: a fresh trainer, one step, the numbers of the module docstring."""
    import torch
    from peft import LoraConfig
    from trl import GRPOTrainer

    from trl_ppo_variants import rollout
    from trl_ppo_variants.toy import addition_reward
    from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer

    reward = addition_reward
    if model != "toy":
        from trl_ppo_variants.smollm2 import word_problem_reward as reward
    args = RLOOConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="logps_bound_"), per_device_train_batch_size=batch,
        num_generations=4, max_completion_length=length, max_steps=1, learning_rate=1e-3, logging_steps=1,
        report_to=[], use_cpu=True, seed=seed, save_strategy="no", disable_tqdm=True, beta=0.05, bf16=bf16,
        temperature=0.9, repetition_penalty=1.2, sampling_logps_source=source,
        generation_kwargs={"min_new_tokens": length},
        model_init_kwargs={"attn_implementation": attn} if attn else None,
    )
    trainer = RLOOTrainer(model_dir, reward, args=args, train_dataset=padded_prompts(model, pad_words),
                          peft_config=LoraConfig(r=4, target_modules=LORA_TARGETS) if lora else None)
    seen = []
    sampling_logps = trainer.sampling_logps

    def spy(output):
        used = sampling_logps(output)
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            forward = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, trainer.model, ids, attention, output["completion_ids"].shape[1])[0]
        seen.append((output["prompt_mask"], used, forward, rollout.loss_mask(output).bool()))
        return used

    trainer.sampling_logps = spy
    trainer.train()
    prompt_mask, used, forward, mask = seen[0]
    diff = torch.where(mask, used - forward, torch.zeros_like(used))
    return {
        "model": model, "pad_words": pad_words, "length": length, "precision": "bf16" if bf16 else "fp32",
        "lora": lora, "seed": seed, "source": source, "attn": attn or "default",
        "batch": batch, "max_pad_tokens": int((prompt_mask == 0).sum(1).max()),
        "tokens": int(mask.sum()),
        "max_token": diff.abs().max().item(),
        "max_sequence": diff.sum(1).abs().max().item(),
        "kl": trainer.state.log_history[0]["kl_in_reward"],
        "fallback": trainer.state.log_history[0].get("sampling_logps/forward_fallback"),
    }


def shown(value: float) -> str:
    """A measured number as the docs state it: 2 significant digits, below 0.01 with an exponent without a leading
    zero (0.072, 9.2e-4)."""
    text = f"{value:.1e}" if 0 < abs(value) < 0.01 else f"{value:.2g}"
    mantissa, _, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else text


def table(cells: list[dict]) -> str:
    """Markdown: a row per (precision, LoRA, padding), a column per length; max over seeds of `max_token` /
    `max_sequence` / |kl|."""
    lengths = sorted({c["length"] for c in cells if c["source"] == "generate"})
    keys = sorted({(c["precision"], c["lora"], c["pad_words"]) for c in cells if c["source"] == "generate"},
                  key=lambda k: (k[0] != "fp32", k[1], k[2]))
    lines = ["| precision | LoRA | pad words (max pad tokens) | "
             + " | ".join(f"{n} tokens: max token / max sequence / abs KL" for n in lengths) + " |",
             "|---|---|---|" + "---|" * len(lengths)]
    for precision, lora, pad in keys:
        row = [c for c in cells if (c["precision"], c["lora"], c["pad_words"], c["source"])
               == (precision, lora, pad, "generate")]
        pads = max(c["max_pad_tokens"] for c in row)
        values = []
        for n in lengths:
            at = [c for c in row if c["length"] == n]
            values.append("-" if not at else " / ".join(shown(max(f(c) for c in at)) for f in (
                lambda c: c["max_token"], lambda c: c["max_sequence"], lambda c: abs(c["kl"]))))
        lines.append(f"| {precision} | {'yes' if lora else 'no'} | {pad} ({pads}) | " + " | ".join(values) + " |")
    for c in cells:
        if c["source"] == "forward":
            lines.append(f"\ncontrol, sampling_logps_source='forward', {c['precision']}, pad {c['pad_words']} words, "
                         f"{c['length']} tokens: KL {c['kl']:.3g}, max token {c['max_token']:.3g}")
    return "\n".join(lines)


def bf16_table(cells: list[dict]) -> str:
    """Markdown, bench/README.md's: bf16 without LoRA, a row per padding, a column per length; max over seeds of
    `max_token` / |kl|."""
    cells = [c for c in cells if c["source"] == "generate" and c["precision"] == "bf16" and not c["lora"]]
    lengths = sorted({c["length"] for c in cells})
    lines = ["| pad words (pad tokens) | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for pad in sorted({c["pad_words"] for c in cells}):
        row = [c for c in cells if c["pad_words"] == pad]
        values = [" / ".join(shown(max(f(c) for c in row if c["length"] == n)) for f in (
            lambda c: c["max_token"], lambda c: abs(c["kl"]))) for n in lengths]
        lines.append(f"| {pad} ({max(c['max_pad_tokens'] for c in row)}) | " + " | ".join(values) + " |")
    return "\n".join(lines)


def summary(cells: list[dict]) -> dict:
    """The bound per precision: the max of each number over every recorded cell."""
    out = {}
    for precision in sorted({c["precision"] for c in cells}):
        at = [c for c in cells if c["precision"] == precision and c["source"] == "generate"]
        out[precision] = {"max_token": max(c["max_token"] for c in at),
                          "max_sequence": max(c["max_sequence"] for c in at),
                          "max_abs_kl": max(abs(c["kl"]) for c in at)}
    return out


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("toy", "smollm2"), default="toy")
    parser.add_argument("--pad-words", default="0,1,2,3,4,5,6")
    parser.add_argument("--lengths", default="4,8,16,32")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--lora", default="no,yes")
    parser.add_argument("--attn", default=None, help="attn_implementation (default: the model's, sdpa)")
    parser.add_argument("--batch", type=int, default=32, help="completions per step (groups of 4)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch
    import transformers
    import trl

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.model == "toy":
        from trl_ppo_variants.toy import make_toy_checkpoint

        # the tests' checkpoint (tests/conftest.py: seed 0, 25 warm-up steps)
        model_dir = make_toy_checkpoint(tempfile.mkdtemp(prefix="toy_model_"), seed=0, warm_steps=25)
    else:
        from trl_ppo_variants.smollm2 import smollm2_checkpoint

        model_dir = smollm2_checkpoint()
    suffix = ("" if args.model == "toy" else f"_{args.model}") + (f"_{args.attn}" if args.attn else "")
    out = args.out or os.path.join(RESULTS, f"sampling_logps_bound{suffix}.json")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    cells = []
    started = time.time()
    work = tempfile.mkdtemp(prefix="logps_bound_")
    for precision in args.precisions.split(","):
        bf16 = precision == "bf16"
        for lora in [x == "yes" for x in args.lora.split(",")]:
            for pad in ints(args.pad_words):
                for length in ints(args.lengths):
                    for seed in ints(args.seeds):
                        cell = measure(model_dir, args.model, pad, length, bf16, lora, seed, output_dir=work,
                                       attn=args.attn, batch=args.batch)
                        cells.append(cell)
                        print(json.dumps(cell), flush=True)
        pad, length = max(ints(args.pad_words)), max(ints(args.lengths))
        cells.append(measure(model_dir, args.model, pad, length, bf16, False, 0, "forward", output_dir=work,
                             attn=args.attn, batch=args.batch))
        print(json.dumps(cells[-1]), flush=True)
    result = {
        "cells": cells, "summary": summary(cells),
        "settings": vars(args),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "trl": trl.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": time.time() - started},
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(cells))
    if any(c["precision"] == "bf16" and not c["lora"] for c in cells):
        print("\n" + bf16_table(cells))
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    run()
