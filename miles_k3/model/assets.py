"""The checkpoints shipped inside the package (miles_k3/assets/) and the `builtin:` paths that name them.

    builtin_path("builtin:k3-tiny-arith")           -> <package>/assets/k3-tiny-arith
    builtin_path("builtin:k3-tiny-steps/drafter")   -> <package>/assets/k3-tiny-steps/drafter
    builtin_path("/ckpt")                           -> "/ckpt" (any other value unchanged)

Every front door resolves a model, drafter or dataset path through `builtin_path`: `miles-train`'s model.path,
rollout.speculative.drafter and data paths, `miles-serve --model` / `--drafter`, `miles-k3 generate`.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_PREFIX = "builtin:"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


def builtin_path(value: str) -> str:
    """`builtin:<relative path>` -> a path inside the installed package's assets (other values unchanged)."""
    if value.startswith(BUILTIN_PREFIX):
        return str(ASSETS_DIR / value[len(BUILTIN_PREFIX) :])
    return value


def builtin_models() -> list[str]:
    """The embedded assets, as `builtin:<name>`, sorted (for the message that lists them)."""
    return [BUILTIN_PREFIX + name for name in sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir())]
