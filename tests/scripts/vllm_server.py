"""Trainers of the package against a real vLLM server process (`trl-ppo-variants vllm-serve`, vLLM's CPU build).

    python tests/scripts/vllm_server.py OUT.json BASE_URL MODEL_DIR [--vlm] CASE [CASE ...]
    accelerate launch --num_processes 2 [--config_file ZERO3.yaml] tests/scripts/vllm_server.py OUT_DIR/ ...

The server at BASE_URL serves MODEL_DIR (the toy model of `vllm_colocate.build_model("tied")`). Each case (a name of
`vllm_colocate.CASES`) in turn: builds its trainer with `use_vllm=True, vllm_mode="server"` pointed at the server,
syncs its policy into the server (the server holds the previous case's) and measures the server against the policy's
forward (max per-token |log-prob difference| of fixed completions, scored by the server's prompt log-probs), trains 2
steps generating with the server, syncs once more and measures again, plus the case's own checks (ReMax's greedy
rows against a temperature-0 request and the policy's argmax, the calls of DAPO's rounds and of SPEED / GRESO's
screening). Under `accelerate launch` (OUT ends with `/`: one OUT/rank{r}.json a rank) every rank builds its trainer,
only the main process talks to the server (TRL's server mode), and each rank measures its own policy. With `--vlm`
the server serves the tiny Idefics3 (`vllm_colocate.build_model("vlm")`) and the cases are `VLM_CASES` (`run_vlm_case`).
"""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # vllm_colocate: the cases and the measurement

from vllm_colocate import (  # noqa: E402
    CASES, MAX_COMPLETION, VLM_CASES, case_trainer, image_inputs, max_difference, moved, numeric_logs, policy_logps,
    record_generate_calls, text_items, vlm_items)
from vllm_zero3 import full_parameters, policy_fixed_logps  # noqa: E402  (ZeRO-3: the full parameters)

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

import torch  # noqa: E402

torch.set_num_threads(1)


def server_settings(base_url: str) -> dict:
    """The vLLM settings of every case: server mode at `base_url`, sampling seeded on the server (each request; its
    completions get seed + index: a run is reproducible, as the colocate engine's, which TRL seeds) at temperature
    1.5 (at 1 the toy model's groups were all alike in some runs, and a trainer did not move)."""
    return {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": base_url, "vllm_server_timeout": 30,
            "generation_kwargs": {"seed": 0}, "temperature": 1.5}


def server_logps(client, ids: list[int], start: int) -> torch.Tensor:
    """(len(ids) - start,) the server's log-probs of ids[start:] after ids[:start] (its prompt log-probs)."""
    out = client._post(f"{client.base_url}/v1/completions", json={
        "model": client.model, "prompt": [list(ids)], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    scored = out["choices"][0]["prompt_logprobs"]
    return torch.tensor([scored[i][str(ids[i])]["logprob"] for i in range(start, len(ids))])


def server_scores(client, items) -> list[torch.Tensor]:
    return [server_logps(client, list(p) + list(c), len(p)) for p, _, c, _ in items]


def measure(trainer, client, items) -> tuple[float | None, list]:
    """(max |server - policy| over the fixed completions, the policy's scores); the server's side on the main
    process only (None elsewhere): the others have no client."""
    policy = policy_fixed_logps(trainer, items)
    if client is None:
        return None, policy
    return max_difference(server_scores(client, items), policy), policy


def check_greedy_rows(trainer, client, records: list) -> None:
    """Wrap ReMax's greedy request (main process): its rows must equal a temperature-0 request to the server (same
    weights, same moment) and pick, at every position, a token the policy's forward ranks first (up to `gap`)."""
    greedy = trainer._vllm_greedy

    def checked(greedy_prompts, padded, filler, images=None):
        ids = greedy(greedy_prompts, padded, filler, images)
        # under ZeRO-3 a forward gathers parameters from every rank: every rank runs the same forwards (one a greedy
        # row, an empty row scored on a filler token), the main process compares
        scores = [policy_logps(trainer.model, list(p) + (list(c) or [0]), len(p)) for p, c in zip(greedy_prompts, ids)]
        if client is None:
            return ids
        again = client.generate([list(p) for p in greedy_prompts], n=1, temperature=0.0,
                                max_tokens=MAX_COMPLETION)["completion_ids"]
        gap = 0.0
        for c, logps in zip(ids, scores):
            if not c:
                continue
            chosen = logps.gather(-1, torch.tensor(c)[:, None])[:, 0]
            gap = max(gap, (logps.max(-1).values - chosen).max().item())
        records.append({"rows": len(ids), "equal_to_temperature_0": ids == [list(c) for c in again],
                        "argmax_gap": gap})
        return ids

    trainer._vllm_greedy = checked


def vlm_scores(trainer, items, server: bool) -> list[torch.Tensor]:
    """Per-token log-probs of each fixed VLM completion (`vlm_items`: the processor-expanded prompt, its images): the
    policy's forward with the prompt's image inputs, or the server's prompt log-probs of the same ids with the images'
    features (TRL's way of sending images with token ids: `image_features`, placed at the prompt's image tokens)."""
    import uuid

    generation = trainer.vllm_generation
    client = generation.vllm_client
    scores = []
    for p_ids, _, c_ids, images in items:
        ids = list(p_ids) + list(c_ids)
        if not server:
            logps = policy_logps(trainer.model, ids, len(p_ids), image_inputs(trainer.processing_class, images))
            scores.append(logps.gather(-1, torch.tensor(c_ids)[:, None])[:, 0])
            continue
        features = None
        if images:
            features = generation._place_features(client.image_features([images])[0], list(p_ids))
        out = client._post(f"{client.base_url}/inference/v1/generate", json={
            "request_id": f"score-{uuid.uuid4().hex}", "model": client.model, "token_ids": ids, "features": features,
            "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "output_kind": 2}})
        scored = out["prompt_logprobs"]
        scores.append(torch.tensor([scored[i][str(ids[i])]["logprob"] for i in range(len(p_ids), len(ids))]))
    return scores


def run_vlm_case(name: str, base_url: str, model_dir: str) -> dict:
    """A `VLM_CASES` entry against a server of the tiny Idefics3: 2 steps on batches that mix a prompt with an image
    and one without, the server measured against the policy on fixed completions with two images and without one."""
    trainer = case_trainer(VLM_CASES[name], model_dir, vlm=True, engine=server_settings(base_url))
    items = vlm_items(trainer.processing_class)
    result = {"case": name, "generation": type(trainer.vllm_generation).__name__}
    trainer.vllm_generation.sync_weights()  # the server holds the previous case's policy
    initial_policy = vlm_scores(trainer, items, server=False)
    result["untrained"] = max_difference(vlm_scores(trainer, items, server=True), initial_policy)
    calls, image_rows = [], []
    record_generate_calls(trainer, calls, image_rows, [])
    initial = full_parameters(trainer)
    trainer.train()
    result["policy_moved"] = moved(initial, full_parameters(trainer), policy=True)
    trainer.vllm_generation.sync_weights()
    served, policy = vlm_scores(trainer, items, server=True), vlm_scores(trainer, items, server=False)
    result["trained"] = max_difference(served, policy)
    result["server_vs_initial_policy"] = max_difference(served, initial_policy)
    # the first two fixed completions differ only in their image
    result["image_effect"] = {"server": max_difference(served[:1], served[1:2]),
                              "policy": max_difference(policy[:1], policy[1:2])}
    result["steps"] = trainer.state.global_step
    result["generate_calls"] = calls
    result["image_rows"] = image_rows
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


def run_case(name: str, base_url: str, model_dir: str, items: list) -> dict:
    case = CASES[name]
    start = time.perf_counter()
    trainer = case_trainer(case, model_dir, engine=server_settings(base_url))
    generation = trainer.vllm_generation
    client = getattr(generation, "vllm_client", None)  # the main process's
    result = {"case": name, "generation": type(generation).__name__, "world": trainer.accelerator.num_processes,
              "local_rank": trainer.accelerator.local_process_index,
              "has_client": client is not None, "build_seconds": time.perf_counter() - start,
              "deepspeed_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
              if trainer.is_deepspeed_enabled else None,
              "transport": getattr(client, "shared_dir", None) is not None}
    syncs = []
    update = getattr(client, "update_named_params", None)
    if client is not None:
        def counted(*args, **kwargs):
            syncs.append(trainer.state.global_step)
            return update(*args, **kwargs)

        client.update_named_params = counted
    generation.sync_weights()  # the server holds the previous case's policy
    result["untrained"], initial_policy = measure(trainer, client, items)
    calls, greedy = [], []
    record_generate_calls(trainer, calls)
    if case[2].get("greedy"):
        check_greedy_rows(trainer, client, greedy)
    initial = full_parameters(trainer)
    syncs.clear()
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    result["syncs_in_training"] = list(syncs)
    final = full_parameters(trainer)
    result["policy_moved"] = moved(initial, final, policy=True)
    result["critic_moved"] = moved(initial, final, policy=False)
    generation.sync_weights()
    result["trained"], policy = measure(trainer, client, items)
    if client is not None:
        result["server_vs_initial_policy"] = max_difference(server_scores(client, items), initial_policy)
    result["steps"] = trainer.state.global_step
    result["generate_calls"] = calls
    result["greedy"] = greedy
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


def main(out: str, base_url: str, model_dir: str, *names: str) -> None:
    from transformers import AutoTokenizer

    vlm = names[:1] == ("--vlm",)
    names = names[1:] if vlm else names
    unknown = [n for n in names if n not in (VLM_CASES if vlm else CASES)]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: expected some of {list(VLM_CASES if vlm else CASES)}")
    items = None if vlm else text_items(AutoTokenizer.from_pretrained(model_dir))
    run_cases(out, names, lambda name: run_vlm_case(name, base_url, model_dir) if vlm
              else run_case(name, base_url, model_dir, items))


def run_cases(out: str, names, run_one) -> None:
    """Run `run_one(name)` for each case name, writing {name: result} to `out` (a folder ending in "/": its
    rank<RANK>.json) after every case: a crash keeps what ran, and a failing case is reported with its traceback
    while the others still run (several ranks: the test's timeout ends a hang)."""
    rank = int(os.environ.get("RANK", "0"))
    out_path = os.path.join(out, f"rank{rank}.json") if out.endswith("/") else out
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = run_one(name)
        except Exception as e:
            results[name] = {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(f"rank {rank}:", json.dumps({k: v for k, v in results[name].items() if k not in ("logs", "traceback")}),
              flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f)

if __name__ == "__main__":
    main(*sys.argv[1:])
    from trl_ppo_variants.distributed import finish

    finish(0)
