"""Checks of the functional API's non-tensor arguments that the compiled ops cannot make:
the op schemas take a Python bool for a float or an int (True as 1.0)."""


def check_not_bool(op: str, **values) -> None:
    """Refuses a bool given for a number (eps=True would run as eps=1.0)."""
    for name, value in values.items():
        if isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a number, got the bool {value}")
