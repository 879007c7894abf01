"""The step-reward machinery of `trl_ppo_variants.process`: steps of a text, their last tokens (char-level, straddling
and byte-level BPE tokenizers, conversational content), parsing what step reward functions return, the process reward
model (both input styles, 1 and 2 labels, remote code), and the dense step rewards PPO and REINFORCE++ take."""

import math

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants.advantages import (
    gae,
    masked_whiten,
    reinforce_pp_advantages,
    token_rewards_from_outcome,
    token_rewards_from_steps,
)
from trl_ppo_variants.process import (
    QWEN_PRM_SYSTEM_PROMPT,
    ProcessRewardModel,
    parse_step_rewards,
    split_steps,
    step_end_tokens,
)
from trl_ppo_variants.toy import (
    DIGITS_SEPARATOR,
    addition_dataset,
    addition_reward,
    digit_step_rewards,
    make_toy_prm,
)

NAN = float("nan")


# --------------------------------------------------------------------------------------------- steps and tokens
def test_split_steps_is_str_split():
    assert split_steps("a\n\nb\n\nc") == ["a", "b", "c"]
    assert split_steps("a\n\nb\n\n") == ["a", "b", ""]  # a trailing separator makes an empty last step
    assert split_steps("") == [""]
    assert split_steps("3, 1", ", ") == ["3", "1"]


def _fake_tokenizer(pieces):
    """ids are indices into `pieces`; "<eos>" decodes to nothing (a special token skipped by the decode)."""
    def decode(ids):
        return "".join(pieces[i] for i in ids if pieces[i] != "<eos>")

    return decode


def test_step_end_tokens_char_level(toy_tokenizer):
    ids = toy_tokenizer("3, 1, 6")["input_ids"] + [toy_tokenizer.eos_token_id]
    def decode(x):
        return toy_tokenizer.decode(x, skip_special_tokens=True)

    # "3" "," " " | "1" "," " " | "6" <eos>: each step ends at the space closing its separator, the last at EOS
    assert step_end_tokens("3, 1, 6", ids, decode, ", ") == [2, 5, 7]
    assert step_end_tokens("3, 1, 6", ids[:-1], decode, ", ") == [2, 5, 6]  # truncated: the last token ends it


def test_step_end_tokens_straddling_and_shared_tokens():
    # "3," + " 1" + ", 6": the token " 1" holds the separator's space and the next step's digit; it ends step 0
    decode = _fake_tokenizer(["3,", " 1", ", 6", "<eos>"])
    assert step_end_tokens("3, 1, 6", [0, 1, 2, 3], decode, ", ") == [1, 2, 3]
    # one token ", , " holds two separators: it ends the first step and the empty second one
    decode = _fake_tokenizer(["a", ", , ", "b"])
    assert step_end_tokens("a, , b", [0, 1, 2], decode, ", ") == [1, 1, 2]
    # no separator: one step ending at the last token; no token at all: nothing to map
    assert step_end_tokens("ab", [0, 2], _fake_tokenizer(["a", "x", "b"]), ", ") == [1]
    assert step_end_tokens("", [], _fake_tokenizer([]), ", ") == [-1]


def test_step_end_tokens_content_inside_the_decoded_text():
    # a response parser may hand reward functions only the message content, e.g. after a reasoning block
    decode = _fake_tokenizer(["<t>", "x", "</t>", "3", ", ", "1", "<eos>"])
    ids = [0, 1, 2, 3, 4, 5, 6]
    assert step_end_tokens("3, 1", ids, decode, ", ") == [4, 6]
    with pytest.raises(ValueError, match="not part of the text"):
        step_end_tokens("9, 1", ids, decode, ", ")


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE tokenizer trained offline on step-separated text: its merges make tokens that hold a step's
    end and its separator, or a separator and the next step's start; multi-byte characters are split into bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Step 1: add 3 and 4.\n\nStep 2: the sum is 7.\n\nSo the answer is 7."] * 50
    corpus += ["café 😀\n\nnaïve"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.mark.parametrize("text", [
    "Step 1: add 3 and 4.\n\nStep 2: the sum is 7.\n\nSo the answer is 7.",
    "café 😀\n\nnaïve\n\n\n\nend\n\n",  # multi-byte characters, an empty step, a trailing separator
    "no separator at all",
])
def test_step_end_tokens_byte_level_bpe(bpe_tokenizer, text):
    tok = bpe_tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    def decode(x):
        return tok.decode(x, skip_special_tokens=True)

    assert decode(ids) == text
    steps = split_steps(text, "\n\n")
    ends = step_end_tokens(text, ids, decode, "\n\n")
    assert len(ends) == len(steps) and ends[-1] == len(ids) - 1 and ends == sorted(ends)
    for j in range(len(steps) - 1):  # the end token is the first whose prefix holds the step and its separator
        through = "\n\n".join(steps[: j + 1]) + "\n\n"
        assert decode(ids[: ends[j] + 1]).startswith(through)
        assert not decode(ids[: ends[j]]).startswith(through)
    if "Step" in text:  # the trained merges really make tokens straddle a separator
        pieces = [tok.decode([i]) for i in ids]
        assert any("\n\n" in p and p.strip("\n") for p in pieces)


# --------------------------------------------------------------------------------------------- parsing
def test_parse_step_rewards():
    parsed = parse_step_rewards([[1, 0.5], None, [None, torch.tensor(2.0)]], [2, 3, 2], ", ")
    assert parsed[0] == [1.0, 0.5] and parsed[2][1] == 2.0
    assert all(math.isnan(v) for v in parsed[1]) and len(parsed[1]) == 3 and math.isnan(parsed[2][0])
    with pytest.raises(ValueError, match="returned 1 entries for 2 completions"):
        parse_step_rewards([[1.0]], [1, 1], ", ")
    with pytest.raises(ValueError, match=r"returned 1 step rewards for completion 0, whose text has 2 steps \(split "
                                         r"on ', '; use trl_ppo_variants.process.split_steps\)"):
        parse_step_rewards([[1.0]], [2], ", ")
    with pytest.raises(ValueError, match="returned float for completion 0 instead of a list"):
        parse_step_rewards([1.0], [1], ", ")
    with pytest.raises(ValueError, match="non-number 'x' among the step rewards of completion 0"):
        parse_step_rewards([["x"]], [1], ", ")
    with pytest.raises(ValueError, match="instead of a list with one list"):
        parse_step_rewards(None, [1], ", ")


# --------------------------------------------------------------------------------------------- process reward model
@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return make_toy_prm(str(tmp_path_factory.mktemp("prm")), seed=0)


def _scores_by_hand(prm, prefix_ids, steps, tag_ids):
    """Run the PRM on one hand-built input: prefix, then each step's tokens and the tag; P(label 1) at each tag."""
    ids, positions = list(prefix_ids), []
    for step in steps:
        ids += prm.tokenizer.encode(step, add_special_tokens=False) + tag_ids
        positions.append(len(ids) - 1)
    with torch.no_grad():
        logits = prm.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.softmax(logits[positions].float(), dim=-1)[:, 1].tolist()


def test_prm_trl_style_scores_each_step_at_its_tag(prm_dir):
    prm = ProcessRewardModel(prm_dir, separator=DIGITS_SEPARATOR)
    assert prm.style == "trl" and prm.step_tag == "\n"  # TRL's PRMTrainer default separator
    tag = prm.tokenizer.encode("\n", add_special_tokens=False)
    prompts = ["1+2=", "3+4=", [{"role": "user", "content": "3+4="}]]
    completions = ["3, 4", "7", [{"role": "assistant", "content": "7, 1, 2"}]]
    scores = prm(prompts, completions)
    question = prm.tokenizer.encode("1+2=", add_special_tokens=False)  # the toy tokenizer has no bos
    assert scores[0] == pytest.approx(_scores_by_hand(prm, question, ["3", "4"], tag), abs=1e-6)
    question = prm.tokenizer.encode("3+4=", add_special_tokens=False)
    assert scores[2] == pytest.approx(_scores_by_hand(prm, question, ["7", "1", "2"], tag), abs=1e-6)
    assert [len(s) for s in scores] == [2, 1, 3] and all(0 < v < 1 for row in scores for v in row)
    # batching pads on the right: scores do not depend on the neighbours
    assert prm(prompts[1:2], completions[1:2])[0] == pytest.approx(scores[1], abs=1e-6)


def test_prm_qwen_style_is_the_model_cards_usage(tmp_path):
    path = make_toy_prm(str(tmp_path / "qwen"), step_tag="<extra_0>", architecture="Qwen2ForProcessRewardModel")
    prm = ProcessRewardModel(path, separator=DIGITS_SEPARATOR)  # style "auto" recognises the architecture
    assert prm.style == "qwen2.5-math-prm" and prm.step_tag == "<extra_0>"
    tag_id = prm.tokenizer.convert_tokens_to_ids("<extra_0>")
    ids, positions = prm.encode("1+2=", ["3", "4"])
    assert [ids[p] for p in positions] == [tag_id, tag_id]
    # the input is the chat the model card builds (system, user, assistant "3<extra_0>4<extra_0>"), up to the end
    messages = [{"role": "system", "content": QWEN_PRM_SYSTEM_PROMPT}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "3<extra_0>4<extra_0>"}]
    card = prm.tokenizer.encode(prm.tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert card[: len(ids)] == ids and card[len(ids)] == prm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    prefix = ids[: positions[0] - 1]
    assert prm(["1+2="], ["3, 4"])[0] == pytest.approx(_scores_by_hand(prm, prefix, ["3", "4"], [tag_id]), abs=1e-6)


def test_prm_one_label_is_a_sigmoid_and_other_heads_are_refused(tmp_path):
    prm = ProcessRewardModel(make_toy_prm(str(tmp_path / "one"), num_labels=1), separator=DIGITS_SEPARATOR)
    ids, positions = prm.encode("1+2=", ["3"])
    with torch.no_grad():
        logit = prm.model(input_ids=torch.tensor([ids])).logits[0, positions[0], 0]
    assert prm(["1+2="], ["3"])[0][0] == pytest.approx(torch.sigmoid(logit).item(), abs=1e-6)
    with pytest.raises(ValueError, match="process_reward_model_path: expected a token classifier with 1 or 2 labels"):
        ProcessRewardModel(make_toy_prm(str(tmp_path / "three"), num_labels=3))
    with pytest.raises(ValueError, match="process_reward_model_style: expected one of"):
        ProcessRewardModel(str(tmp_path / "one"), style="math-shepherd")


def test_prm_steps_beyond_the_context_are_unscored(prm_dir):
    prm = ProcessRewardModel(prm_dir, separator=", ")
    prm.max_length = 8  # "1+2=" is 4 tokens: steps "3" (+ tag) end at 5, "4" at 7, "5" at 9
    scores = prm(["1+2="], ["3, 4, 5"])[0]
    assert math.isfinite(scores[0]) and math.isfinite(scores[1]) and math.isnan(scores[2])


def test_prm_with_its_own_code_needs_trust_remote_code(tmp_path):
    """Qwen2.5-Math-PRM registers its class as AutoModel only (remote code): loaded with AutoModel once trusted."""
    import json

    path = make_toy_prm(str(tmp_path / "remote"))
    (tmp_path / "remote" / "modeling_toy_prm.py").write_text(
        "from transformers import Qwen3ForTokenClassification\n\n\n"
        "class ToyProcessRewardModel(Qwen3ForTokenClassification):\n    pass\n"
    )
    config_file = tmp_path / "remote" / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = {"AutoModel": "modeling_toy_prm.ToyProcessRewardModel"}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code: expected True to load the process reward model"):
        ProcessRewardModel(path)
    prm = ProcessRewardModel(path, separator=", ", trust_remote_code=True)
    assert type(prm.model).__name__ == "ToyProcessRewardModel"
    assert len(prm(["1+2="], ["3, 4"])[0]) == 2


# --------------------------------------------------------------------------------------------- PPO / REINFORCE++
def _capture(trainer_cls):
    """A subclass recording what compute_advantages saw and returned."""
    class Probe(trainer_cls):
        records = []

        def compute_advantages(self, rewards, batch, group_size):
            advantages = super().compute_advantages(rewards, batch, group_size)
            steps = self.step_batch
            self.records.append({"rewards": rewards.clone(), "batch": {k: v.clone() for k, v in batch.items()},
                                 "steps": None if steps is None else (steps[0].clone(), steps[1].clone()),
                                 "advantages": advantages.clone()})
            return advantages

    return Probe


def length_steps(completions, **kwargs):
    """A step reward every completion of the toy model earns something from: its length, less 0.5 per step."""
    return [[len(step) - 0.5 * j for j, step in enumerate(split_steps(c, "1"))] for c in completions]


def _steps_on_toy(tmp_path, toy_model_dir, trainer_cls, config_cls, **overrides):
    probe = _capture(trainer_cls)
    args = toy_args(config_cls, tmp_path, step_separator="1", temperature=2.0, max_completion_length=8, **overrides)
    trainer = probe(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64),
                    step_reward_funcs=[length_steps])
    trainer.train()
    return trainer, probe.records


def _outcome_with_steps(rewards, step_rewards):
    """What dense_step_rewards does to the outcome: 0 instead of NaN where the row has step rewards."""
    has = torch.isfinite(step_rewards).any(1)
    return torch.where(torch.isnan(rewards) & has, torch.zeros_like(rewards), rewards)


def test_reinforce_pp_returns_take_the_step_rewards(tmp_path, toy_model_dir):
    from trl_ppo_variants import ReinforcePPConfig, ReinforcePPTrainer

    trainer, records = _steps_on_toy(tmp_path, toy_model_dir, ReinforcePPTrainer, ReinforcePPConfig,
                                           kl_in_reward_coef=0.05)
    assert len(records) == 2
    saw_steps = False
    for rec in records:
        step_rewards, step_ends = rec["steps"]
        mask = rec["batch"]["completion_mask"].float()
        dense = token_rewards_from_steps(step_rewards, step_ends, mask)
        saw_steps |= bool(torch.isfinite(step_rewards).sum(1).max() > 1)
        expected = reinforce_pp_advantages(_outcome_with_steps(rec["rewards"], step_rewards), mask,
                                           kl=rec["batch"]["kl_in_reward"], kl_coef=0.05, token_rewards=dense)
        torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-6)
        without = reinforce_pp_advantages(rec["rewards"], mask, kl=rec["batch"]["kl_in_reward"], kl_coef=0.05)
        assert not torch.allclose(rec["advantages"], without)  # the step rewards changed the returns
    assert saw_steps, "no completion had two steps: the test did not test anything"


def test_ppo_gae_takes_the_step_rewards(tmp_path, toy_model_dir):
    from trl_ppo_variants import PPOConfig, PPOTrainer

    trainer, records = _steps_on_toy(tmp_path, toy_model_dir, PPOTrainer, PPOConfig, kl_in_reward_coef=0.0,
                                           lam=0.9)
    for rec in records:
        step_rewards, step_ends = rec["steps"]
        mask = rec["batch"]["completion_mask"].float()
        rewards = _outcome_with_steps(rec["rewards"], step_rewards)
        valid = mask * (~torch.isnan(rewards)).float().unsqueeze(1)
        token_rewards = token_rewards_from_outcome(rewards, valid) + token_rewards_from_steps(
            step_rewards, step_ends, mask) * valid
        values = torch.where(valid.bool(), rec["batch"]["old_values"], torch.zeros_like(valid))
        expected = masked_whiten(gae(token_rewards, values, valid, gamma=1.0, lam=0.9)[0], valid)
        torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-5)


def test_outcome_nan_rows_keep_their_steps(tmp_path, toy_model_dir):
    """A completion whose outcome reward is None but whose steps are scored is trained on its steps."""
    from trl_ppo_variants import ReinforcePPConfig, ReinforcePPTrainer

    def no_outcome(completions, **kwargs):
        return [None] * len(completions)

    probe = _capture(ReinforcePPTrainer)
    args = toy_args(ReinforcePPConfig, tmp_path, step_separator="1", temperature=2.0, max_steps=1,
                    kl_in_reward_coef=0.0)
    trainer = probe(toy_model_dir, no_outcome, args=args, train_dataset=addition_dataset(64),
                    step_reward_funcs=[length_steps])
    trainer.train()
    rec = probe.records[0]
    assert torch.isnan(rec["rewards"]).all()
    assert rec["advantages"].abs().sum() > 0


def test_refused_where_the_estimator_takes_no_token_rewards(tmp_path, toy_model_dir, prm_dir):
    from trl_ppo_variants import ReinforcePPConfig, ReinforcePPTrainer, RLOOConfig, RLOOTrainer

    args = toy_args(ReinforcePPConfig, tmp_path, baseline=True)
    with pytest.raises(ValueError, match=r"step_reward_funcs: expected none \(baseline=True broadcasts one outcome"):
        ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, step_reward_funcs=[digit_step_rewards],
                           train_dataset=addition_dataset(16))
    with pytest.raises(ValueError, match=r"process_reward_model_path: expected None \(baseline=True"):
        toy_args(ReinforcePPConfig, tmp_path, baseline=True, process_reward_model_path=prm_dir)
    with pytest.raises(TypeError, match="step_reward_funcs"):
        RLOOTrainer(toy_model_dir, addition_reward, args=toy_args(RLOOConfig, tmp_path),
                    step_reward_funcs=[digit_step_rewards], train_dataset=addition_dataset(16))
    with pytest.raises(TypeError, match="process_reward_model_path"):
        toy_args(RLOOConfig, tmp_path, process_reward_model_path=prm_dir)


def test_an_outcome_on_the_last_step_gives_every_token_grpos_advantage():
    """`outcome_as_one_step`'s lists (the outcome on the last step, earlier steps unscored) under process GRPO's
    estimator: every token of a completion gets GRPO's advantage of its outcome, whatever its step count."""
    from trl_ppo_variants.advantages import grpo_advantages, grpo_process_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0])
    counts = [1, 2, 3, 1, 3, 2, 1, 2]  # steps per completion
    width = 6
    step_rewards = torch.full((8, 3), float("nan"))
    step_ends = torch.zeros((8, 3), dtype=torch.long)
    for i, count in enumerate(counts):
        step_rewards[i, count - 1] = rewards[i]
        step_ends[i, :count] = torch.tensor([width - 1 - 2 * (count - 1 - j) for j in range(count)])
    mask = torch.ones(8, width)
    expected = grpo_advantages(rewards, 4)[:, None].expand(8, width)
    torch.testing.assert_close(grpo_process_advantages(step_rewards, step_ends, mask, 4), expected)


def test_outcome_as_one_step_wraps_each_outcome_reward_as_a_one_step_list():
    from trl_ppo_variants.process import outcome_as_one_step

    def reward(completions, answer, **kwargs):
        return [1.0 if c == a else (None if a is None else 0.0) for c, a in zip(completions, answer)]

    steps = outcome_as_one_step(reward)
    assert steps.__name__ == "one_step_reward"
    assert steps(completions=["7", "8", "9"], answer=["7", "7", None], prompts=["p"] * 3) == [[1.0], [0.0], [None]]
    # a text of several steps: the outcome on its last step, the others unscored (one entry was refused for it)
    texts = ["x\n\n7", "8\n\n\n\n8"]
    assert steps(completions=texts, answer=["x\n\n7", None], prompts=["p"] * 2) == [[None, 1.0], [None, None, None]]
    chat = [[{"role": "assistant", "content": "a\n\nb"}]]  # conversational: the assistant message's steps
    assert steps(completions=chat, answer=["z"], prompts=["p"]) == [[None, 0.0]]
