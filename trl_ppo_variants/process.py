"""Process supervision: step rewards, from reward functions or a process reward model, at the tokens where steps end.

One module for the step-reward machinery, used by `ProcessGRPOTrainer` (GRPO with process supervision, DeepSeekMath
arXiv 2402.03300 Sec. 4.1.3) and by the trainers whose estimator takes token rewards (PPO and VAPO through GAE,
REINFORCE++ through its returns):

- Steps. A completion's text is split on `step_separator` (default a blank line, `"\\n\\n"`, the separator of
  Qwen2.5-Math and its PRMs) exactly as `text.split(step_separator)` does: `n` separators make `n + 1` steps, empty
  pieces included. A step ends with its separator; the last step ends at the last completion token (EOS included),
  so every sampled token belongs to a step. `split_steps` is the function to use inside a step reward function.
- Text -> tokens (`step_end_tokens`). The text a reward function sees is TRL's decoding of `completion_ids`
  (`skip_special_tokens=True`), or the content of the assistant message (conversational data; with a tokenizer that
  parses responses, that content is a part of the decoded text and is located in it). The end of step j is the
  first token whose decoded prefix reaches the character after step j's separator (binary search over prefix
  decodes, exact for any tokenizer whose prefix decodes are prefixes of the text). A token that straddles a separator
  belongs to the step the separator closes; a token holding two separators ends two steps. In a multi-turn rollout
  (tools) the steps are those of the last message; the tokens before it get the advantage of its first step.
- Sources. (a) Step reward functions: like TRL reward functions (same arguments) but returning, per completion, a
  list with one reward per step (None for an unscored step), or None for an unscorable completion. (b) A process
  reward model (`ProcessRewardModel`, `process_reward_model_path`) scoring each step at its step tag, as the open
  PRMs do. Both become columns of TRL's reward table: TRL calls them on each process's own rows and gets one number
  per completion (the sum of its step rewards, what `rewards/<name>/mean` logs); the lists are kept, weighted by
  `reward_weights`, summed over sources per step, padded with NaN to the largest step count of any process, gathered
  (the same collectives on every rank) and handed to the estimator as `(N, S)` step rewards and step-end indices.
- Outcome rewards (the ordinary reward functions) are not mixed into the step rewards: each estimator says how it
  combines the two (`ProcessGRPOTrainer`: a GRPO outcome advantage added to the process advantage; PPO/VAPO and
  REINFORCE++: the outcome at the last token plus each step reward at its step end,
  `advantages.token_rewards_from_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .errors import check
from .guards import _as_reward, model_context_length
from .rewards import completion_text

#: `process_reward_model_style` values (see `ProcessRewardModel`)
PRM_STYLES = ("auto", "trl", "qwen2.5-math-prm")
#: the step tag each style appends to every step when `process_reward_model_step_tag` is None
DEFAULT_STEP_TAGS = {"trl": "\n", "qwen2.5-math-prm": "<extra_0>"}
#: the system prompt Qwen2.5-Math-PRM is used with (its model card)
QWEN_PRM_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
#: architecture name of Qwen2.5-Math-PRM's remote code (`style="auto"` recognises it)
QWEN_PRM_ARCHITECTURE = "Qwen2ForProcessRewardModel"


# --------------------------------------------------------------------------------------------- steps and tokens
def split_steps(text: str, separator: str = "\n\n") -> list[str]:
    """The steps of a completion's text: `text.split(separator)` (empty pieces included; `""` is one empty step)."""
    return text.split(separator)


def _first_token_reaching(ids: list[int], decode: Callable, num_chars: int, lo: int) -> int:
    """Smallest k >= lo with len(decode(ids[:k + 1])) >= num_chars (the last token when none reaches it)."""
    hi = len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[: mid + 1])) >= num_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def step_end_tokens(text: str, completion_ids: Sequence[int], decode: Callable, separator: str = "\n\n") -> list[int]:
    """Index in `completion_ids` of the last token of each step of `text` (see the module docstring).

    Args:
        text: the completion as the reward functions see it.
        completion_ids: its token ids (EOS included when sampled).
        decode: ids -> text, the tokenizer's `decode(ids, skip_special_tokens=True)` (TRL's decoding).
    Returns:
        one index per step of `split_steps(text, separator)`, non-decreasing; the last is `len(completion_ids) - 1`.
        All -1 when the completion has no token.
    """
    ids = [int(i) for i in completion_ids]
    pieces = split_steps(text, separator)
    if not ids:
        return [-1] * len(pieces)
    decoded = decode(ids)
    offset = decoded.rfind(text)
    if offset < 0:
        raise ValueError("the completion text is not part of the text its completion_ids decode to, so its steps "
                         "cannot be mapped to tokens")
    ends, chars, token = [], offset, 0
    for piece in pieces[:-1]:
        chars += len(piece) + len(separator)
        token = _first_token_reaching(ids, decode, chars, token)
        ends.append(token)
    ends.append(len(ids) - 1)
    return ends


def parse_step_rewards(output, step_counts: list[int], separator: str) -> list[list[float]]:
    """A step reward function's output -> one list of floats (NaN: unscored) per completion, of its step count.

    Raises ValueError naming what is wrong: not one entry per completion, a list whose length is not the number of
    steps, a non-number.
    """
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence) and not hasattr(output, "__len__"):
        raise ValueError(f"returned {type(output).__name__} instead of a list with one list of step rewards per "
                         "completion")
    if len(output) != len(step_counts):
        raise ValueError(f"returned {len(output)} entries for {len(step_counts)} completions (one list of step "
                         "rewards, or None, per completion)")
    parsed = []
    for i, (row, count) in enumerate(zip(output, step_counts)):
        if row is None:
            parsed.append([math.nan] * count)
            continue
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
            raise ValueError(f"returned {type(row).__name__} for completion {i} instead of a list of step rewards")
        if len(row) != count:
            raise ValueError(f"returned {len(row)} step rewards for completion {i}, whose text has {count} steps "
                             f"(split on {separator!r}; use trl_ppo_variants.process.split_steps)")
        try:
            values = [_as_reward(v) for v in row]
        except TypeError as exc:
            raise ValueError(f"returned {exc} among the step rewards of completion {i}") from None
        parsed.append([math.nan if v is None else v for v in values])
    return parsed


def _sum_of_finite(row: list[float]) -> float | None:
    """The number TRL's reward table gets for a completion: the sum of its finite step rewards (None: none)."""
    finite = [v for v in row if math.isfinite(v)]
    return sum(finite) if finite else None


def _prompt_text(prompt) -> str:
    """The question of a prompt: the string itself, or the last user message of a conversation."""
    if isinstance(prompt, (list, tuple)):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return completion_text(users or list(prompt))
    return completion_text(prompt)


class StepMapper:
    """Step ends of one process's completions, computed once per reward computation and shared by every step
    source (they all split on the same separator)."""

    def __init__(self, separator: str):
        self.separator = separator
        self.tokenizer = None  # set by the trainer once TRL has loaded it
        self.ends = None

    def begin(self) -> None:
        self.ends = None

    def __call__(self, completions, completion_ids) -> list[list[int]]:
        if self.ends is None:
            def decode(ids):
                return self.tokenizer.decode(ids, skip_special_tokens=True)

            self.ends = [step_end_tokens(completion_text(c), ids, decode, self.separator)
                         for c, ids in zip(completions, completion_ids)]
        return self.ends


def outcome_as_one_step(reward_func: Callable, name: str = "one_step_reward", separator: str = "\n\n") -> Callable:
    """A step reward function made of an outcome reward function: the outcome reward is the reward of the
    completion's last step, the steps before it (a completion whose text holds `separator`, the trainer's
    `step_separator`) are unscored (None stays None). Every token then gets the normalised outcome as its advantage:
    process GRPO trains exactly as GRPO on that reward, whatever the text's step count (a one-entry list for every
    completion was refused for a text with a blank line: SmolLM2's word problems hit it at the first step)."""

    def step_rewards(*args, **kwargs) -> list[list[float | None]]:
        rewards = reward_func(*args, **kwargs)
        counts = [len(split_steps(completion_text(c), separator)) for c in kwargs["completions"]]
        return [[None] * (count - 1) + [r] for r, count in zip(rewards, counts)]

    step_rewards.__name__ = name
    return step_rewards


class StepRewardFunction:
    """A step reward source as a TRL reward function: TRL gets the sum of each completion's step rewards, the lists
    stay in `last` (NaN-padded per completion to its own step count)."""

    def __init__(self, func, mapper: StepMapper):
        from trl.trainer.utils import get_callable_name, is_async_callable

        check(callable(func) and not isinstance(func, (str, torch.nn.Module)), "step_reward_funcs",
              "callables returning, per completion, a list of step rewards (reward models go in "
              "process_reward_model_path)", func)
        check(not is_async_callable(func), "step_reward_funcs", "synchronous functions", func)
        self.func = func
        self.mapper = mapper
        self.__name__ = get_callable_name(func)
        self.last = None

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        ends = self.mapper(completions, completion_ids)
        output = self.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        self.last = parse_step_rewards(output, [len(e) for e in ends], self.mapper.separator)
        return [_sum_of_finite(row) for row in self.last]


# --------------------------------------------------------------------------------------------- process reward model
class ProcessRewardModel:
    """A process reward model as a step reward function: per completion, the probability that each step is good.

    Loaded with `AutoModelForTokenClassification` (or, for a checkpoint whose own code registers only `AutoModel`,
    such as Qwen2.5-Math-PRM, with `AutoModel` and `trust_remote_code=True`); it must return per-token logits with 1
    label (score `sigmoid`) or 2 labels (score `softmax[..., 1]`, label 1 = good step). The input is built piece by
    piece, so the scored positions are exact: a prefix, then for every step its tokens followed by the step tag's, the
    score being read at the tag's last token. Styles:

    - `"trl"`: TRL's `PRMTrainer` format (the format of PRMs trained with TRL, and Math-Shepherd-style data whose tag
      is given in `step_tag`): `[bos] + question + (step + tag) * S`, tag `"\\n"` by default.
    - `"qwen2.5-math-prm"`: Qwen2.5-Math-PRM's usage: the chat template of `[system (its model card's prompt), user:
      question]` with the assistant turn opened, then every step followed by `<extra_0>`.
    - `"auto"`: `"qwen2.5-math-prm"` when the checkpoint's architecture is `Qwen2ForProcessRewardModel`, else `"trl"`.

    Causal-LM PRMs that score with the logits of two vocabulary tokens (the original Math-Shepherd checkpoint) are
    not token classifiers and are not loaded; a subclass overriding `step_probabilities` adds them. The question is the
    prompt string, or the last user message of a conversational prompt. Steps beyond the model's context get NaN.
    """

    __name__ = "process_reward_model"

    def __init__(self, path: str, separator: str = "\n\n", style: str = "auto", step_tag: str | None = None,
                 trust_remote_code: bool = False, batch_size: int = 8):
        from transformers import AutoConfig, AutoModel, AutoModelForTokenClassification, AutoTokenizer

        check(style in PRM_STYLES, "process_reward_model_style", f"one of {PRM_STYLES}", style)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto_map = getattr(config, "auto_map", None) or {}
        own_code = "AutoModel" in auto_map and "AutoModelForTokenClassification" not in auto_map
        if own_code:
            check(trust_remote_code, "trust_remote_code", f"True to load the process reward model {path!r} (its own "
                  "code registers it as AutoModel)", trust_remote_code)
        loader = AutoModel if own_code else AutoModelForTokenClassification
        self.model = loader.from_pretrained(path, trust_remote_code=trust_remote_code, dtype="auto")
        self.model.eval().requires_grad_(False)
        labels = getattr(self.model.config, "num_labels", None)
        if not own_code:
            check(labels in (1, 2), "process_reward_model_path", "a token classifier with 1 or 2 labels (label 1 = "
                  f"good step)", f"{path} with {labels} labels")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if style == "auto":
            style = "qwen2.5-math-prm" if QWEN_PRM_ARCHITECTURE in (config.architectures or []) else "trl"
        self.style = style
        self.step_tag = DEFAULT_STEP_TAGS[style] if step_tag is None else step_tag
        self.tag_ids = self.tokenizer.encode(self.step_tag, add_special_tokens=False)
        check(len(self.tag_ids) > 0, "process_reward_model_step_tag", "a tag the PRM's tokenizer encodes to at "
              "least one token", self.step_tag)
        if style == "qwen2.5-math-prm":
            check(self.tokenizer.chat_template is not None, "process_reward_model_style",
                  "'trl' for a PRM whose tokenizer has no chat template", style)
        self.separator = separator
        self.batch_size = max(1, int(batch_size))
        self.max_length = model_context_length(self.model)

    def to(self, device) -> ProcessRewardModel:
        self.model.to(device)
        return self

    def prefix_ids(self, prompt) -> list[int]:
        question = _prompt_text(prompt)
        if self.style == "qwen2.5-math-prm":
            messages = [{"role": "system", "content": QWEN_PRM_SYSTEM_PROMPT}, {"role": "user", "content": question}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids = self.tokenizer.encode(question, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        return ids if bos is None else [bos] + ids

    def encode(self, prompt, steps: list[str]) -> tuple[list[int], list[int]]:
        """(input ids, the position of each step's score); positions beyond the model's context are dropped."""
        ids = self.prefix_ids(prompt)
        positions = []
        for step in steps:
            ids = ids + self.tokenizer.encode(step, add_special_tokens=False) + self.tag_ids
            positions.append(len(ids) - 1)
        if self.max_length is not None and len(ids) > self.max_length:
            ids = ids[: self.max_length]
        return ids, positions

    def step_probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """(K, C) logits at the scored positions -> (K,) probability that each step is good."""
        logits = logits.float()
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits[:, 0])
        if logits.shape[-1] == 2:
            return torch.softmax(logits, dim=-1)[:, 1]
        raise ValueError(f"the process reward model returned {logits.shape[-1]} labels per token, expected 1 or 2")

    @torch.no_grad()
    def __call__(self, prompts, completions, **kwargs) -> list[list[float]]:
        encoded = [self.encode(p, split_steps(completion_text(c), self.separator))
                   for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        scores = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (ids, _) in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[i, : len(ids)] = 1
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            for i, (ids, positions) in enumerate(chunk):
                inside = [p for p in positions if p < len(ids)]
                probs = self.step_probabilities(logits[i, inside]).tolist() if inside else []
                scores.append(probs + [math.nan] * (len(positions) - len(inside)))
        return scores


# --------------------------------------------------------------------------------------------- config and trainer
@dataclass
class StepRewardFields:
    r"""
    Config fields of the trainers that take step rewards: `ProcessGRPOConfig`, `PPOConfig`, `VAPOConfig` and
    `ReinforcePPConfig` (REINFORCE++ only, not the baseline variant). Step reward functions themselves are passed to
    the trainer, `step_reward_funcs=[...]`, next to TRL's `reward_funcs`.

    Refused with a one-line error: an empty `step_separator`, an unknown `process_reward_model_style`, an empty
    `process_reward_model_step_tag` (or one the PRM's tokenizer encodes to nothing), a local
    `process_reward_model_path` that does not exist, a PRM with other than 1 or 2 labels, a remote-code PRM without
    `trust_remote_code=True`, and any step source where the configuration cannot use it (`baseline=True`).

    Parameters:
        step_separator (`str`, *optional*, defaults to `"\n\n"`):
            The text that ends a step of a completion (a blank line by default). Steps are
            `text.split(step_separator)`: a step reward function returns one reward per piece
            (`trl_ppo_variants.process.split_steps`); a step's reward sits at the token that ends its separator, the
            last step's at the last completion token.
        process_reward_model_path (`str` or `None`, *optional*, defaults to `None`):
            A process reward model scoring every step (P(good step) in [0, 1]): a token classifier with 1 or 2 labels
            (`AutoModelForTokenClassification`), or a remote-code PRM registered as `AutoModel` (Qwen2.5-Math-PRM;
            set `trust_remote_code=True`). Its scores are a step reward source named `process_reward_model`, after
            the `step_reward_funcs` (its weight is the last of `reward_weights`). One copy per process, not sharded.
        process_reward_model_style (`str`, *optional*, defaults to `"auto"`):
            How the PRM's input is built and where it is read: `"trl"` (TRL's PRMTrainer format, `[bos] question
            (step tag)*`), `"qwen2.5-math-prm"` (chat template with Qwen2.5-Math-PRM's system prompt, `<extra_0>`
            after every step), or `"auto"` (`"qwen2.5-math-prm"` for a `Qwen2ForProcessRewardModel`, else `"trl"`).
        process_reward_model_step_tag (`str` or `None`, *optional*, defaults to `None`):
            The tag appended to every step in the PRM's input, whose last token is scored. `None`: `"\n"` (`"trl"`,
            TRL's default step separator) or `"<extra_0>"` (`"qwen2.5-math-prm"`).
    """

    step_separator: str = field(
        default="\n\n",
        metadata={"help": "Text between two steps of a completion (default a blank line); steps end with it."},
    )
    process_reward_model_path: str | None = field(
        default=None,
        metadata={"help": "A process reward model (token classifier) scoring every step; None: none."},
    )
    process_reward_model_style: str = field(
        default="auto", metadata={"help": "PRM input format: 'auto', 'trl' or 'qwen2.5-math-prm'."}
    )
    process_reward_model_step_tag: str | None = field(
        default=None,
        metadata={"help": "Tag after every step in the PRM's input; None: '\\n' (trl) or '<extra_0>' (qwen)."},
    )

    def step_rewards_refused(self) -> str | None:
        """Why this configuration cannot take step rewards, or None when it can."""
        return None

    def __post_init__(self):
        if self.process_reward_model_path == "":  # the command line's way to unset a recipe's path
            self.process_reward_model_path = None
        check(isinstance(self.step_separator, str) and self.step_separator != "", "step_separator",
              "a non-empty string (the text that ends a step)", self.step_separator)
        check(self.process_reward_model_style in PRM_STYLES, "process_reward_model_style", f"one of {PRM_STYLES}",
              self.process_reward_model_style)
        if self.process_reward_model_step_tag is not None:
            check(isinstance(self.process_reward_model_step_tag, str) and self.process_reward_model_step_tag != "",
                  "process_reward_model_step_tag", "None or a non-empty string", self.process_reward_model_step_tag)
        if self.process_reward_model_path is not None:
            reason = self.step_rewards_refused()
            check(reason is None, "process_reward_model_path", f"None ({reason})", self.process_reward_model_path)
        super().__post_init__()


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class StepRewardsMixin:
    """Trainer mixin: step reward sources (`step_reward_funcs=[...]`, `args.process_reward_model_path`) become columns
    of TRL's reward table (after `reward_funcs`, in that order: `reward_weights` has one weight per column); the
    estimator reads the gathered step rewards through `step_batch` / `dense_step_rewards`. Without any step source
    nothing changes. Put it before `VariantTrainer` in the bases; the config must have `StepRewardFields`."""

    def __init__(self, model, reward_funcs=None, args=None, step_reward_funcs=None, **kwargs):
        self._step_functions = []
        self._step_batch = None
        self._step_mapper = StepMapper(getattr(args, "step_separator", "\n\n"))
        sources = [StepRewardFunction(f, self._step_mapper) for f in _as_list(step_reward_funcs)]
        prm = None
        if getattr(args, "process_reward_model_path", None):
            prm = ProcessRewardModel(args.process_reward_model_path, args.step_separator,
                                     args.process_reward_model_style, args.process_reward_model_step_tag,
                                     trust_remote_code=args.trust_remote_code,
                                     batch_size=args.per_device_train_batch_size)
            sources.append(StepRewardFunction(prm, self._step_mapper))
        if sources:
            reason = args.step_rewards_refused()
            check(reason is None, "step_reward_funcs", f"none ({reason})", [s.__name__ for s in sources])
            reward_funcs = _as_list(reward_funcs) + sources
            if kwargs.get("reward_processing_classes") is not None:
                kwargs["reward_processing_classes"] = (_as_list(kwargs["reward_processing_classes"])
                                                       + [None] * len(sources))
        super().__init__(model, reward_funcs, args=args, **kwargs)
        self._step_functions = sources
        self._step_columns = [i for i, f in enumerate(self.reward_funcs) if isinstance(f, StepRewardFunction)]
        self._step_mapper.tokenizer = self._tokenizer
        if prm is not None:
            prm.to(self.accelerator.device)
        self.process_reward_model = prm

    @property
    def step_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(step_rewards (N, S), step_ends (N, S))` of the global batch being scored, or None without step sources.
        Step rewards are the `reward_weights`-weighted sum over the step sources (NaN: no source scored that step)."""
        return self._step_batch

    @property
    def has_outcome_rewards(self) -> bool:
        """Whether any reward function is an outcome (per-completion) reward, i.e. not a step source."""
        return len(self.reward_funcs) > len(self._step_functions)

    def total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The outcome reward: the weighted sum of the reward functions that are not step sources (NaN where none
        scored the completion). The step sources' columns (sums of step rewards) are only logged."""
        if not self._step_functions:
            return super().total_rewards(rewards_per_func)
        outcome = rewards_per_func.clone()
        outcome[:, self._step_columns] = math.nan
        return super().total_rewards(outcome)

    def selection_scores(self) -> dict:
        """The step rewards of the round just scored, for prompt selection (`screening.PromptSelectionMixin`), which
        hands those of the kept rows back through `use_selection_scores`."""
        if self._step_batch is None:
            return {}
        step_rewards, step_ends = self._step_batch
        return {"step_rewards": step_rewards, "step_ends": step_ends}

    def use_selection_scores(self, scores: dict) -> None:
        if "step_rewards" in scores:
            self._step_batch = (scores["step_rewards"], scores["step_ends"])

    def dense_step_rewards(self, rewards: torch.Tensor, mask: torch.Tensor):
        """For token-reward estimators: `(rewards, step token rewards (N, T) or None)`. A completion with step rewards
        but no outcome reward keeps its steps: its outcome counts as 0 instead of making the row unscorable."""
        if self._step_batch is None:
            return rewards, None
        from .advantages import token_rewards_from_steps

        step_rewards, step_ends = self._step_batch
        has_steps = torch.isfinite(step_rewards).any(dim=1).to(rewards.device)
        rewards = torch.where(torch.isnan(rewards) & has_steps, torch.zeros_like(rewards), rewards)
        return rewards, token_rewards_from_steps(step_rewards, step_ends, mask)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if not self._step_functions:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._step_mapper.begin()
        for source in self._step_functions:
            source.last = None
        # every step source runs inside TRL's call (under the base's guard: a failure stops every rank alike)
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._step_batch = self._gather_step_rewards(self._step_mapper.ends, [s.last for s in self._step_functions])
        return rewards_per_func

    def _gather_step_rewards(self, ends: list[list[int]], per_source: list[list[list[float]]]):
        """This process's step rewards and ends -> the global `(N, S)` tensors, the same on every rank."""
        accelerator = self.accelerator
        device = accelerator.device
        local_steps = max((len(e) for e in ends), default=0)
        num_steps = local_steps
        if accelerator.num_processes > 1:  # every rank pads to the same S, or the gather below hangs
            num_steps = int(accelerator.gather(torch.tensor([local_steps], device=device)).max())
        num_steps = max(num_steps, 1)
        rows = len(ends)
        values = torch.full((rows, len(per_source), num_steps), math.nan)
        step_ends = torch.zeros((rows, num_steps), dtype=torch.long)
        for i, row_ends in enumerate(ends):
            step_ends[i, : len(row_ends)] = torch.tensor(row_ends, dtype=torch.long)
            for f, source_rows in enumerate(per_source):
                values[i, f, : len(row_ends)] = torch.tensor(source_rows[i], dtype=torch.float32)
        weights = self.reward_weights.detach().cpu()[self._step_columns].view(1, -1, 1)
        step_rewards = (values * weights).nansum(dim=1)
        step_rewards[torch.isnan(values).all(dim=1) | (step_ends < 0)] = math.nan
        step_rewards, step_ends = step_rewards.to(device), step_ends.clamp(min=0).to(device)
        if accelerator.num_processes > 1:
            step_rewards, step_ends = accelerator.gather(step_rewards), accelerator.gather(step_ends)
        finite = torch.isfinite(step_rewards)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["process/steps"].append(finite.sum(dim=1).float().mean().item())
        if finite.any():
            self._metrics[mode]["process/step_reward"].append(step_rewards[finite].mean().item())
        return step_rewards, step_ends


__all__ = [
    "PRM_STYLES",
    "ProcessRewardModel",
    "StepRewardFields",
    "StepRewardsMixin",
    "parse_step_rewards",
    "split_steps",
    "step_end_tokens",
]
