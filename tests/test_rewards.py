"""trl_ppo_variants.rewards: extraction, normalisation, equivalence, majority vote, built-in rewards, bounded time."""

import time

import pytest

from trl_ppo_variants import rewards as R


# ------------------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last box
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # nested (escaped) braces
        (r"x \boxed{a^{b^{c}} + {d}} y", r"a^{b^{c}} + {d}"),  # nested braces
        (r"\fbox{7}", "7"),
        (r"$\boxed 9$", "9"),  # brace-less form
        (r"\boxed{5} and a broken \boxed{6", "5"),  # an unclosed last box falls back to the previous one
        (r"\boxed{}", None),
        ("no box here", None),
    ],
)
def test_extract_boxed(text, expected):
    assert R.extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 4 pears: 7", "7"),
        ("total -12.5 dollars.", "-12.5"),
        ("about 1,234 people", "1,234"),
        ("nothing numeric", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert R.extract_last_number(text) == expected


def test_extract_math_answer_prefers_box_then_last_number_and_reads_conversations():
    assert R.extract_math_answer(r"first 3, \boxed{4}, then 5") == "4"
    assert R.extract_math_answer("first 3, then 5") == "5"
    assert R.extract_math_answer("none") is None
    assert R.extract_math_answer([{"role": "assistant", "content": r"\boxed{8}"}]) == "8"


def test_get_answer_extractor_names_paths_and_errors():
    assert R.get_answer_extractor("last_number")("a 1 b 2") == "2"
    assert R.get_answer_extractor("trl_ppo_variants.rewards:extract_boxed") is R.extract_boxed
    with pytest.raises(ValueError, match="answer_extractor"):
        R.get_answer_extractor("nope")
    # a user extractor returning non-strings, empty or huge answers
    answers = R.extract_answers(["a", "b", "c", "d"], lambda c: {"a": 3, "b": "  ", "c": "x" * 10_000, "d": None}[c])
    assert answers == ["3", None, None, None]


# ------------------------------------------------------------------------------------------------ normalisation
@pytest.mark.parametrize(
    "a, b",
    [
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac12", "1/2"),
        ("$1,000$", "1000.0"),
        ("x = 5", "5"),
        (r"50\%", "50"),
        (r"90^\circ", "90"),
        (r"\text{Yes}", "yes"),
        ("(B)", "b"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\boxed{3}", "3"),
        ("-0", "0"),
        ("5.", "5"),
    ],
)
def test_equivalent_after_normalisation(a, b):
    assert R.normalize_answer(a) == R.normalize_answer(b)
    assert R.answers_equivalent(a, b, math_verify=False)


@pytest.mark.parametrize("a, b", [("1/2", "2"), ("12", "1,2"), ("x", "y"), ("3", None), (None, None), ("", "")])
def test_not_equivalent(a, b):
    assert not R.answers_equivalent(a, b, math_verify=False)


def test_math_verify_flag_requires_the_package():
    if R.math_verify_available():
        assert R.answers_equivalent(r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2", math_verify=True)
    else:
        with pytest.raises(ImportError, match="math-verify"):
            R.answers_equivalent("x+1", "1+x", math_verify=True)
        assert not R.answers_equivalent("x+1", "1+x")  # auto: exact matching only


# ------------------------------------------------------------------------------------------------ majority vote
def test_lucky_hit_example_from_the_ttrl_paper():
    """TTRL (arXiv 2504.16084) Sec. 5: votes [1,1,2,2,2,4,5,6], true label 3. The pseudo-label 2 is wrong, yet 5 of
    the 8 pseudo-rewards equal the true rewards (all 0), so the reward accuracy is 5/8."""
    votes = [1, 1, 2, 2, 2, 4, 5, 6]
    labels, pseudo = R.majority_vote_rewards(votes, 8)
    assert labels == ["2"]
    assert pseudo == [0, 0, 1, 1, 1, 0, 0, 0]
    true = [float(R.answers_equivalent(str(v), "3", math_verify=False)) for v in votes]
    assert true == [0.0] * 8
    stats = R.vote_statistics(pseudo, 8, true, [False])
    assert stats == {"majority_ratio": 3 / 8, "reward_accuracy": 5 / 8, "pass_at_k": 0.0, "label_accuracy": 0.0}


def test_majority_vote_ties_empty_groups_all_different():
    answers = [
        "3", "4", "4", "3",  # tie 2-2: the first to appear ("3") wins
        None, None, None, None,  # nothing extractable: no label, all rewards 0
        "1", "2", "3", "4",  # all different: a 1-1-1-1 tie, the first wins
        None, "7", "0.5", r"\frac{1}{2}",  # equivalent forms vote together; None does not vote
    ]
    labels, rewards = R.majority_vote_rewards(answers, 4)
    assert labels == ["3", None, "1", "1/2"]
    assert rewards == [1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1]
    # the tie-break follows the order inside the group
    assert R.majority_vote(["4", "3", "4", "3"], 4) == ["4"]
    with pytest.raises(ValueError, match="groups of 3"):
        R.majority_vote(["1", "2"], 3)


def test_majority_vote_with_an_equivalence_merges_classes():
    same_letter = lambda a, b: a[0] == b[0]  # noqa: E731 - a toy symbolic equivalence
    answers = ["ax", "b", "ay", "by", "bz"]
    assert R.majority_vote(answers, 5, key=str) == ["ax"]  # by key only: five 1-vote classes, the first wins
    assert R.majority_vote(answers, 5, key=str, equal=same_letter) == ["b"]  # classes {ax, ay} and {b, by, bz}
    labels, rewards = R.majority_vote_rewards(answers, 5, key=str, equal=same_letter)
    assert rewards == [0, 1, 0, 1, 1]


def test_vote_statistics_pass_at_k_and_majority_ratio():
    stats = R.vote_statistics([1, 1, 0, 0, 1, 0], 3, [0, 1, 0, 0, 0, 0], [False, False])
    assert stats["majority_ratio"] == 0.5
    assert stats["pass_at_k"] == 0.5
    assert stats["reward_accuracy"] == 4 / 6  # rows 1, 2, 3, 5 agree
    assert R.vote_statistics([1, 0], 2) == {"majority_ratio": 0.5}


# ------------------------------------------------------------------------------------------------ reward functions
def test_math_accuracy_format_and_registry():
    completions = [r"\boxed{4}", "it is 5", "nothing", r"\boxed{0.5}"]
    assert R.math_accuracy(completions, answer=["4", "4", "4", "1/2"]) == [1.0, 0.0, 0.0, 1.0]
    assert R.math_accuracy(["4"], answer=[None]) == [None]  # missing truth: unscorable, not wrong
    with pytest.raises(ValueError, match="no 'answer' column"):
        R.math_accuracy(completions, solution=["4"] * 4)
    by_column = R.get_reward_function("math_accuracy", column="solution")
    assert by_column.__name__ == "math_accuracy_solution"
    assert by_column(completions, solution=["4"] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert R.get_reward_function("math_accuracy") is R.math_accuracy
    fmt = R.get_reward_function("format")
    assert fmt.__name__ == "format" and fmt(completions) == [1.0, 0.0, 0.0, 1.0]
    assert R.get_reward_function("trl_ppo_variants.rewards:format_reward") is R.format_reward
    with pytest.raises(ValueError, match="expected one of"):
        R.get_reward_function("unknown")
    with pytest.raises(ValueError, match="TTRLTrainer"):
        R.get_reward_function("majority_vote")
    with pytest.raises(ValueError, match="overlong"):
        R.get_reward_function("overlong")  # needs its lengths


def test_overlong_matches_trl():
    from trl.rewards import get_soft_overlong_punishment

    ours = R.get_reward_function("overlong", max_completion_len=20, soft_punish_cache=5)
    theirs = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=5)
    ids = [[0] * n for n in range(0, 26)]
    assert ours(ids) == theirs(ids)
    assert ours([[0] * 15, [0] * 18, [0] * 20, [0] * 21]) == [0.0, -0.6, -1.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        R.overlong_reward(20, 0)


# ------------------------------------------------------------------------------------------------ bounded time
ADVERSARIAL = {
    "10 MB of text": "a" * 10_000_000,
    "10 MB then an unclosed box": "a" * 10_000_000 + r"\boxed{" + "{" * 10_000,
    "10,000 nested braces in a box": r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    "10,000 nested braces": "{" * 10_000 + "}" * 10_000,
    "100,000 boxes": r"\boxed{" * 100_000,
    "10 MB of digits": "7" * 10_000_000,
    "100,000-digit number in a box": r"\boxed{" + "9" * 100_000 + "}",
    "exponent tower": r"\boxed{9^{9^{9^{9^{9}}}}}",
    "huge factorial": r"\boxed{100000000!}",
    "LaTeX garbage": (r"\frac{\sqrt{\left(\frac{" * 2000) + r"\right\}}}\text{" * 2000,
    "huge fraction": r"\boxed{\frac{" + "1" * 5000 + "}{" + "3" * 5000 + "}}",
    "regex bait": "1," * 500_000 + "x",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_strings_in_bounded_time(name):
    """Each adversarial completion is extracted, normalised, compared and voted on in bounded time, and nothing is
    evaluated (a `9^{9^{...}}` tower or `100000000!` would not finish if it were). Measured: < 0.03 s each without
    math-verify; with it, `math_accuracy` spends up to its hard worker timeout (2 s) on a symbolic comparison, killed
    there (2.0-2.5 s on a loaded 2-core machine). The bound leaves room for a loaded CI machine: what it must catch
    runs for hours."""
    bound = 5.0 + (2.0 if R.math_verify_available() else 0.0)
    text = ADVERSARIAL[name]
    start = time.perf_counter()
    answer = R.extract_math_answer(text)
    assert answer is None or len(answer) <= R.MAX_ANSWER_CHARS
    R.normalize_answer(text)
    R.normalize_answer(answer)
    R.answers_equivalent(answer, "9^{9^{9^{9^{8}}}}", math_verify=False)
    R.answers_equivalent(text, text[:-1], math_verify=False)
    R.majority_vote_rewards(R.extract_answers([text, text, "1", "1"]), 4)
    R.math_accuracy([text], answer=["1"])
    R.format_reward([text])
    assert time.perf_counter() - start < bound, name


def _c_level_hang():
    return 9 ** (9**9) > 0  # a single C-level big-integer power: signal-based timeouts cannot interrupt it


@pytest.mark.timeout(60)
def test_isolated_call_kills_a_hung_worker():
    """The math-verify backend's isolation: a computation stuck in C code is killed at the timeout, and the worker
    is replaced for the next call."""
    runner = R._IsolatedCall()
    try:
        start = time.perf_counter()
        assert runner(_c_level_hang, (), timeout=0.5) is None
        assert time.perf_counter() - start < 5.0
        assert runner(max, (3, 4), timeout=10.0) == 4
    finally:
        runner.close()


@pytest.mark.timeout(60)
def test_math_verify_backend_is_bounded_on_parser_bombs():
    if not R.math_verify_available():
        pytest.skip("math-verify is an optional extra (the isolation itself is tested above)")
    for bomb in (r"9^{9^{9^{9^{9}}}}", r"100000000!", r"\frac{" * 60 + "1" + "}{2}" * 60):
        start = time.perf_counter()
        assert R.answers_equivalent(bomb, bomb + "+1", math_verify=True, timeout=0.5) in (True, False)
        assert time.perf_counter() - start < 4.0, bomb
