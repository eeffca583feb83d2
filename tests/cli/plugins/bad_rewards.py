"""Reward plugins that are wrong in the ways a user's can be (referenced as tests.cli.plugins.bad_rewards:<name>)."""

NOT_CALLABLE = 3.0


def raises(sample):
    raise ZeroDivisionError("the plugin divided by zero")


def returns_text(sample):
    return "correct"


def returns_nan(sample):
    return float("nan")


def two_arguments(sample, extra):
    return 1.0
