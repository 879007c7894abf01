"""2-process reliability checks (run under `accelerate launch --num_processes 2`; see tests/test_faults.py).

1. Completions hit the length limit on process 0 only (its EOS and pad are suppressed, and `mask_truncated_completions=True`
   masks every one of its rows out of the loss): for every trainer of the package, 2 steps finish (no hang: the
   test has a timeout), both processes train on the same number of rows each step, the loss is finite and the
   weights are identical on both processes afterwards.
2. A reward function that raises on process 1 only: both processes stop with a one-line error (no hang).

Each process writes `<out>/rank{r}.json`.
"""

import json
import math
import os
import sys

import torch
from _common import flat_weights, main_then_finish, model_and_out_dirs
from reliability_helpers import available_specs, make_trainer

from trl_ppo_variants.toy import addition_reward


def length_limit_on_one_rank(name, model_dir, out):
    import pathlib

    rows = []
    trainer = make_trainer(name, model_dir, pathlib.Path(out), f"run-{name}", max_steps=2,
                           mask_truncated_completions=True, **({"value_pretrain_steps": 1} if "vapo" in name else {}))
    rank = trainer.accelerator.process_index
    if rank == 0:  # process 0 never emits EOS (nor pad, which TRL also counts as an end): every completion runs
        # into max_completion_length
        tok = trainer.processing_class
        trainer.generation_config.suppress_tokens = [tok.eos_token_id, tok.pad_token_id]
    original = trainer._prepare_inputs

    def recording(batch):
        inputs = original(batch)
        if trainer.model.training:
            rows.append(int(inputs["completion_ids"].shape[0]))
        return inputs

    trainer._prepare_inputs = recording
    trainer.train()
    weights = flat_weights(trainer)
    gathered = trainer.accelerator.gather(weights.unsqueeze(0))
    row_counts = trainer.accelerator.gather(torch.tensor([rows], dtype=torch.long))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    clipped = [e.get("completions/clipped_ratio") for e in trainer.state.log_history if "loss" in e]
    return {
        "steps": trainer.state.global_step,
        "rows": rows,
        "rows_equal_across_ranks": bool((row_counts == row_counts[0]).all()),
        "weights_equal_across_ranks": bool(torch.equal(gathered[0], gathered[1])),
        "weights_changed": bool(not torch.equal(weights, flat_weights_initial(model_dir))),
        "losses_finite": all(math.isfinite(x) for x in losses) and len(losses) == 2,
        "clipped_ratio": clipped,
    }


_INITIAL = {}


def flat_weights_initial(model_dir):
    if model_dir not in _INITIAL:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        _INITIAL[model_dir] = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    return _INITIAL[model_dir]


def raise_on_one_rank(model_dir, out):
    import pathlib

    def rank1_breaks(completions, answer, **kwargs):
        if int(os.environ.get("RANK", "0")) == 1:
            raise KeyError("the grader of process 1 is down")
        return addition_reward(completions, answer)

    trainer = make_trainer("rloo", model_dir, pathlib.Path(out), "run-raise", reward=[rank1_breaks], max_steps=2)
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the result is what the test checks
        return {"error_type": type(exc).__name__, "message": str(exc), "steps": trainer.state.global_step}
    return {"error_type": None, "message": "", "steps": trainer.state.global_step}


def main():
    model_dir, out = model_and_out_dirs()
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else [n for n in available_specs()
                                                               if n not in ("vapo_pretrain", "rloo_kl")]
    result = {"length_limit": {}}
    for name in names:
        result["length_limit"][name] = length_limit_on_one_rank(name, model_dir, out)
    result["raise"] = raise_on_one_rank(model_dir, out)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main_then_finish(main)
