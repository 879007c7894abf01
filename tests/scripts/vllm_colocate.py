"""Trainers of the package under a real vLLM colocate engine on CPU (vLLM's CPU build).

    python tests/scripts/vllm_colocate.py OUT.json {tied,untied} CASE [CASE ...]

Builds the vLLM-capable toy model (head_dim 32; tied or untied LM head) and runs each case (`CASES`) in turn: builds
its trainer with `use_vllm=True, vllm_mode="colocate"`, syncs the policy into the engine and measures the engine
against the policy's forward (max per-token |log-prob difference| of fixed completions), trains 2 steps with generation
by vLLM, syncs once more and measures again, plus the case's own checks (ReMax's greedy rows, the calls of DAPO's
rounds, the KL in the reward, the importance-sampling ratio). Writes one JSON object per case; a case that raises
records its error and the next one runs.

One engine per process: vLLM cannot build a second `LLM` in a process ("Default process group has not been
initialized"), and building one costs ~50 s of the ~55 s a single-trainer run takes on 2 CPU cores. So every case of a
run shares the first engine built (`share_one_engine`: later `LLM(...)` calls with the same arguments return it), and
each trainer's first sync loads its own policy into it, as TRL's first generation does (`_last_loaded_step = -1`).
"""

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trl_ppo_variants.toy import use_offline_env  # noqa: E402

use_offline_env()

import torch  # noqa: E402

#: (prompt, completion) pairs of the toy alphabet, scored by teacher forcing on both sides
FIXED = [("3+4=", "7"), ("1+2=", "3"), ("4+4=", "8, 2+2=4")]
MAX_COMPLETION = 6
#: the colocate engine of every case and of the learning check (one engine per process, shared: `share_one_engine`)
ENGINE = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.05, "vllm_max_model_length": 64}


def varied_reward(completions, **kwargs):
    """Distinct characters of a completion: varies within every group of the untrained model's samples, so every step
    moves the weights (the warm-started model answers the toy task alike in a group: zero advantages)."""
    return [float(len(set(c if isinstance(c, str) else c[-1]["content"]))) for c in completions]


def mixed_reward(prompts, completions, **kwargs):
    """`varied_reward` on prompts whose first digit is even, 0 on the others: the groups of odd prompts have no spread,
    so dynamic sampling, SPEED and GRESO drop them and refill (several rounds a step)."""
    varied = varied_reward(completions)
    return [v if int(p[0]) % 2 == 0 else 0.0 for p, v in zip(prompts, varied)]


#: case -> (algorithm, config settings, options): reward "varied" | "mixed" | "none" (TTRL) | "steps" (process GRPO);
#: lora: the policy is a PEFT LoRA model
CASES = {
    "grpo": ("grpo", {}, {}),
    "grpo_lora": ("grpo", {}, {"lora": True}),
    # RLOO's KL in the reward; with TRL's importance-sampling correction (on by default) the sampling log-probs are
    # TRL's forward (`old_per_token_logps`); without it, vLLM's: both 0 at step 0 with policy == reference
    "rloo": ("rloo", {"beta": 0.05}, {}),
    "rloo_vllm_logps": ("rloo", {"beta": 0.05, "vllm_importance_sampling_correction": False}, {}),
    "rloo_lora": ("rloo", {"beta": 0.05}, {"lora": True}),
    "remax": ("remax", {}, {"greedy": True}),
    "reinforce_pp": ("reinforce_pp", {"baseline": False}, {}),
    "reinforce_pp_baseline": ("reinforce_pp", {"baseline": True}, {}),
    "dapo": ("dapo", {"max_generation_rounds": 4}, {"reward": "mixed", "rounds": "dapo"}),
    "grpo_speed": ("grpo", {"prompt_selection": "speed", "screening_num_generations": 2, "max_generation_rounds": 4},
                   {"reward": "mixed", "rounds": "selection"}),
    "grpo_greso": ("grpo", {"prompt_selection": "greso", "max_generation_rounds": 4},
                   {"reward": "mixed", "rounds": "selection"}),
    "ppo": ("ppo", {}, {}),  # the LoRA critic (PPO's default), on the reference model's weights
    "ppo_full_critic": ("ppo", {"critic_backbone": "full"}, {}),
    "ppo_lora": ("ppo", {}, {"lora": True}),  # the critic: a second adapter on the policy's base model
    # TRL's correction multiplies the per-token policy loss by the ratio (masked to 0 outside [min, max]); the value
    # loss is not corrected: with every ratio (~1) outside [2, 3], the policy must not move and the critic must
    "ppo_is_masked": ("ppo", {"critic_backbone": "full", "vllm_importance_sampling_mode": "token_mask",
                              "vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 3.0},
                      {"policy_frozen": True}),
    "vapo": ("vapo", {"value_pretrain_steps": 1, "length_adaptive_alpha": None}, {}),
    "ttrl": ("ttrl", {"n_votes": 4, "n_train": 2, "label_column": "answer",
                      "answer_extractor": "trl_ppo_variants.toy_demo:first_number"}, {"reward": "none"}),
    "process_grpo": ("process_grpo", {}, {"reward": "steps"}),
}


def share_one_engine():
    """Make TRL's colocate `LLM(...)` build one engine per process and hand it to every later trainer built with the
    same arguments (a different model or engine setting is refused: the case would test another engine; TRL's
    `max_num_seqs`, the batch size, only caps how many requests run at once)."""
    import trl.generation.vllm_generation as module

    build, engines = module.LLM, []

    def shared(**kwargs):
        if not engines:
            engines.append((kwargs, build(**kwargs)))
        first, engine = engines[0]
        if {**kwargs, "max_num_seqs": None} != {**first, "max_num_seqs": None}:  # a scheduling limit only
            raise ValueError(f"share_one_engine: LLM arguments differ from the first engine's: {kwargs} vs {first}")
        return engine

    module.LLM = shared


def policy_logps(model, ids: list[int], start: int) -> torch.Tensor:
    """(len(ids) - start, V) log-probs of the policy's forward at the positions predicting ids[start:]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def fixed_logps(trainer, tokenizer, engine: bool) -> list[torch.Tensor]:
    """Per-token log-probs of each `FIXED` completion: the engine's (vLLM's prompt log-probs) or the policy's forward."""
    from vllm import SamplingParams

    scores = []
    for prompt, completion in FIXED:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = p_ids + c_ids
        if engine:
            out = trainer.vllm_generation.llm.generate([{"prompt_token_ids": ids}],
                                                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            scored = out[0].prompt_logprobs
            scores.append(torch.tensor([scored[len(p_ids) + i][t].logprob for i, t in enumerate(c_ids)]))
        else:
            scores.append(policy_logps(trainer.model, ids, len(p_ids)).gather(-1, torch.tensor(c_ids)[:, None])[:, 0])
    return scores


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max |a - b| over the tokens of every completion."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def record_generate_calls(trainer, calls: list) -> None:
    """Record (global step, rows) of every vLLM generation call of the trainer (one row per completion in colocate
    mode)."""
    generation = trainer.vllm_generation
    generate = generation.generate

    def recorded(prompts, *args, **kwargs):
        calls.append((trainer.state.global_step, len(prompts)))
        return generate(prompts, *args, **kwargs)

    generation.generate = recorded


def check_greedy_rows(trainer, records: list) -> None:
    """Wrap ReMax's vLLM greedy request: its rows must equal a temperature-0 generation of the engine (same weights,
    same moment) and pick, at every position, a token the policy's forward ranks first (up to `gap`, a near-tie)."""
    from vllm import SamplingParams

    greedy = trainer._vllm_greedy

    def checked(greedy_prompts, padded, filler, *rest):  # rest: the rows' image lists (None for text)
        ids = greedy(greedy_prompts, padded, filler, *rest)
        outs = trainer.vllm_generation.llm.generate(
            [{"prompt_token_ids": list(p)} for p in greedy_prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_COMPLETION), use_tqdm=False)
        gap = 0.0
        for p, c in zip(greedy_prompts, ids):
            logps = policy_logps(trainer.model, list(p) + list(c), len(p))
            chosen = logps.gather(-1, torch.tensor(c)[:, None])[:, 0]
            gap = max(gap, (logps.max(-1).values - chosen).max().item())
        records.append({"rows": len(ids), "equal_to_temperature_0": ids == [list(o.outputs[0].token_ids) for o in outs],
                        "argmax_gap": gap})
        return ids

    trainer._vllm_greedy = checked


def moved(initial: dict, final: dict, policy: bool) -> float:
    """Max |change| of the policy's (policy=True) or the critic's parameters between two state dicts."""
    from trl_ppo_variants.critic import is_critic_key

    return max([(final[k].float() - initial[k].float()).abs().max().item()
                for k in final if is_critic_key(k) != policy] or [0.0])


def case_trainer(case: tuple, model_dir: str):
    """The trainer of a `CASES` entry (algorithm, config settings, options) on the toy task: 2 steps at lr 3e-2, 8 rows
    of 4 completions (TTRL: `n_votes`) of at most `MAX_COMPLETION` tokens, generated by the colocate engine."""
    from trl_ppo_variants.cli import load_algorithm
    from trl_ppo_variants.process import outcome_as_one_step
    from trl_ppo_variants.toy import addition_dataset

    algo, settings, options = case
    config_cls, trainer_cls = load_algorithm(algo)
    size = {"per_device_train_batch_size": 8}
    if algo != "ttrl":  # TTRL: n_votes sets num_generations
        size["num_generations"] = 4
    args = config_cls(
        output_dir=tempfile.mkdtemp(prefix="vllm_out_"), max_completion_length=MAX_COMPLETION, max_steps=2,
        learning_rate=3e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no",
        disable_tqdm=True, **ENGINE, **size, **settings)
    reward = options.get("reward", "varied")
    kwargs = {"reward_funcs": {"varied": varied_reward, "mixed": mixed_reward}.get(reward)}
    if reward == "steps":
        kwargs["step_reward_funcs"] = [outcome_as_one_step(varied_reward)]
    if options.get("lora"):
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    return trainer_cls(model_dir, args=args, train_dataset=addition_dataset(64), **kwargs)


def numeric_logs(trainer) -> list[dict]:
    """The numbers of each training step's log."""
    return [{k: v for k, v in h.items() if isinstance(v, (int, float))}
            for h in trainer.state.log_history if "loss" in h]


def run_case(name: str, model_dir: str, tokenizer) -> dict:
    options = CASES[name][2]
    trainer = case_trainer(CASES[name], model_dir)
    trainer.vllm_generation.sync_weights()  # the engine may hold the previous case's policy
    initial_policy = fixed_logps(trainer, tokenizer, engine=False)
    result = {"case": name, "engine": type(trainer.vllm_generation).__name__,
              "untrained": max_difference(fixed_logps(trainer, tokenizer, engine=True), initial_policy)}
    calls, greedy = [], []
    record_generate_calls(trainer, calls)
    if options.get("greedy"):
        check_greedy_rows(trainer, greedy)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    final = trainer.model.state_dict()
    result["policy_moved"] = moved(initial, final, policy=True)
    result["critic_moved"] = moved(initial, final, policy=False)
    trainer.vllm_generation.sync_weights()  # a PEFT policy: TRL merges the adapter for the sync, then unmerges it
    engine = fixed_logps(trainer, tokenizer, engine=True)
    result["trained"] = max_difference(engine, fixed_logps(trainer, tokenizer, engine=False))
    # how far the synced engine is from the policy before training: the sync carried the training's change
    result["engine_vs_initial_policy"] = max_difference(engine, initial_policy)
    result["steps"] = trainer.state.global_step
    result["generate_calls"] = calls
    result["greedy"] = greedy
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


#: the learning check: each trainer on the toy addition task (the warm-started model answers about half right) with
#: `make demo-toy`'s settings (`toy_demo.COMMON` + `toy_demo.ALGO_SETTINGS`), with HF `generate` and then with the
#: engine, from the same checkpoint, for each seed
LEARN_STEPS, LEARN_SEEDS = 30, (0, 1, 2)
LEARN_ALGORITHMS = ("grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo", "ppo", "vapo", "ttrl",
                    "process_grpo")
#: TTRL learns without labels by agreeing with its own majority vote, which on this model is right for only 25-40% of
#: the prompts (its logged `label_accuracy`): it lowers the toy reward (lr 1e-3: -0.13 with HF `generate`), the failure
#: mode the paper names. Its learning is measured on its own objective, the agreement of seeded samples with their
#: majority answer (`toy_demo.sampled_scores`), at lr 1e-3: at the toy demo's 1e-4, 30 steps move little
LEARN_OVERRIDES = {"ttrl": {"learning_rate": float(os.environ.get("TTRL_LR", "1e-3"))}}


def run_learning(model_dir: str, tokenizer, algorithms=LEARN_ALGORITHMS) -> dict:
    """The toy reward (`toy_demo.sampled_reward`: 8 seeded HF samples on each of the 25 prompts) before training and
    after `LEARN_STEPS` steps of each trainer generated by HF `generate` ("hf") or by the colocate engine ("vllm"),
    per seed, and the samples' agreement with their majority answer (`sampled_scores`, TTRL's objective):
    {"algorithms": {algo: {"seeds": {seed: {"before", "hf", "vllm", "before_agreement", "hf_agreement", ...}}}}}."""
    from transformers import AutoModelForCausalLM

    from trl_ppo_variants.toy_demo import COMMON, build_trainer, sampled_scores

    temperature = COMMON["temperature"]
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    before = {}
    for seed in LEARN_SEEDS:
        reward, agreement = sampled_scores(base, tokenizer, temperature, seed)
        before[seed] = {"before": reward, "before_agreement": agreement}
    result = {"case": "learning", "steps": LEARN_STEPS, "algorithms": {}}
    for algo in algorithms:
        seeds = result["algorithms"][algo] = {"seeds": {}}
        for seed in LEARN_SEEDS:
            row = seeds["seeds"][seed] = dict(before[seed])
            for backend in ("hf", "vllm"):
                trainer = build_trainer(algo, model_dir, tempfile.mkdtemp(prefix="vllm_learn_"), LEARN_STEPS, seed,
                                        **LEARN_OVERRIDES.get(algo, {}), **(ENGINE if backend == "vllm" else {}))
                torch.manual_seed(seed)
                start = time.perf_counter()
                trainer.train()
                row[f"{backend}_seconds"] = time.perf_counter() - start
                row[backend], row[f"{backend}_agreement"] = sampled_scores(trainer.model, tokenizer, temperature, seed)
                del trainer
        print(json.dumps({algo: seeds}), flush=True)
    return result


def main(out_path: str, tie: str, *names: str) -> None:
    from transformers import AutoTokenizer

    from trl_ppo_variants.toy import make_toy_checkpoint

    unknown = [n for n in names if n not in CASES and n.split(":")[0] != "learning"]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: expected some of {list(CASES)}, learning[:algo,algo...]")
    share_one_engine()
    # warm-started to about the toy demo model's level (12 supervised steps at this width: greedy accuracy 0.6,
    # sampled reward 0.39 at temperature 0.7): the learning check needs room to learn, the other cases' reward varies
    # within every group anyway
    model_dir = make_toy_checkpoint(tempfile.mkdtemp(prefix="vllm_toy_"), warm_steps=12, hidden_size=128,
                                    tie_word_embeddings=tie == "tied")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            if name.startswith("learning"):  # "learning:grpo,ppo": some trainers only (a quicker look)
                algorithms = name.split(":")[1].split(",") if ":" in name else LEARN_ALGORITHMS
                results[name] = run_learning(model_dir, tokenizer, algorithms)
            else:
                results[name] = run_case(name, model_dir, tokenizer)
        except Exception as e:  # the other cases still run and report
            results[name] = {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(json.dumps({k: v for k, v in results[name].items() if k not in ("logs", "traceback")}), flush=True)
        with open(out_path, "w") as f:  # written after every case: a crash keeps what ran
            json.dump(results, f)


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    main(*sys.argv[1:])
