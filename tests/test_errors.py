"""The package's one config error (`trl_ppo_variants/errors.py`); the checks that raise it are tested with their
configs (tests/test_config_errors.py and each algorithm's tests)."""

import pytest

from trl_ppo_variants.errors import check, config_error


def test_config_error_names_the_field_what_was_expected_and_the_value_given():
    error = config_error("top_p", "a number in (0, 1]", 1.5)
    assert isinstance(error, ValueError) and str(error) == "top_p: expected a number in (0, 1], got 1.5"
    assert str(config_error("split", "'train' or 'test'", "dev")) == "split: expected 'train' or 'test', got 'dev'"


def test_check_raises_only_when_the_condition_fails():
    check(True, "n", "an integer >= 1", 3)
    check(1, "n", "an integer >= 1", 3)  # any truthy condition
    with pytest.raises(ValueError, match=r"^n: expected an integer >= 1, got 0$"):
        check(0 >= 1, "n", "an integer >= 1", 0)
    with pytest.raises(ValueError, match=r"^reward_funcs: expected a name, got None$"):
        check(None, "reward_funcs", "a name", None)
