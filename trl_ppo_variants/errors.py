"""The package's one config error, `ValueError("field: expected ..., got ...")`: one line that names the field, what
was expected and what was given (the value's repr). Every check of a config field, a constructor argument or a
function's argument raises it through `check` (or `config_error` where the raise is unconditional). No imports, so
that any module can use it.
"""

from __future__ import annotations


def config_error(field_name: str, expected: str, value) -> ValueError:
    """The one-line error for `field_name`, which expected `expected` and got `value`."""
    return ValueError(f"{field_name}: expected {expected}, got {value!r}")


def check(condition, field_name: str, expected: str, value) -> None:
    """Unless `condition` holds, raise `config_error(field_name, expected, value)`."""
    if not condition:
        raise config_error(field_name, expected, value)
