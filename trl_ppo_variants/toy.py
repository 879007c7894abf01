"""Offline tiny model, tokenizer and toy task, shared by the tests, the demo and the benchmarks.

Nothing here touches the network: the tokenizer is trained with `tokenizers` on a generated corpus, the model is a
randomly initialised Qwen3 of hidden size 64 with 2 layers. The toy task is single-digit addition ("3+4=" -> "7"):
verifiable, small enough that a warm-started tiny model is right on roughly half of the prompts, so every algorithm
has reward variance to learn from.
"""

from __future__ import annotations

import os
import random
import re
import tempfile

import torch

#: what the tests, the demo and the benchmarks set: nothing reaches the Hub, no tracker, quiet libraries
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_DISABLED": "true",
    "TOKENIZERS_PARALLELISM": "false",
}


def use_offline_env(**extra: str) -> None:
    """Set `OFFLINE_ENV` (and `extra`) in `os.environ` where not already set; call before importing transformers."""
    for key, value in {**OFFLINE_ENV, **extra}.items():
        os.environ.setdefault(key, value)


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|im_end|>", "<|im_start|>"]
ALPHABET = "0123456789+-*=?:., abcdefghijklmnopqrstuvwxyz\n\\{}"


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` trained offline, with a chat template; eos is `<|im_end|>`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS + ["?"], min_frequency=1)
    tok.train_from_iterator([ALPHABET] * 4, trainer=trainer)
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token=None, unk_token="?"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, tie_word_embeddings: bool = True,
                num_experts: int = 0):
    """A random Qwen3 causal LM sized for CPU tests (about 0.1M parameters); with `num_experts`, a Qwen3-MoE whose MLPs
    are that many experts (2 routed per token; transformers 5 fuses them into one `gate_up_proj` and one `down_proj`
    per layer, saved as one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _toy_config(tokenizer, hidden_size, num_layers, num_experts=num_experts)
    config.tie_word_embeddings = tie_word_embeddings
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def _toy_config(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_experts: int = 0, **extra):
    from transformers import Qwen3Config, Qwen3MoeConfig

    if num_experts:
        extra.update(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                     norm_topk_prob=True)
    return (Qwen3MoeConfig if num_experts else Qwen3Config)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )


def make_toy_prm(path: str | None = None, seed: int = 0, num_labels: int = 2, step_tag: str | None = None,
                 architecture: str | None = None) -> str:
    """A random process reward model saved with its tokenizer to `path` (a temp dir when None); return the path.

    A tiny Qwen3 token classifier (`num_labels` logits per token) on the toy tokenizer. `step_tag` adds that string as
    a special token (e.g. Qwen2.5-Math-PRM's `"<extra_0>"`); `architecture` overrides the architecture name written
    to its config (e.g. `"Qwen2ForProcessRewardModel"`, which `process_reward_model_style="auto"` recognises).
    """
    from transformers import AutoModelForTokenClassification

    path = path or tempfile.mkdtemp(prefix="toy_prm_")
    tok = build_tokenizer()
    if step_tag is not None:
        # the toy vocabulary has a hole (id 3) and so ends at id len(tok): the first added token would get the id of
        # "}" (transformers numbers new tokens from len(tok)); a filler takes that id so the tag gets its own
        tok.add_special_tokens({"additional_special_tokens": ["<toy_filler>", step_tag]})
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(_toy_config(tok, num_labels=num_labels))
    if architecture is not None:
        model.config.architectures = [architecture]
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if architecture is not None:  # save_pretrained writes the class's own name
        model.config.architectures = [architecture]
        model.config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------- the toy task
def addition_examples(max_digit: int = 4):
    """All prompts `"a+b="` with `0 <= a, b <= max_digit`, with their answer `str(a + b)`."""
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(max_digit + 1)
        for b in range(max_digit + 1)
    ]


def addition_dataset(n: int = 64, max_digit: int = 4, seed: int = 0):
    """A `datasets.Dataset` of `n` rows drawn (with a seeded shuffle, cycling) from `addition_examples`."""
    from datasets import Dataset

    base = addition_examples(max_digit)
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        block = base[:]
        rng.shuffle(block)
        rows.extend(block)
    return Dataset.from_list(rows[:n])


_FIRST_NUMBER = re.compile(r"-?\d+")


def addition_reward(completions, answer, **kwargs):
    """1.0 when the first number in the completion equals the answer, else 0.0 (a verifiable reward)."""
    out = []
    for completion, truth in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        match = _FIRST_NUMBER.search(text)
        out.append(1.0 if match is not None and match.group(0) == str(truth) else 0.0)
    return out


def warm_start(model, tokenizer, steps: int = 40, lr: float = 3e-3, max_digit: int = 4, seed: int = 0):
    """A short supervised fit on `"a+b=c<eos>"` so that the reward is not all-zero at the start of RL.

    The number of steps is chosen so that the model is right on about half of the prompts: RL then has signal.
    """
    torch.manual_seed(seed)
    examples = addition_examples(max_digit)
    return _supervised_fit(model, tokenizer, [examples] * steps, lr)


def _supervised_fit(model, tokenizer, batches, lr: float):
    """One AdamW step per batch of `{"prompt", "answer"}` examples (`"completion"`, when given, is the target text
    instead of the answer), on the target tokens only."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for examples in batches:
        texts = [e["prompt"] + e.get("completion", e["answer"]) + tokenizer.eos_token for e in examples]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        prompt_lens = [len(tokenizer(e["prompt"])["input_ids"]) for e in examples]
        for i, n in enumerate(prompt_lens):
            labels[i, :n] = -100  # learn the answer only
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return model


@torch.no_grad()
def greedy_accuracy(model, tokenizer, max_digit: int = 4, max_new_tokens: int = 3) -> float:
    """Share of the toy prompts the model answers right with greedy decoding."""
    examples = addition_examples(max_digit)
    enc = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left")
    was_training = model.training
    model.eval()
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rewards = addition_reward(texts, [e["answer"] for e in examples])
    return sum(rewards) / len(rewards)


def make_toy_checkpoint(path: str | None = None, seed: int = 0, warm_steps: int = 40, hidden_size: int = 64,
                        tie_word_embeddings: bool = True, num_experts: int = 0) -> str:
    """Build, warm-start and save the tiny model and tokenizer to `path` (a temp dir when None); return the path.

    TRL reloads the reference model from this path when `beta != 0`, hence a real directory on disk. vLLM's CPU
    attention refuses head dimensions below 32: `hidden_size=128` (head_dim 32) is the smallest model it serves.
    `num_experts`: a mixture-of-experts model (`build_model`).
    """
    path = path or tempfile.mkdtemp(prefix="toy_model_")
    tok = build_tokenizer()
    model = build_model(tok, seed=seed, hidden_size=hidden_size, tie_word_embeddings=tie_word_embeddings,
                        num_experts=num_experts)
    if warm_steps:
        warm_start(model, tok, steps=warm_steps, seed=seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_learned_position_checkpoint(path: str | None = None, seed: int = 0) -> str:
    """A random tiny GPT-2 (learned absolute position embeddings, unlike the rotary toy model) on the toy tokenizer,
    saved to `path` (a temp dir when None); return the path. No dropout (TRL's policy forward runs in train mode, so
    the policy would not equal the reference), LM head untied (so that `cast_lm_head_to_fp32` applies)."""
    return _gpt2_checkpoint(path, seed, n_embd=32, n_head=2, tie_word_embeddings=False)


def make_tied_gpt2_checkpoint(path: str | None = None, seed: int = 0) -> str:
    """A random tiny GPT-2 whose LM head is tied to `transformer.wte` (an embedding not at `model.embed_tokens`), at
    vLLM's CPU head size (n_embd 128, 4 heads: head_dim 32), no dropout, saved to `path`; return the path."""
    return _gpt2_checkpoint(path, seed, n_embd=128, n_head=4, tie_word_embeddings=True)


def _gpt2_checkpoint(path, seed: int, n_embd: int, n_head: int, tie_word_embeddings: bool) -> str:
    from transformers import AutoModelForCausalLM, GPT2Config

    path = path or tempfile.mkdtemp(prefix="toy_gpt2_")
    tok = build_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tok), n_embd=n_embd, n_layer=2, n_head=n_head, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tie_word_embeddings,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------- the digits task
#: the step separator of the digits task (the toy tokenizer has no newline token, so not a blank line)
DIGITS_SEPARATOR = ", "


def digits_examples(n: int, num_digits: int = 4, max_digit: int = 4, seed: int = 0):
    """`n` seeded prompts `"0123+3041="` (two `num_digits`-digit strings) with their digit-wise sum `"3164"` (no carry:
    digits up to `max_digit` <= 4) as `answer`, and `"3, 1, 6, 4"` as the target `completion`: one step per digit."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = [rng.randint(0, max_digit) for _ in range(num_digits)]
        b = [rng.randint(0, max_digit) for _ in range(num_digits)]
        answer = "".join(str(x + y) for x, y in zip(a, b))
        rows.append({"prompt": "".join(map(str, a)) + "+" + "".join(map(str, b)) + "=", "answer": answer,
                     "completion": DIGITS_SEPARATOR.join(answer)})
    return rows


def digits_dataset(n: int = 256, num_digits: int = 4, seed: int = 0):
    """A `datasets.Dataset` of `digits_examples` (columns `prompt`, `answer`)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": e["prompt"], "answer": e["answer"]}
                              for e in digits_examples(n, num_digits, seed=seed)])


def _digit_steps(completion) -> list[str]:
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    return [step.strip() for step in text.split(DIGITS_SEPARATOR)]


def digit_step_rewards(completions, answer, **kwargs):
    """A step reward function: per completion, 1.0 for each step that is the right digit at its place, else 0.0
    (steps beyond the answer's digits are wrong)."""
    return [[1.0 if j < len(truth) and step == truth[j] else 0.0 for j, step in enumerate(_digit_steps(c))]
            for c, truth in zip(completions, answer)]


def digits_exact_reward(completions, answer, **kwargs):
    """The outcome reward of the digits task: 1.0 when the steps are exactly the answer's digits, else 0.0."""
    return [float(_digit_steps(c) == list(truth)) for c, truth in zip(completions, answer)]


def warm_start_digits(model, tokenizer, steps: int = 140, lr: float = 3e-3, num_digits: int = 4, seed: int = 0,
                      batch_size: int = 128):
    """A supervised fit on fresh `digits_examples` every step. From `build_model(seed=0)`, 140 steps on 4 digits
    leave a model right on 45% of the digits and 4.5% of the answers (`digits_accuracy`): a per-digit reward is dense,
    the exact-answer reward sparse."""
    torch.manual_seed(seed)
    batches = [digits_examples(batch_size, num_digits, seed=1000 * (seed + 1) + step) for step in range(steps)]
    return _supervised_fit(model, tokenizer, batches, lr)


@torch.no_grad()
def digits_accuracy(model, tokenizer, n: int = 400, num_digits: int = 4, seed: int = 99, temperature: float = 1.0):
    """(share of right digits, share of exact answers) of `n` seeded samples at `temperature` on held-out prompts."""
    examples = digits_examples(n, num_digits, seed=seed)
    enc = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left")
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(**enc, max_new_tokens=3 * num_digits, do_sample=True, temperature=temperature,
                             top_k=0, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    answers = [e["answer"] for e in examples]
    digits = digit_step_rewards(texts, answers)
    right = sum(sum(row[:num_digits]) / num_digits for row in digits) / n
    exact = sum(digits_exact_reward(texts, answers)) / n
    return right, exact
