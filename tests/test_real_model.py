"""Every trainer on a real pretrained model: SmolLM2-135M-Instruct (a 30-layer Llama with a real chat template and
EOS conventions), built offline by `trl_ppo_variants.smollm2` and shared by the session (fixture `smollm2_dir`).

What the toy cannot show: conversational prompts rendered by a real chat template, completions that end with EOS
next to completions cut at `max_completion_length` in one batch (with the pad token equal to EOS), masks on those,
a reward function that returns None for some rows, a critic built from a 135M backbone, LoRA on real projections, an
export that loads back and generates, and a seeded learning signal on held-out questions.

Each trainer test runs 2 steps of 8 completions (2 prompts x 4) of at most 12 tokens, sampled at temperature 1.0. The
two prompts of every step are the same pair (the data set has 2 rows, one step is one epoch): a word problem (the
model explains before it answers: cut at 12 tokens, measured 16 of 16 samples) and a yes/no question (a short reply
ending with EOS, measured 9 of 16 samples; unscorable by `math_accuracy`, which returns None for it: no `answer`).
A second reward, the negative length, varies with where EOS falls, so the trainers have an update to make.
"""

import math

import pytest
import torch
from conftest import worker_cores

from trl_ppo_variants.algorithms import REGISTRY
from trl_ppo_variants.cli import load_algorithm
from trl_ppo_variants.rewards import math_accuracy

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _all_cores():
    """These tests run one process on a 135M model: its matmuls use every core this test worker has (the suite's
    default of one thread suits the tiny model and the multi-process tests), and the suite's default comes back
    afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(worker_cores(), 8))
    yield
    torch.set_num_threads(before)

MAX_LEN = 12
PROBLEM = [{"role": "system", "content": "Reply with only the number."},
           {"role": "user", "content": "Anna has 7 pens and gets 5 more. How many pens does Anna have now?"}]
YES_NO = [{"role": "user", "content": "Is 7 larger than 3? Answer yes or no."}]
ALGOS = list(REGISTRY)  # every command: the baseline and each algorithm (a new one needs its SETTINGS below)
# half of the trainers mask truncated completions out of the loss, half do not (both paths on every family)
MASK_TRUNCATED = {"grpo": True, "rloo": False, "remax": True, "reinforce_pp": True, "reinforce_pp_baseline": False,
                  "dapo": True, "ppo": False, "vapo": True, "ttrl": False, "process_grpo": True}
#: what each algorithm needs on top of the shared settings (its KL terms on, to exercise the reference model)
SETTINGS = {
    "grpo": {"beta": 0.04},
    "rloo": {"beta": 0.05},
    "remax": {},
    "reinforce_pp": {"kl_in_reward_coef": 0.01},
    "reinforce_pp_baseline": {"baseline": True, "beta": 1e-3},
    "dapo": {"max_generation_rounds": 2},
    # the full critic, whose fresh copy of the real backbone _check_fresh_critic checks (PPO's default is the LoRA
    # critic since issue 28)
    "ppo": {"kl_in_reward_coef": 0.05, "critic_backbone": "full"},
    "vapo": {"value_pretrain_steps": 1},
    "ttrl": {"n_votes": 4, "n_train": 2},
    "process_grpo": {"step_separator": " "},  # a word is a step: 12 tokens hold several
}


def negative_length(completion_ids, **kwargs):
    return [-len(ids) / MAX_LEN for ids in completion_ids]


def digit_steps(completions, **kwargs):
    """Process GRPO's step reward: 1 for a step (a word) holding a digit."""
    from trl_ppo_variants.process import split_steps
    from trl_ppo_variants.rewards import completion_text

    return [[float(any(ch.isdigit() for ch in step)) for step in split_steps(completion_text(c), " ")]
            for c in completions]


def _dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": PROBLEM, "answer": "12"}, {"prompt": YES_NO, "answer": None}])


def _classes(algo):
    if algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    return load_algorithm(algo)


def _trainer(algo, model_dir, tmp_path, mask_truncated, peft_config=None, **overrides):
    config_cls, trainer_cls = _classes(algo)
    settings = dict(output_dir=str(tmp_path / algo), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=MAX_LEN, max_steps=2, learning_rate=1e-5, temperature=1.0, logging_steps=1,
                    report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True,
                    mask_truncated_completions=mask_truncated, beta=0.0)
    settings.update(SETTINGS[algo])
    settings.update(overrides)
    if "n_votes" in settings:
        settings.pop("num_generations")
    args = config_cls(**settings)
    rewards = [negative_length] if algo == "ttrl" else [math_accuracy, negative_length]
    extra = {"step_reward_funcs": [digit_steps]} if algo == "process_grpo" else {}
    return trainer_cls(model=model_dir, reward_funcs=rewards, args=args, train_dataset=_dataset(),
                       peft_config=peft_config, **extra)


def _spy_on_loss_inputs(trainer):
    """Record the prompt, completion and mask tensors of every batch the loss sees."""
    seen = []
    original = trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        seen.append({k: inputs[k].detach().clone() for k in ("prompt_ids", "completion_ids", "completion_mask")})
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    return seen


def _watched(model):
    """Copies of a few weights spread over the network (the policy's own, not LoRA's or the critic's)."""
    named = dict(model.named_parameters())
    keys = [k for k in named if k.endswith(("layers.0.self_attn.q_proj.weight", "layers.29.mlp.down_proj.weight",
                                            "layers.0.self_attn.q_proj.base_layer.weight",
                                            "layers.29.mlp.down_proj.base_layer.weight"))
            and ".critic." not in k and not k.startswith("critic.")]
    assert len(keys) == 2, keys
    return {k: named[k].detach().clone() for k in keys}


def _check_logs(trainer, algo):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2, trainer.state.log_history
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if isinstance(value, float):
                assert math.isfinite(value), (algo, key, value)
    assert any(entry["grad_norm"] > 0 for entry in logs), (algo, logs)
    for entry in logs:
        assert entry["completions/clipped_ratio"] > 0, (algo, entry)  # the word problem is cut
    return logs


def _check_batches(seen, tokenizer, mask_truncated, algo):
    """Every batch the loss saw: the chat template rendered the prompts, masks end at EOS, and truncated
    completions are masked out exactly when asked."""
    eos = tokenizer.eos_token_id
    assert seen, algo
    truncated_rows = eos_rows = 0
    for batch in seen:
        prompt = tokenizer.decode(batch["prompt_ids"][0])
        assert prompt.rstrip(tokenizer.pad_token).endswith("<|im_start|>assistant\n"), prompt
        assert "<|im_start|>user\n" in prompt
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        for row_ids, row_mask in zip(ids, mask):
            hits = (row_ids == eos).nonzero()  # pad == EOS here: the first one is the model's
            if len(hits):
                eos_rows += 1
                end = int(hits[0]) + 1  # the EOS token itself is trained on, nothing after it
                assert row_mask[:end].tolist() == [1] * end and row_mask[end:].sum() == 0, (algo, row_ids, row_mask)
            else:  # cut at max_completion_length (columns no mask uses may have been trimmed from the batch)
                truncated_rows += 1
                assert row_mask.sum() == (0 if mask_truncated else MAX_LEN), (algo, mask_truncated, row_mask)
    assert truncated_rows > 0 and eos_rows > 0, (algo, truncated_rows, eos_rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ALGOS)
def test_trainer_two_steps_on_the_real_model(smollm2_dir, tmp_path, algo):
    from transformers import AutoTokenizer

    mask_truncated = MASK_TRUNCATED[algo]
    trainer = _trainer(algo, smollm2_dir, tmp_path, mask_truncated)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    seen = _spy_on_loss_inputs(trainer)
    before = _watched(trainer.model)
    if algo in ("ppo", "vapo"):
        _check_fresh_critic(trainer, tokenizer)
    trainer.train()
    assert trainer.state.global_step == 2
    logs = _check_logs(trainer, algo)
    _check_batches(seen, tokenizer, mask_truncated, algo)
    after = _watched(trainer.model)
    assert all(not torch.equal(before[k], after[k]) for k in before), algo
    if algo in ("ppo", "vapo"):
        for entry in logs:
            assert "value/loss" in entry and "value/explained_variance" in entry


def _check_fresh_critic(trainer, tokenizer):
    """The critic of PPO/VAPO is a second copy of the real backbone with a scalar head, before any step."""
    from trl_ppo_variants.critic import critic_values, policy_module

    critic, policy = trainer.critic, policy_module(trainer.model)
    critic_backbone = dict(getattr(critic, critic.base_model_prefix).named_parameters())
    policy_backbone = dict(getattr(policy, policy.base_model_prefix).named_parameters())
    assert critic_backbone.keys() == policy_backbone.keys() and len(critic_backbone) == 30 * 9 + 2
    for name, p in policy_backbone.items():
        assert torch.equal(critic_backbone[name], p), name
        assert critic_backbone[name].data_ptr() != p.data_ptr(), name  # a copy, not shared storage
    head = [p for n, p in critic.named_parameters() if not n.startswith(critic.base_model_prefix + ".")]
    assert [tuple(p.shape) for p in head if p.dim() == 2] == [(1, 576)]
    text = tokenizer.apply_chat_template(PROBLEM, tokenize=False, add_generation_prompt=True) + "12"
    enc = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        values = critic_values(critic, enc["input_ids"], enc["attention_mask"], enc["input_ids"].shape[1] - 1)
    assert values.shape == (1, enc["input_ids"].shape[1] - 1) and torch.isfinite(values).all()
    # the new head starts near V = 0 on every state: transformers' N(0, 0.02) head gave values of std 0.73 here (the
    # hidden states' norm is ~47), GAE advantages made of that noise and an explained variance of -3 to -20
    assert values.std() < 0.2 and values.abs().max() < 0.5, (values.std(), values.abs().max())


# ------------------------------------------------------------------------------------------------ ReMax
@pytest.mark.timeout(600)
def test_remax_greedy_rows_are_greedy_under_the_chat_template(smollm2_dir, tmp_path):
    """ReMax's baseline rows, appended to the sampling `generate` call of left-padded chat prompts of different
    lengths, are each prompt's own `generate(do_sample=False)` (alone, unpadded), and `remax/greedy_reward` is their
    reward: what the real model's ReMax run logged (greedy right 3 times in 4 while samples rarely were) is the
    model, not the plumbing."""
    from transformers import AutoTokenizer

    from trl_ppo_variants.smollm2 import word_problem_dataset, word_problem_reward

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config_cls, trainer_cls = load_algorithm("remax")
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=2,
                      max_completion_length=MAX_LEN, temperature=1.0, report_to=[], use_cpu=True, bf16=False, seed=0,
                      save_strategy="no", disable_tqdm=True)
    data = word_problem_dataset(4, seed=3, split="test")
    trainer = trainer_cls(model=smollm2_dir, reward_funcs=word_problem_reward, args=args, train_dataset=data)
    seen = {}
    score = trainer._score_greedy

    def spy(greedy, *rest):
        seen["greedy"] = [list(ids) for ids in greedy["completion_ids"]]
        return score(greedy, *rest)

    trainer._score_greedy = spy
    trainer.model.train()
    inputs = [dict(data[i]) for i in range(4) for _ in range(2)]
    torch.manual_seed(0)
    trainer._generate_and_score_completions(inputs)
    texts = [tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True) for row in data]
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 1  # the batch was padded
    expected, completions = [], []
    for text in texts:
        enc = tokenizer([text], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = trainer.model.generate(**enc, do_sample=False, max_new_tokens=MAX_LEN)
        ids = out[0, enc["input_ids"].shape[1]:].tolist()
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        expected.append(ids)
        completions.append([{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}])
    assert seen["greedy"] == expected
    greedy_reward = sum(word_problem_reward(completions, data["answer"])) / 4
    assert trainer._metrics["train"]["remax/greedy_reward"][-1] == pytest.approx(greedy_reward)


# ------------------------------------------------------------------------------------------------ LoRA
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["rloo", "ppo"])
def test_lora_on_the_real_model(smollm2_dir, tmp_path, algo):
    """LoRA on the real attention projections: only the adapter moves; PPO's critic (never a LoRA target) trains in
    full; the saved adapter loads back onto the base model."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(algo, smollm2_dir, tmp_path, mask_truncated=False, peft_config=lora, learning_rate=1e-4)
    named = dict(trainer.model.named_parameters())
    lora_b = [k for k in named if "lora_B" in k and ".critic." not in k]
    assert len(lora_b) == 2 * 30
    policy_trainable = {k for k, p in named.items() if p.requires_grad and ".critic." not in k}
    assert policy_trainable and all("lora_" in k for k in policy_trainable)
    before = _watched(trainer.model)
    adapters = {k: named[k].detach().clone() for k in lora_b[:4]}
    critic_before = None
    if algo == "ppo":
        critic_before = {n: p.detach().clone() for n, p in trainer.critic.named_parameters()}
        assert all(p.requires_grad for p in trainer.critic.parameters())
        assert not any("lora_" in n for n in critic_before)
    trainer.train()
    _check_logs(trainer, algo)
    after = _watched(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base weights are frozen
    named = dict(trainer.model.named_parameters())
    assert all(not torch.equal(adapters[k], named[k]) for k in adapters)
    if critic_before is not None:
        moved = [n for n, p in trainer.critic.named_parameters() if not torch.equal(critic_before[n], p)]
        assert len(moved) > len(critic_before) // 2  # the whole critic trains, not an adapter on it
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    loaded = dict(PeftModel.from_pretrained(base, str(out)).named_parameters())
    assert all(torch.equal(loaded[k], named[k].detach()) for k in adapters)


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.timeout(600)
def test_saved_model_loads_back_and_generates(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = _trainer("ppo", smollm2_dir, tmp_path, mask_truncated=True, max_steps=1)
    trainer.train()
    out = tmp_path / "export"
    trainer.save_model(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    trained = {k: v for k, v in trainer.model.state_dict().items() if not k.startswith("critic.")}
    loaded = model.state_dict()
    assert set(loaded) <= set(trained) and not any("critic" in k for k in loaded)
    assert all(torch.equal(loaded[k], trained[k]) for k in loaded)
    assert (out / "value_model" / "config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.padding_side == "left" and tokenizer.pad_token == tokenizer.eos_token
    text = tokenizer.apply_chat_template(PROBLEM, tokenize=False, add_generation_prompt=True)
    enc = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    out_ids = model.generate(**enc, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(out_ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in completion), completion


# ------------------------------------------------------------------------------------------------ learning
#: held-out accuracy of RLOO after 6 steps (before: 0.078 = 5 of 64), measured with the training seeds 0-4 on 2 CPU
#: cores (the word problems of `trl_ppo_variants.smollm2`, the settings of the test below): SEED_RESULTS
LEARN_SEED = 0
SEED_RESULTS = {0: 0.406, 1: 0.453, 2: 0.297, 3: 0.266, 4: 0.188}
#: below the smallest measured gain (0.11, seed 4): every measured seed passes, the one tested (gain 0.33) by far
MARGIN = 0.08


@pytest.mark.timeout(900)
def test_rloo_raises_heldout_accuracy_on_word_problems(smollm2_dir, tmp_path):
    """6 RLOO steps (16 completions a step, lr 2e-5, temperature 0.7, no KL) raise the held-out accuracy on word
    problems the model never trained on, measured outside the trainer at the training temperature."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ppo_variants.smollm2 import heldout_accuracy, word_problem_dataset, word_problem_reward

    config_cls, trainer_cls = load_algorithm("rloo")
    steps = 6
    args = config_cls(output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=16, num_generations=4,
                      max_completion_length=24, learning_rate=2e-5, lr_scheduler_type="constant", temperature=0.7,
                      beta=0.0, max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                      seed=LEARN_SEED, save_strategy="no", disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    heldout = word_problem_dataset(32, seed=0, split="test")

    def accuracy(m):
        return heldout_accuracy(m, tokenizer, heldout["prompt"], heldout["answer"], samples=2, temperature=0.7,
                                max_new_tokens=24, seed=1)

    before = accuracy(model)
    trainer = trainer_cls(model=model, reward_funcs=word_problem_reward, args=args, processing_class=tokenizer,
                          train_dataset=word_problem_dataset(steps * 16 * 2, seed=LEARN_SEED))
    trainer.train()
    after = accuracy(trainer.model)
    assert before < 0.15, before
    assert after >= before + MARGIN, (before, after)
