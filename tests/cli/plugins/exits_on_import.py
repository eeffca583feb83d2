"""A reward plugin module that calls sys.exit(0) on import (a script turned into a module by mistake)."""

import sys

sys.exit(0)


def score(sample):
    return 1.0
