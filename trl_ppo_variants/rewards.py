"""Verifiable-math rewards: answer extraction, normalisation, equivalence, majority vote (TTRL) and built-in reward
functions usable by name from a recipe.

Everything here runs on model output, which is adversarial by nature (a policy under RL finds whatever makes a
parser slow). The rules, enforced by tests with a time bound:

- model output is never evaluated as code (no `eval`, no `sympy.sympify` in this process);
- every scan is linear and windowed: a 10 MB completion, 10,000 nested braces, LaTeX garbage or a 100,000-digit
  number is handled in well under a second;
- an extracted answer longer than `MAX_ANSWER_CHARS` counts as "no answer" (math answers are short; anything longer
  is almost surely a runaway completion);
- the optional `math-verify` backend (symbolic equivalence through sympy, which can blow up on inputs such as
  `9^{9^{9^{9}}}`) runs in a separate, killable process with a hard timeout; when `math-verify` is not installed the
  module works without it (exact match after normalisation).

Reward functions follow TRL's signature `f(completions, **kwargs) -> list[float | None]`, where dataset columns
arrive as keyword arguments.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction

from .errors import check, config_error

__all__ = [
    "MAX_ANSWER_CHARS",
    "completion_text",
    "extract_boxed",
    "extract_last_number",
    "extract_math_answer",
    "get_answer_extractor",
    "extract_answers",
    "normalize_answer",
    "answers_equivalent",
    "math_verify_available",
    "answer_classes",
    "majority_vote",
    "majority_vote_rewards",
    "vote_statistics",
    "soft_overlong_punishment",
    "overlong_reward",
    "math_accuracy",
    "make_math_accuracy",
    "format_reward",
    "get_reward_function",
    "REWARD_FUNCTIONS",
]

#: longest answer (characters) that counts as an answer; longer extractions are "no answer"
MAX_ANSWER_CHARS = 256
#: the last-number fallback only looks at this many trailing characters of a completion
LAST_NUMBER_WINDOW = 4096
#: integers/fractions with more digits than this are compared as strings, not as numbers
MAX_NUMBER_DIGITS = 64
#: strings longer than this are only stripped by `normalize_answer`, not rewritten
MAX_NORMALIZE_CHARS = 4096
#: how many earlier `\boxed` occurrences are tried when the last one is malformed
_MAX_BOXED_TRIES = 16
#: math-verify only sees answers up to this length (a symbolic parser's cost grows fast with the input)
MATH_VERIFY_MAX_CHARS = 200


# ---------------------------------------------------------------------------------------------------- extraction
def completion_text(completion) -> str:
    """The text of a TRL completion: a string (standard format) or a list of messages (conversational format,
    the last message's content; multimodal content parts are joined)."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion:
        content = completion[-1].get("content", "") if isinstance(completion[-1], dict) else completion[-1]
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return "" if content is None else str(content)
    return str(completion)


_BRACE = re.compile(r"[{}]")
_BOXED_BARE = re.compile(r"\s+([^\s$]+)")


def _boxed_content(text: str, i: int, max_chars: int) -> str | None:
    """Content of the `{...}` starting at text[i] (after `\\boxed`), or None when unclosed within `max_chars`."""
    if i < len(text) and text[i] == "{":
        depth = 0
        window_end = min(len(text), i + max_chars + 2)
        for m in _BRACE.finditer(text, i, window_end):
            depth += 1 if m.group() == "{" else -1
            if depth == 0:
                content = text[i + 1 : m.start()].strip()
                return content or None
        return None
    m = _BOXED_BARE.match(text, i, min(len(text), i + max_chars + 1))  # "\boxed 5"
    if m is not None and len(m.group(1)) <= max_chars:
        return m.group(1)
    return None


def extract_boxed(completion, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) with nested braces, or None.

    Scans backwards with `str.rfind` (C speed) and matches braces in a window of `max_chars`, so the cost is bounded
    whatever the completion. When the last box is unclosed or longer than `max_chars`, earlier boxes are tried (at
    most 16).
    """
    text = completion_text(completion)
    end = len(text)
    for _ in range(_MAX_BOXED_TRIES):
        b, f = text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end)
        start, skip = (b, len("\\boxed")) if b >= f else (f, len("\\fbox"))
        if start < 0:
            return None
        content = _boxed_content(text, start + skip, max_chars)
        if content is not None:
            return content
        end = start
    return None


# a plain decimal number, with optional thousands separators; linear (no nested quantifiers on one class)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_last_number(completion, window: int = LAST_NUMBER_WINDOW) -> str | None:
    """The last number in the completion (e.g. `"-1,234.5"`), looking only at its last `window` characters, or None.

    A number too long to be an answer (more than `MAX_ANSWER_CHARS` characters) gives None.
    """
    text = completion_text(completion)
    tail = text[-window:] if len(text) > window else text
    last = None
    for last in _NUMBER.finditer(tail):
        pass
    if last is None or len(last.group()) > MAX_ANSWER_CHARS:
        return None
    return last.group()


def extract_math_answer(completion) -> str | None:
    r"""The math answer of a completion: the last `\boxed{...}`, else the last number, else None."""
    answer = extract_boxed(completion)
    return answer if answer is not None else extract_last_number(completion)


#: built-in extractors, by the name `TTRLConfig.answer_extractor` accepts
EXTRACTORS: dict[str, Callable[[object], str | None]] = {
    "math": extract_math_answer,
    "boxed": extract_boxed,
    "last_number": extract_last_number,
}


def _import_object(path: str):
    """`"package.module:attribute"` -> the attribute."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get_answer_extractor(name_or_fn) -> Callable[[object], str | None]:
    """A built-in extractor name (`"math"`, `"boxed"`, `"last_number"`), a `"module:function"` path, or a callable
    `completion -> str | None`."""
    if callable(name_or_fn):
        return name_or_fn
    if isinstance(name_or_fn, str):
        if name_or_fn in EXTRACTORS:
            return EXTRACTORS[name_or_fn]
        if ":" in name_or_fn:
            fn = _import_object(name_or_fn)
            if not callable(fn):
                raise ValueError(f"answer_extractor: {name_or_fn!r} is not callable")
            return fn
    raise config_error("answer_extractor", f"one of {sorted(EXTRACTORS)}, 'module:function' or a callable", name_or_fn)


def extract_answers(completions: Sequence, extractor="math") -> list[str | None]:
    """Apply an extractor to each completion; a non-string result is converted with `str`, and an empty or
    over-long (> `MAX_ANSWER_CHARS`) one becomes None (no answer)."""
    fn = get_answer_extractor(extractor)
    answers = []
    for completion in completions:
        a = fn(completion)
        if a is not None and not isinstance(a, str):
            a = str(a)
        if a is not None:
            a = a.strip()
            if not a or len(a) > MAX_ANSWER_CHARS:
                a = None
        answers.append(a)
    return answers


# ---------------------------------------------------------------------------------------------------- normalisation
_UNWRAP = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|operatorname|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|\\q?quad|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_ASSIGN = re.compile(r"^[a-zA-Z]\s*=\s*(?=\S)")
_BOXED_WHOLE = re.compile(r"^\\boxed\s*\{(.*)\}$", re.DOTALL)
_CHOICE = re.compile(r"^\(([A-Za-z])\)$")
_INT = re.compile(r"-?\d+")
_INT_COMMAS = re.compile(r"-?\d{1,3}(?:,\d{3})+")
_DECIMAL = re.compile(r"-?\d*\.\d+|-?\d+\.")
_SLASH = re.compile(r"(-?\d+)/(-?\d+)")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_FRAC_SHORT = re.compile(r"(-?)\\frac(\d)(\d)")


def _as_fraction(s: str) -> Fraction | None:
    """The exact value of a plain integer / decimal / fraction string with at most `MAX_NUMBER_DIGITS` digits."""
    if sum(c.isdigit() for c in s) > MAX_NUMBER_DIGITS:
        return None  # int() on huge digit strings is quadratic (and capped by Python at 4300 digits)
    if _INT.fullmatch(s):
        return Fraction(int(s))
    if _INT_COMMAS.fullmatch(s):
        return Fraction(int(s.replace(",", "")))
    if _DECIMAL.fullmatch(s):
        return Fraction(s if not s.endswith(".") else s[:-1])
    for pattern in (_FRAC, _FRAC_SHORT):
        m = pattern.fullmatch(s)
        if m is not None:
            num, den = int(m.group(2)), int(m.group(3))
            if den == 0:
                return None
            value = Fraction(num, den)
            return -value if m.group(1) else value
    m = _SLASH.fullmatch(s)
    if m is not None and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def normalize_answer(answer) -> str | None:
    r"""Canonical string of an answer, so that equal answers compare equal as strings (None for no answer).

    Removes dollar signs, a whole-answer `\boxed{}`, `\text{}`-style wrappers, `\left`/`\right` and LaTeX spacing,
    degrees and percent signs, whitespace, a leading `x =`, and a trailing period; maps `\dfrac`/`\tfrac` to
    `\frac`; writes plain numbers as reduced fractions (`"0.5"`, `"1/2"`, `"\frac{1}{2}"` -> `"1/2"`; `"1,000"`,
    `"1000.0"` -> `"1000"`); lower-cases purely alphabetic answers and `"(B)"` -> `"b"`. Linear time; strings longer
    than `MAX_NORMALIZE_CHARS` are only stripped.
    """
    if answer is None:
        return None
    s = str(answer).strip()
    if len(s) > MAX_NORMALIZE_CHARS:
        return s or None
    s = s.strip("$").strip()
    m = _BOXED_WHOLE.match(s)
    if m is not None:
        s = m.group(1)
    for _ in range(3):  # wrappers nest rarely; a fixed number of passes keeps this linear
        s = _UNWRAP.sub(r"\1", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = "".join(s.split())
    s = _ASSIGN.sub("", s)
    s = s.rstrip(".") if not _DECIMAL.fullmatch(s) else s
    if not s:
        return None
    m = _CHOICE.fullmatch(s)
    if m is not None:
        s = m.group(1)
    if s.isalpha():
        return s.lower()
    value = _as_fraction(s)
    if value is not None:
        return str(value)  # "p" or "p/q", reduced, "-0" -> "0"
    return s


# ---------------------------------------------------------------------------------------------------- math-verify
def math_verify_available() -> bool:
    """Whether the optional `math-verify` package is installed."""
    return importlib.util.find_spec("math_verify") is not None


def _math_verify_job(gold: str, pred: str) -> bool:
    """Runs in the isolated worker process only."""
    from math_verify import parse, verify

    def _parse(s):
        parsed = parse(f"${s}$")
        return parsed if parsed else parse(s)

    g, p = _parse(gold), _parse(pred)
    return bool(g) and bool(p) and bool(verify(g, p))


class _IsolatedCall:
    """Runs a picklable function in one forked worker process with a hard timeout.

    Signal-based timeouts (what math-verify uses by itself) cannot interrupt a long C-level computation such as a
    huge integer power inside sympy; killing a worker process can. The worker is started lazily, reused, and
    replaced after a timeout.
    """

    def __init__(self, preload: tuple[str, ...] = ()):
        self._preload = preload
        self._pool = None
        self._lock = threading.Lock()
        self._warned = False

    def __call__(self, fn, args, timeout: float):
        if "fork" not in multiprocessing.get_all_start_methods():
            if not self._warned:
                warnings.warn("math-verify equivalence needs the 'fork' start method; using exact matching only")
                self._warned = True
            return None
        with self._lock:
            if self._pool is None:
                for name in self._preload:  # imported once here, so that a replacement worker starts instantly
                    if importlib.util.find_spec(name) is not None:
                        importlib.import_module(name)
                self._pool = multiprocessing.get_context("fork").Pool(1)
            result = self._pool.apply_async(fn, args)
            try:
                return result.get(timeout)
            except multiprocessing.TimeoutError:
                self.close()
                return None
            except Exception:  # a parser error on garbage input is "not equivalent", never a crash
                return None

    def close(self):
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


_ISOLATED = _IsolatedCall(preload=("math_verify",))
atexit.register(_ISOLATED.close)


@functools.lru_cache(maxsize=65536)
def _math_verify_equal(gold: str, pred: str, timeout: float) -> bool:
    if len(gold) > MATH_VERIFY_MAX_CHARS or len(pred) > MATH_VERIFY_MAX_CHARS:
        return False
    return _ISOLATED(_math_verify_job, (gold, pred), timeout) is True


def answers_equivalent(pred, ref, *, math_verify: bool | None = None, timeout: float = 2.0) -> bool:
    """Whether two answers are equivalent: equal after `normalize_answer`, else (when `math_verify` is enabled)
    symbolically equal according to `math-verify`, run isolated with a hard `timeout` (seconds).

    `math_verify=None` uses `math-verify` when installed; `True` requires it. None answers are never equivalent.
    """
    if pred is None or ref is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a is None or b is None:
        return False
    if a == b:
        return True
    if math_verify is None:
        math_verify = math_verify_available()
    elif math_verify and not math_verify_available():
        raise ImportError("math_verify=True needs the optional package: pip install math-verify")
    if not math_verify:
        return False
    return _math_verify_equal(str(ref).strip(), str(pred).strip(), float(timeout))


# ---------------------------------------------------------------------------------------------------- majority vote
def _vote_key(answer, key):
    if answer is None:
        return None
    return key(answer if isinstance(answer, str) else str(answer))


def answer_classes(
    answers: Sequence, group_size: int, key: Callable = normalize_answer, equal: Callable | None = None
) -> list[str | None]:
    """The vote class of each answer: its `key` (None for no answer), or, with `equal`, the key of the first
    earlier answer of its group that `equal(earlier, answer)` accepts (merges e.g. symbolically equal answers).

    Args:
        answers: (N,) answers (str or None), groups of `group_size` consecutive rows.
    Returns:
        (N,) class keys.
    """
    if group_size < 1 or len(answers) % group_size != 0:
        raise ValueError(f"majority_vote: {len(answers)} answers do not split into groups of {group_size}")
    classes = [_vote_key(a, key) for a in answers]
    if equal is None:
        return classes
    for start in range(0, len(answers), group_size):
        reps: list[tuple[str, object]] = []  # (class key, its first raw answer), in order of appearance
        key_to_class: dict[str, str] = {}
        for i in range(start, start + group_size):
            k = classes[i]
            if k is None:
                continue
            if k not in key_to_class:  # `equal` is called once per distinct key and class, not per answer
                match = next((ck for ck, raw in reps if equal(raw, answers[i])), None)
                if match is None:
                    reps.append((k, answers[i]))
                key_to_class[k] = k if match is None else match
            classes[i] = key_to_class[k]
    return classes


def majority_vote(
    answers: Sequence, group_size: int, key: Callable = normalize_answer, equal: Callable | None = None
) -> list[str | None]:
    """TTRL pseudo-labels (arXiv 2504.16084, Sec. 3): the most frequent answer of each group.

    Answers vote by class (`answer_classes`: `key`, default `normalize_answer`, so `"0.5"` and `"\\frac{1}{2}"`
    vote together; optionally merged by `equal`); None answers (nothing extractable) do not vote. Ties are broken
    deterministically: among the tied classes, the one that appears first in the group wins (as
    `collections.Counter.most_common`). Completions are i.i.d. samples, so this tie-break is unbiased; it depends only
    on the order inside the group, which TRL fixes before spreading rows over processes (the trainer votes on the
    gathered group, so the label does not depend on which process a completion landed on).

    Args:
        answers: (N,) extracted answers (str or None); the `G = group_size` answers of one prompt are consecutive.
    Returns:
        (N // G,) labels: the winning class key, or None for a group without any answer.
    """
    classes = answer_classes(answers, group_size, key, equal)
    labels = []
    for start in range(0, len(classes), group_size):
        counts: dict[str, int] = {}  # insertion order = first appearance in the group
        for k in classes[start : start + group_size]:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        if not counts:
            labels.append(None)
            continue
        best = max(counts.values())
        labels.append(next(k for k, c in counts.items() if c == best))
    return labels


def majority_vote_rewards(
    answers: Sequence, group_size: int, key: Callable = normalize_answer, equal: Callable | None = None
) -> tuple[list[str | None], list[float]]:
    """Pseudo-labels and TTRL rewards: 1.0 for a completion whose answer is in its group's label class, else 0.0
    (so 0.0 for no answer, and for every completion of a group without a label).

    Returns:
        ((N // G,) labels, (N,) rewards).
    """
    classes = answer_classes(answers, group_size, key, equal)
    labels = majority_vote(classes, group_size, key=lambda k: k)
    rewards = [
        1.0 if k is not None and k == labels[i // group_size] else 0.0 for i, k in enumerate(classes)
    ]
    return labels, rewards


def vote_statistics(
    pseudo_rewards: Sequence[float],
    group_size: int,
    true_rewards: Sequence[float] | None = None,
    label_correct: Sequence[bool] | None = None,
) -> dict[str, float]:
    """How good the TTRL pseudo-labels are (the paper's Sec. 4 diagnostics), for logging only.

    Args:
        pseudo_rewards: (N,) 1/0 rewards against the pseudo-label, groups of `group_size` consecutive rows (may be
            the kept subset of the voters).
        true_rewards: (N,) 1/0 rewards against the ground truth, or None.
        label_correct: (N // G,) whether each group's pseudo-label equals the ground truth, or None.
    Returns:
        `majority_ratio` (share of completions agreeing with their label), and with the ground truth:
        `reward_accuracy` (share of completions whose pseudo-reward equals the true reward), `pass_at_k` (share of
        groups with at least one right completion, k = group_size) and `label_accuracy`.
    """
    n = len(pseudo_rewards)
    stats = {"majority_ratio": sum(float(p) for p in pseudo_rewards) / max(n, 1)}
    if true_rewards is not None:
        stats["reward_accuracy"] = sum(float(p) == float(t) for p, t in zip(pseudo_rewards, true_rewards)) / max(n, 1)
        groups = range(0, n, group_size)
        stats["pass_at_k"] = sum(any(true_rewards[g : g + group_size]) for g in groups) / max(len(groups), 1)
    if label_correct is not None:
        stats["label_accuracy"] = sum(bool(c) for c in label_correct) / max(len(label_correct), 1)
    return stats


# ---------------------------------------------------------------------------------------------------- overlong
def soft_overlong_punishment(length: int, max_completion_len: int, soft_punish_cache: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13); the same values as
    `trl.rewards.get_soft_overlong_punishment`: 0 up to `L_max - L_cache`, then linear down to -1 at `L_max`, and -1
    beyond."""
    free = max_completion_len - soft_punish_cache
    if length <= free:
        return 0.0
    if length <= max_completion_len:
        return (free - length) / soft_punish_cache
    return -1.0


class overlong_reward:  # noqa: N801 - a factory used like a function, picklable (TRL's async rollout pickles)
    """Reward-function factory for `soft_overlong_punishment`: `overlong_reward(max_completion_len, cache)` is a TRL
    reward function over `completion_ids`."""

    __name__ = "overlong"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        check(isinstance(max_completion_len, int) and max_completion_len > 0, "max_completion_len",
              "an integer > 0", max_completion_len)
        check(isinstance(soft_punish_cache, int) and 0 < soft_punish_cache <= max_completion_len, "soft_punish_cache",
              f"an integer in (0, max_completion_len={max_completion_len}]", soft_punish_cache)
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        return [
            soft_overlong_punishment(len(ids), self.max_completion_len, self.soft_punish_cache)
            for ids in completion_ids
        ]


# ---------------------------------------------------------------------------------------------------- reward functions
#: arguments TRL passes to every reward function that are not dataset columns
TRL_REWARD_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                   "environments", "environment", "tools"}


def required_columns(func) -> list[str]:
    """Dataset columns a reward function needs: its `required_columns` attribute when it has one, else the
    parameters without a default that TRL does not supply itself (TRL passes every other column as a keyword). A
    reward that needs a column reads supervision from the dataset (TTRL refuses such rewards by default)."""
    explicit = getattr(func, "required_columns", None)
    if explicit is not None:
        return list(explicit)
    column = getattr(func, "column", None)  # `make_math_accuracy(column=...)` reads its truth from **kwargs
    if isinstance(column, str):
        return [column]
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
            and p.name not in TRL_REWARD_ARGS]


class make_math_accuracy:  # noqa: N801 - a factory used like a function, picklable
    """Reward-function factory: 1.0 when the extracted answer is equivalent to the dataset column `column`, 0.0
    when not (or when nothing is extractable), None (unscorable) where the ground truth is missing."""

    def __init__(self, column: str = "answer", extractor="math", math_verify: bool | None = None):
        self.column = column
        self.extractor = get_answer_extractor(extractor)
        self.math_verify = math_verify
        self.__name__ = "math_accuracy" if column == "answer" else f"math_accuracy_{column}"

    def __call__(self, completions, **kwargs) -> list[float | None]:
        if self.column not in kwargs:
            raise ValueError(f"{self.__name__}: the dataset has no '{self.column}' column (the ground truth)")
        truths = kwargs[self.column]
        answers = extract_answers(completions, self.extractor)
        return [
            None if t is None else float(answers_equivalent(a, str(t), math_verify=self.math_verify))
            for a, t in zip(answers, truths)
        ]


math_accuracy = make_math_accuracy()
math_accuracy.__doc__ = "Built-in `math_accuracy`: the extracted answer vs the dataset column `answer`."


def format_reward(completions, **kwargs) -> list[float]:
    r"""Built-in `format`: 1.0 when the completion holds a closed `\boxed{...}` answer, else 0.0."""
    return [0.0 if extract_boxed(c) is None else 1.0 for c in completions]


format_reward.__name__ = "format"

#: built-in reward functions by name (factories take keyword arguments through `get_reward_function`)
REWARD_FUNCTIONS: dict[str, Callable] = {
    "math_accuracy": make_math_accuracy,
    "format": lambda: format_reward,
    "overlong": overlong_reward,
}


def get_reward_function(name_or_path, **kwargs) -> Callable:
    """Resolve a reward function for a recipe.

    - a built-in name: `"math_accuracy"` (kwargs: `column`, `extractor`, `math_verify`), `"format"`, `"overlong"`
      (kwargs: `max_completion_len`, `soft_punish_cache`);
    - `"module:function"`: imported; with kwargs, it is called as a factory with them;
    - a callable is returned as is.
    """
    if callable(name_or_path):
        return name_or_path
    check(isinstance(name_or_path, str), "reward function", "a name or 'module:function'", name_or_path)
    if name_or_path == "majority_vote":
        raise ValueError("reward function 'majority_vote' is TTRLTrainer's built-in vote; use TTRLTrainer")
    if name_or_path in REWARD_FUNCTIONS:
        if name_or_path == "math_accuracy" and not kwargs:
            return math_accuracy
        try:
            return REWARD_FUNCTIONS[name_or_path](**kwargs)
        except TypeError as e:
            raise ValueError(f"reward function '{name_or_path}': bad arguments {kwargs!r} ({e})") from None
    if ":" in name_or_path:
        obj = _import_object(name_or_path)
        return obj(**kwargs) if kwargs else obj
    raise config_error("reward function", f"one of {sorted(REWARD_FUNCTIONS)} or 'module:function'", name_or_path)
