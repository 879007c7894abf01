"""Trainers of the package with `max_staleness=1` against a real vLLM server process (vLLM's CPU build).

    python tests/scripts/async_server.py OUT.json BASE_URL MODEL_DIR CASE [CASE ...]
    accelerate launch --num_processes 2 tests/scripts/async_server.py OUT_DIR/ BASE_URL MODEL_DIR CASE ...

The server at BASE_URL serves MODEL_DIR (`vllm_colocate.build_model("tied")`). Each case (a name of
`vllm_colocate.CASES`, or of `EXTRA_CASES`) builds its trainer in server mode with `max_staleness=1`, trains `STEPS`
steps and reports: the requests answered (global step, completions a prompt, the policy version that generated them,
whether it was queued ahead: `AsyncRollout.history`, main process), the logged numbers, how far the policy moved;
the ratio cases also record, at every micro-batch of the loss, how the clipped objective's weights relate to the
sampling policy's log-probs (`record_ratios`). Under `accelerate launch` (OUT ends with `/`) each rank writes its own
OUT/rank{r}.json.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_colocate  # noqa: E402
from vllm_colocate import CASES, case_trainer, moved, numeric_logs  # noqa: E402
from vllm_server import full_parameters, run_cases, server_settings  # noqa: E402

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

import torch  # noqa: E402

torch.set_num_threads(1)

STEPS = 3


def spread_reward(completions, **kwargs):
    """A number that differs between almost any two different completions (`vllm_colocate.varied_reward`, the
    count of distinct characters, ties often in groups of short answers): a step whose groups hold different
    completions moves the policy. Installed as the cases' "varied" reward (and inside their "mixed" one)."""
    return [float(sum(map(ord, c if isinstance(c, str) else c[-1]["content"])) % 97) / 97 for c in completions]


vllm_colocate.varied_reward = spread_reward

#: GRPO with TRL's correction left untruncated (its weight is pi_old / pi_sampling exactly), and without it
EXTRA_CASES = {
    # DAPO without over-sampling: its first round is the dataloader's batch (queued ahead), its refills fresh
    "dapo_first_round": ("dapo", {"max_generation_rounds": 4, "max_oversample_factor": 1.0}, {"reward": "mixed"}),
    # DAPO over-sampling from its first step (estimate 0.5): the batch and refill prompts, planned and queued ahead
    "dapo_oversampled": ("dapo", {"max_generation_rounds": 4, "keep_rate_init": 0.5}, {"reward": "mixed"}),
    "ratio_on": ("grpo", {"vllm_importance_sampling_mode": "token_truncate",
                          "vllm_importance_sampling_clip_max": 1e6}, {}),
    "ratio_off": ("grpo", {"vllm_importance_sampling_correction": False}, {}),
}


def record_ratios(trainer, records: list) -> None:
    """At every loss micro-batch: the policy's log-probs (a no-grad forward, the weights the loss sees), and
    `objective_vs_sampling`: max |w r / exp(logp - sampling) - 1| over the loss tokens, w r being the weight the clipped
    objective gives a token (TRL's importance weight w, 1 without the correction, times its ratio r = exp(logp -
    old), r = 1 without old log-probs), against the ratio to the sampling policy; `sampling_gap`: max |logp -
    sampling|."""
    loss = trainer._compute_loss

    def recorded(model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, inputs["completion_ids"].size(1))
        keep = inputs["completion_mask"].bool()
        sampling = inputs["sampling_per_token_logps"]
        old = inputs.get("old_per_token_logps")
        weight = inputs.get("importance_sampling_ratio")
        ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
        weighted = ratio * (1.0 if weight is None else weight)
        target = torch.exp(logps - sampling)
        records.append({"step": trainer.state.global_step, "has_old": old is not None, "has_weight": weight is not None,
                        "objective_vs_sampling": ((weighted - target) / target)[keep].abs().max().item(),
                        "sampling_gap": (logps - sampling)[keep].abs().max().item()})
        return loss(model, inputs)

    trainer._compute_loss = recorded


def run_case(name: str, base_url: str, model_dir: str) -> dict:
    case = EXTRA_CASES.get(name) or CASES[name]
    start = time.perf_counter()
    trainer = case_trainer(case, model_dir, engine={**server_settings(base_url), "max_staleness": 1})
    result = {"case": name, "world": trainer.accelerator.num_processes, "build_seconds": time.perf_counter() - start,
              "async": type(trainer._async).__name__,
              "deepspeed_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
              if trainer.is_deepspeed_enabled else None}
    records = []
    if name.startswith("ratio"):
        record_ratios(trainer, records)
    trainer.args.max_steps = STEPS  # a step whose groups hold one completion each leaves the policy as it was
    initial = full_parameters(trainer)
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    final = full_parameters(trainer)
    result["policy_moved"] = moved(initial, final, policy=True)
    result["critic_moved"] = moved(initial, final, policy=False)
    result["steps"] = trainer.state.global_step
    result["history"] = [list(h) for h in trainer._async.history]
    result["pending_after"] = sum(len(v) for v in trainer._async.pending.values())
    result["ratios"] = records
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


def main(out: str, base_url: str, model_dir: str, *names: str) -> None:
    unknown = [n for n in names if n not in CASES and n not in EXTRA_CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}")
    run_cases(out, names, lambda name: run_case(name, base_url, model_dir))

if __name__ == "__main__":
    main(*sys.argv[1:])
    from trl_ppo_variants.distributed import finish

    finish(0)
