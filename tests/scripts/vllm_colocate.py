"""Trainers of the package under a real vLLM colocate engine on CPU (vLLM's CPU build).

    python tests/scripts/vllm_colocate.py OUT.json MODEL[:eager] CASE [CASE ...]

MODEL (`MODELS`): `tied` / `untied`, the vLLM-capable toy model (head_dim 32; tied or untied LM head, `CASES`, and
the learning check, `learning[:algo,...]`, `learning_hf[:algo,...]` with HF `generate` too);
`gpt2`, a tiny GPT-2 whose LM head is tied to `transformer.wte` (`CASES`); `vlm`, the tiny Idefics3 of `toy_vlm`
(`VLM_CASES`: every trainer on prompts with and without images). Each case in turn: builds its trainer with
`use_vllm=True, vllm_mode="colocate"`, syncs the policy into the engine and measures the engine against the policy's
forward (max per-token |log-prob difference| of fixed completions; the VLM's with and without images), trains with
generation by vLLM, syncs once more and measures again, plus the case's own checks (ReMax's greedy rows, the calls of
DAPO's rounds, the KL in the reward, the importance-sampling ratio, the rows with images of each call). Writes one
JSON object per case; a case that raises records its error and the next one runs.

One engine per process: vLLM cannot build a second `LLM` in a process ("Default process group has not been
initialized"). So every case of a run shares the first engine built (`share_one_engine`: later `LLM(...)` calls with
the same arguments return it), and each trainer's first sync loads its own policy into it, as TRL's first generation
does (`_last_loaded_step = -1`). The `tied` run's engine is the one users get (torch.compile'd: ~50-100 s to build on
2 cores); the others (`MODEL:eager`, and every model but `tied`) are eager (`enforce_eager`, built in ~2 s and faster
on these tiny models), since what they check (an untied head, a head tied elsewhere, images, learning) is the same in
both and the compiled engine's sync is the `tied` run's.
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


def share_one_engine(**engine_args):
    """Make TRL's colocate `LLM(...)` build one engine per process and hand it to every later trainer built with the
    same arguments (a different model or engine setting is refused: the case would test another engine; TRL's
    `max_num_seqs`, the batch size, only caps how many requests run at once). `engine_args` are added to TRL's
    (`enforce_eager=True`: no torch.compile)."""
    import trl.generation.vllm_generation as module

    build, engines = module.LLM, []

    def shared(**kwargs):
        if not engines:
            engines.append((kwargs, build(**kwargs, **engine_args)))
        first, engine = engines[0]
        if {**kwargs, "max_num_seqs": None} != {**first, "max_num_seqs": None}:  # a scheduling limit only
            raise ValueError(f"share_one_engine: LLM arguments differ from the first engine's: {kwargs} vs {first}")
        return engine

    module.LLM = shared


def policy_logps(model, ids: list[int], start: int, image_kwargs: dict | None = None) -> torch.Tensor:
    """(len(ids) - start, V) log-probs of the policy's forward at the positions predicting ids[start:] (a VLM's image
    inputs for the prompt's images: `image_kwargs`)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), **(image_kwargs or {})).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, -1)


def image_inputs(processor, images: list | None) -> dict:
    """The forward's image inputs of one prompt's image list (none for None or a text-only processor)."""
    if not images:
        return {}
    return dict(processor.image_processor(images=[images], return_tensors="pt"))


def engine_prompt(ids: list[int], images: list | None) -> dict:
    """A vLLM prompt of token ids, with its images (TRL's layout: one image, or a list of several)."""
    prompt = {"prompt_token_ids": list(ids)}
    if images:
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else list(images)}
    return prompt


def text_items(tokenizer) -> list[tuple]:
    """(prompt ids, the engine's prompt ids, completion ids, images) of each `FIXED` pair."""
    items = []
    for prompt, completion in FIXED:
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        items.append((p_ids, p_ids, tokenizer(completion, add_special_tokens=False)["input_ids"], None))
    return items


#: the VLM's fixed completions: (image of `vlm_images()` or None, prompt, completion); the first two differ only in
#: their image, so the engine's log-probs of the one completion differ between them if the images reach it
FIXED_VLM = [(0, "What colour is the image?", "red"), (1, "What colour is the image?", "red"),
             (None, "Name a colour.", "blue")]


def vlm_images() -> list:
    from trl_ppo_variants.toy_vlm import color_images

    return color_images(2, seed=0)[0]  # two images of different colours


def vlm_items(processor) -> list[tuple]:
    """(prompt ids as TRL tokenizes them, image tokens expanded; the engine's: the same text tokenized alone, one
    `<image>` an image, which vLLM expands; completion ids; images) of each `FIXED_VLM` entry."""
    pictures, items = vlm_images(), []
    for image, question, completion in FIXED_VLM:
        images = None if image is None else [pictures[image]]
        content = [{"type": "image"}] * bool(images) + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        expanded = processor(text=[text], images=None if images is None else [images])["input_ids"][0]
        unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        completion_ids = processor.tokenizer(completion, add_special_tokens=False)["input_ids"]
        items.append((list(expanded), unexpanded, completion_ids, images))
    return items


def fixed_logps(trainer, items: list[tuple], engine: bool) -> list[torch.Tensor]:
    """Per-token log-probs of each fixed (prompt ids, engine's prompt ids, completion ids, images): the engine's
    (vLLM's prompt log-probs) or the policy's forward. The engine must have expanded its prompt into the policy's."""
    from vllm import SamplingParams

    scores = []
    for p_ids, engine_ids, c_ids, images in items:
        ids = list(p_ids) + list(c_ids)
        if engine:
            out = trainer.vllm_generation.llm.generate([engine_prompt(list(engine_ids) + list(c_ids), images)],
                                                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            if list(out[0].prompt_token_ids) != ids:
                raise AssertionError(f"the engine's prompt {list(out[0].prompt_token_ids)} is not the policy's {ids}")
            scored = out[0].prompt_logprobs
            scores.append(torch.tensor([scored[len(p_ids) + i][t].logprob for i, t in enumerate(c_ids)]))
        else:
            logps = policy_logps(trainer.model, ids, len(p_ids), image_inputs(trainer.processing_class, images))
            scores.append(logps.gather(-1, torch.tensor(c_ids)[:, None])[:, 0])
    return scores


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max |a - b| over the tokens of every completion."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def record_generate_calls(trainer, calls: list, image_rows: list | None = None, prompts_off: list | None = None):
    """Record (global step, rows) of every vLLM generation call of the trainer (one row per completion in colocate
    mode); into `image_rows` the (rows with images, rows without) of each call; into `prompts_off` the rows whose
    prompt, as the engine expanded it, is not the prompt the trainer trains on (a row with images: one of the
    processor-expanded prompts of the trainer's batch). Returns the function that stops the recording."""
    generation = trainer.vllm_generation
    generate = generation.generate

    def recorded(prompts, *args, **kwargs):
        calls.append((trainer.state.global_step, len(prompts)))
        out = generate(prompts, *args, **kwargs)
        if image_rows is not None:
            images = kwargs.get("images", args[0] if args else None) or [None] * len(prompts)
            with_images = sum(bool(row) for row in images)
            image_rows.append((with_images, len(prompts) - with_images))
            trained = getattr(trainer, "_unexpanded_prompts", {})  # the batch's expanded prompts with images
            prompts_off.extend(list(engine) for sent, engine, row in zip(prompts, out[0], images)
                               if (tuple(engine) not in trained if row else list(engine) != list(sent)))
        return out

    generation.generate = recorded
    return lambda: setattr(generation, "generate", generate)


def check_greedy_rows(trainer, records: list) -> None:
    """Wrap ReMax's vLLM greedy request: its rows must equal a temperature-0 generation of the engine (same weights,
    same moment, each row with its prompt's images) and pick, at every position, a token the policy's forward with
    those images ranks first (up to `gap`, a near-tie)."""
    from vllm import SamplingParams

    greedy = trainer._vllm_greedy

    def checked(greedy_prompts, padded, filler, images=None):  # images: the padded rows' image lists (or None)
        ids = greedy(greedy_prompts, padded, filler, images)
        images = list(images or [None] * len(greedy_prompts))[: len(greedy_prompts)]
        outs = trainer.vllm_generation.llm.generate(
            [engine_prompt(p, row) for p, row in zip(trainer.engine_prompt_ids(greedy_prompts), images)],
            SamplingParams(temperature=0.0, max_tokens=MAX_COMPLETION), use_tqdm=False)
        gap = 0.0
        for p, c, row in zip(greedy_prompts, ids, images):
            logps = policy_logps(trainer.model, list(p) + list(c), len(p), image_inputs(trainer.processing_class, row))
            chosen = logps.gather(-1, torch.tensor(c)[:, None])[:, 0]
            gap = max(gap, (logps.max(-1).values - chosen).max().item())
        records.append({"rows": len(ids), "equal_to_temperature_0": ids == [list(o.outputs[0].token_ids) for o in outs],
                        "argmax_gap": gap, "rows_with_images": sum(bool(row) for row in images)})
        return ids

    trainer._vllm_greedy = checked


def moved(initial: dict, final: dict, policy: bool) -> float:
    """Max |change| of the policy's (policy=True) or the critic's parameters between two state dicts."""
    from trl_ppo_variants.critic import is_critic_key

    return max([(final[k].float() - initial[k].float()).abs().max().item()
                for k in final if is_critic_key(k) != policy] or [0.0])


def first_character(completion) -> str | None:
    """TTRL's answer on the tiny VLM: the completion's first non-space character (its votes then differ in a group)."""
    from trl_ppo_variants.rewards import completion_text

    text = completion_text(completion).strip()
    return text[0] if text else None


#: the `vlm` run: every trainer, 2 steps on `mixed_vlm_dataset` (every batch holds a prompt with an image and one
#: without), the KL in the reward (RLOO, REINFORCE++), ReMax's greedy rows, the critics of PPO and VAPO
VLM_CASES = {
    "grpo": ("grpo", {}, {"probe_image_token": True}),
    "rloo": ("rloo", {"beta": 0.05}, {}),
    "remax": ("remax", {}, {"greedy": True}),
    "reinforce_pp": ("reinforce_pp", {"baseline": False}, {}),
    "reinforce_pp_baseline": ("reinforce_pp", {"baseline": True}, {}),
    "dapo": ("dapo", {}, {}),
    "ppo": ("ppo", {}, {}),
    "vapo": ("vapo", {"value_pretrain_steps": 1, "length_adaptive_alpha": None}, {}),
    "ttrl": ("ttrl", {"n_votes": 4, "n_train": 2, "label_column": "answer", "answer_extractor": first_character},
             {"reward": "none"}),
    "process_grpo": ("process_grpo", {}, {"reward": "steps"}),
}


def mixed_vlm_dataset():
    """Two prompts, the first with an image and the second without (TRL puts the image part in a string prompt; a
    prompt without one stays text): each batch of 2 prompts mixes them."""
    from datasets import Dataset

    image = vlm_images()[0]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "What colour is the image?"}],
                                         [{"role": "user", "content": "Name a colour."}]],
                              "image": [image, None], "answer": ["red", "blue"]})


#: completions the image-token probe samples (`sampled_image_tokens`): 3072 tokens, ~12 of them `<image>` if the tiny
#: VLM could sample it (~1/262 a token)
PROBE_ROWS = 512


def sampled_image_tokens(trainer) -> int:
    """How many image placeholder tokens `PROBE_ROWS` completions of the image prompt hold, sampled through TRL's
    generation call with the trainer's sampling settings."""
    _, engine_ids, _, images = vlm_items(trainer.processing_class)[0]
    _, completions, _, _ = trainer.vllm_generation.generate(prompts=[engine_ids] * PROBE_ROWS,
                                                            images=[images] * PROBE_ROWS, num_generations=1)
    token = trainer.model.config.image_token_id
    return sum(list(ids).count(token) for ids in completions)


def case_trainer(case: tuple, model_dir: str, vlm: bool = False, engine: dict | None = None):
    """The trainer of a `CASES` / `VLM_CASES` entry (algorithm, config settings, options) on the toy task (`vlm`:
    `mixed_vlm_dataset`): 2 steps at lr 3e-2, 8 rows of 4 completions (TTRL: `n_votes`) of at most `MAX_COMPLETION`
    tokens, generated by the colocate engine (or by the vLLM settings `engine`: a server's)."""
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
        disable_tqdm=True, **(ENGINE if engine is None else engine), **size, **settings)
    reward = options.get("reward", "varied")
    kwargs = {"reward_funcs": {"varied": varied_reward, "mixed": mixed_reward}.get(reward)}
    if reward == "steps":
        kwargs["step_reward_funcs"] = [outcome_as_one_step(varied_reward)]
    if options.get("lora"):
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    dataset = mixed_vlm_dataset() if vlm else addition_dataset(64)
    return trainer_cls(model_dir, args=args, train_dataset=dataset, **kwargs)


def numeric_logs(trainer) -> list[dict]:
    """The numbers of each training step's log."""
    return [{k: v for k, v in h.items() if isinstance(v, (int, float))}
            for h in trainer.state.log_history if "loss" in h]


def run_case(name: str, model_dir: str, vlm: bool = False) -> dict:
    from trl_ppo_variants import vllm_cpu

    case = (VLM_CASES if vlm else CASES)[name]
    trainer = case_trainer(case, model_dir, vlm)
    items = vlm_items(trainer.processing_class) if vlm else text_items(trainer.processing_class)
    trainer.vllm_generation.sync_weights()  # the engine may hold the previous case's policy
    initial_policy = fixed_logps(trainer, items, engine=False)
    result = {"case": name, "engine": type(trainer.vllm_generation).__name__,
              "untrained": max_difference(fixed_logps(trainer, items, engine=True), initial_policy)}
    calls, greedy, image_rows, prompts_off = [], [], [], []
    stop_recording = record_generate_calls(trainer, calls, image_rows, prompts_off)
    if case[2].get("greedy"):
        check_greedy_rows(trainer, greedy)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    start = time.perf_counter()
    trainer.train()
    result["train_seconds"] = time.perf_counter() - start
    stop_recording()
    final = trainer.model.state_dict()
    result["policy_moved"] = moved(initial, final, policy=True)
    result["critic_moved"] = moved(initial, final, policy=False)
    trainer.vllm_generation.sync_weights()  # a PEFT policy: TRL merges the adapter for the sync, then unmerges it
    engine = fixed_logps(trainer, items, engine=True)
    policy = fixed_logps(trainer, items, engine=False)
    result["trained"] = max_difference(engine, policy)
    # how far the synced engine is from the policy before training: the sync carried the training's change
    result["engine_vs_initial_policy"] = max_difference(engine, initial_policy)
    # the heads the sync packs again (`repack_tied_heads`, idempotent): tied wherever the embedding lives
    result["tied_heads"] = vllm_cpu.repack_tied_heads(vllm_cpu.engine_model(trainer.vllm_generation.llm))
    if case[2].get("probe_image_token"):
        result["sampled_image_tokens"] = sampled_image_tokens(trainer)
    if vlm:  # the first two fixed completions differ only in their image
        result["image_effect"] = {"engine": max_difference(engine[:1], engine[1:2]),
                                  "policy": max_difference(policy[:1], policy[1:2])}
    result["steps"] = trainer.state.global_step
    result["generate_calls"] = calls
    result["image_rows"] = image_rows
    result["engine_prompts_off"] = prompts_off
    result["greedy"] = greedy
    result["logs"] = numeric_logs(trainer)
    del trainer
    return result


#: the learning check: each trainer on the toy addition task (the warm-started model answers about half right) with
#: `make demo-toy`'s settings (`toy_demo.COMMON` + `toy_demo.ALGO_SETTINGS`), with the engine (and with HF `generate`,
#: the reference, for `learning_hf`), from the same checkpoint, for each seed
LEARN_STEPS, LEARN_SEEDS = 30, (0, 1, 2)
#: every trainer but process GRPO: on this toy task its reward is one step long, where its advantage is GRPO's by
#: construction (`process.outcome_as_one_step`): its runs were GRPO's, seed for seed (its 2-step case stays)
LEARN_ALGORITHMS = ("grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "dapo", "ppo", "vapo", "ttrl")
#: TTRL learns without labels by agreeing with its own majority vote, which on this model is right for only 25-40% of
#: the prompts (its logged `label_accuracy`): it lowers the toy reward (lr 1e-3: -0.13 with HF `generate`), the failure
#: mode the paper names. Its learning is measured on its own objective, the agreement of seeded samples with their
#: majority answer (`toy_demo.sampled_scores`), at lr 1e-3: at the toy demo's 1e-4, 30 steps move little
LEARN_OVERRIDES = {"ttrl": {"learning_rate": float(os.environ.get("TTRL_LR", "1e-3"))}}


def run_learning(model_dir: str, tokenizer, algorithms=LEARN_ALGORITHMS, backends=("vllm",)) -> dict:
    """The toy reward (`toy_demo.sampled_reward`: 8 seeded HF samples on each of the 25 prompts) before training and
    after `LEARN_STEPS` steps of each trainer generated by the colocate engine ("vllm") or by HF `generate` ("hf", with
    `learning_hf`: the reference the test's `LEARNED` table holds), per seed, and the samples' agreement with their
    majority answer (`sampled_scores`, TTRL's objective):
    {"algorithms": {algo: {"seeds": {seed: {"before", "vllm", "before_agreement", "vllm_agreement", ...}}}}}."""
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
            for backend in backends:
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


def build_model(model: str) -> str:
    """The checkpoint of a `MODELS` entry, in a new temporary directory."""
    from trl_ppo_variants.toy import make_tied_gpt2_checkpoint, make_toy_checkpoint
    from trl_ppo_variants.toy_vlm import VLLM_FAMILY, make_tiny_vlm

    root = tempfile.mkdtemp(prefix=f"vllm_{model}_")
    if model == "vlm":
        return make_tiny_vlm(root, VLLM_FAMILY)  # its LM head tied to `model.text_model.embed_tokens`
    if model == "gpt2":
        return make_tied_gpt2_checkpoint(root)
    # warm-started to about the toy demo model's level (12 supervised steps at this width: greedy accuracy 0.6,
    # sampled reward 0.39 at temperature 0.7): the learning check needs room to learn, the other cases' reward varies
    # within every group anyway
    return make_toy_checkpoint(root, warm_steps=12, hidden_size=128, tie_word_embeddings=model == "tied")


#: model -> its cases; the `tied` run's engine is compiled as users get it, the others' eager (module docstring)
MODELS = {"tied": CASES, "untied": CASES, "gpt2": CASES, "vlm": VLM_CASES}


def main(out_path: str, model: str, *names: str) -> None:
    from transformers import AutoTokenizer

    eager = model.endswith(":eager")  # a `tied` run's engine eager too (the learning check's)
    model = model.removesuffix(":eager")
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}: expected one of {list(MODELS)}")
    unknown = [n for n in names if n not in MODELS[model]
               and (model == "vlm" or n.split(":")[0] not in ("learning", "learning_hf"))]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown} for {model}: expected some of {list(MODELS[model])}"
                         + ("" if model == "vlm" else ", learning[_hf][:algo,algo...]"))
    share_one_engine(**({} if model == "tied" and not eager else {"enforce_eager": True}))
    model_dir = build_model(model)
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            if name.startswith("learning"):  # "learning:grpo,ppo": some trainers only; learning_hf: HF too
                algorithms = name.split(":")[1].split(",") if ":" in name else LEARN_ALGORITHMS
                backends = ("hf", "vllm") if name.startswith("learning_hf") else ("vllm",)
                results[name] = run_learning(model_dir, AutoTokenizer.from_pretrained(model_dir), algorithms, backends)
            else:
                results[name] = run_case(name, model_dir, vlm=model == "vlm")
        except Exception as e:  # the other cases still run and report
            results[name] = {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        print(json.dumps({k: v for k, v in results[name].items() if k not in ("logs", "traceback")}), flush=True)
        with open(out_path, "w") as f:  # written after every case: a crash keeps what ran
            json.dump(results, f)


if __name__ == "__main__":  # vLLM starts worker processes: the engine must not be built at import
    main(*sys.argv[1:])
