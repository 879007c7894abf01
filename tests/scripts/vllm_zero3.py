"""Trainers under TRL's vLLM colocate mode with several processes (DDP or DeepSpeed ZeRO-3), vLLM's CPU build.

    accelerate launch [--config_file tests/configs/critic_zero3.yaml | --multi_gpu ...] --num_processes 2 \
        tests/scripts/vllm_zero3.py MODEL_DIR OUT_DIR CASE [CASE ...]

Each process builds its own engine (TRL: `distributed_executor_backend="external_launcher"`, one engine per rank with
`vllm_tensor_parallel_size=1`; eager, as `vllm_colocate.py`'s runs but `tied`), shared by the process's cases as in
`vllm_colocate.py` (`share_one_engine`); the case
`grpo_tp2` instead splits one engine over both processes (TRL's tensor-parallel groups: each rank holds half of each
layer and generates both ranks' prompts), in a launch of its own. Per case (a name of `vllm_colocate.CASES` or
`grpo_tp2`): build the trainer, sync (under ZeRO-3 TRL gathers each parameter), measure the
engine against the policy's forward on fixed completions, train 2 steps generating with the engine, sync and measure
again. The policy's forward runs through the (DeepSpeed) model on every rank at the same time: under ZeRO-3 its
hooks gather the sharded parameters, a collective. Each rank writes OUT_DIR/rank{r}.json: {case: result}.
"""

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vllm_colocate: the cases and the measurement

from vllm_colocate import (  # noqa: E402
    CASES, case_trainer, fixed_logps, max_difference, moved, numeric_logs, record_generate_calls, share_one_engine,
    text_items)

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

import torch  # noqa: E402

torch.set_num_threads(1)


#: this script's own cases: the engine split over both processes (TRL's tensor-parallel groups); a different engine,
#: so a launch of its own (one engine per process)
CASES = {**CASES, "grpo_tp2": ("grpo", {"vllm_tensor_parallel_size": 2}, {})}


def full_parameters(trainer) -> dict:
    """{name: full tensor} of the trained model's parameters on every rank (ZeRO-3: gathered, a collective)."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = list(model.named_parameters())
    sharded = [p for _, p in params if hasattr(p, "ds_id")]
    if not sharded:
        return {n: p.detach().clone() for n, p in params}
    import deepspeed

    with deepspeed.zero.GatheredParameters(sharded):
        return {n: p.detach().clone() for n, p in params}


def policy_fixed_logps(trainer, items) -> list[torch.Tensor]:
    """`fixed_logps` of the policy's forward with its full parameters. ZeRO-3 before training: its parameters are
    sharded but DeepSpeed's hooks, which gather them in a forward, come with `deepspeed.initialize` (at `train`), so
    they are gathered around the forward; after it the forward runs through the hooks."""
    sharded = [p for p in trainer.model.parameters() if hasattr(p, "ds_id")]
    if not sharded or trainer.model_wrapped is not trainer.model:
        return fixed_logps(trainer, items, engine=False)
    import deepspeed

    with deepspeed.zero.GatheredParameters(sharded):
        return fixed_logps(trainer, items, engine=False)


def local_fraction(trainer) -> float:
    """The share of the model's parameter elements this rank holds (ZeRO-3: its partitions, ~1/world; else 1)."""
    params = list(trainer.model.parameters())
    full = sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in params)
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_id") else p.numel() for p in params) / full


def run_case(name: str, model_dir: str, items: list) -> dict:
    start = time.perf_counter()
    trainer = case_trainer(CASES[name], model_dir)
    result = {"case": name, "engine": type(trainer.vllm_generation).__name__,
              "world": trainer.accelerator.num_processes,
              "deepspeed_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
              if trainer.is_deepspeed_enabled else None, "build_seconds": time.perf_counter() - start}
    trainer.vllm_generation.sync_weights()  # the engine may hold the previous case's policy
    initial_policy = policy_fixed_logps(trainer, items)
    result["untrained"] = max_difference(fixed_logps(trainer, items, engine=True), initial_policy)
    initial = full_parameters(trainer)
    calls = []
    record_generate_calls(trainer, calls)
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    result["local_fraction"] = local_fraction(trainer)  # after `train`: LoRA adapters are partitioned by then
    final = full_parameters(trainer)
    result["policy_moved"] = moved(initial, final, policy=True)
    result["critic_moved"] = moved(initial, final, policy=False)
    trainer.vllm_generation.sync_weights()
    engine = fixed_logps(trainer, items, engine=True)
    result["trained"] = max_difference(engine, policy_fixed_logps(trainer, items))
    result["engine_vs_initial_policy"] = max_difference(engine, initial_policy)
    result["steps"] = trainer.state.global_step
    result["generate_calls"] = calls  # (step, rows): this rank's engine generated this rank's completions
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


def main(model_dir: str, out_dir: str, *names: str) -> None:
    from transformers import AutoTokenizer

    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: expected some of {list(CASES)}")
    share_one_engine(enforce_eager=True)  # the compiled engine's sync: vllm_colocate's `tied` run
    items = text_items(AutoTokenizer.from_pretrained(model_dir))
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = run_case(name, model_dir, items)
        except Exception as e:  # recorded; the other rank may hang in a collective, the test's timeout ends it
            results[name] = {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(f"rank {rank}:", json.dumps({k: v for k, v in results[name].items() if k not in ("logs", "traceback")}),
              flush=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # after every case: a crash keeps what ran
            json.dump(results, f)


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    main(*sys.argv[1:])
    from trl_ppo_variants.distributed import finish

    finish(0)  # destroys vLLM's groups before the default one (no exit-time traceback from vLLM's finalizer)
