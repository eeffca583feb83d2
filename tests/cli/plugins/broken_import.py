"""A reward plugin module whose import fails (a missing dependency of the user's)."""

import a_dependency_that_is_not_installed  # noqa: F401


def score(sample):
    return 1.0
