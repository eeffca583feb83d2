"""Finding a reward function from its reference and checking its signature.

A reference (RewardConfig.fn) is resolved in this order:
1. contains ":" -> "module.path:attribute" (the attribute may be dotted: "mod:Class.method");
2. a built-in name (see `builtin.BUILTINS`; these names are reserved);
3. a name in the `miles_k3.rewards` entry-point group of the installed distributions.
Every way of failing raises ValueError naming the reference, before any model is built.

`load_by_path` and `is_async` are shared with the trainer's rollout plugins (`rollout.fn`,
`miles_k3.trainer.rollout_plugin`): one loader for every "module.path:function" reference.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_k3.rewards.builtin import BUILTINS
from miles_k3.rewards.config import RewardConfig
from miles_k3.rewards.remote import RemoteReward

ENTRY_POINT_GROUP = "miles_k3.rewards"
BATCHED_ATTR = "__reward_batched__"


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward function as batched: it takes list[Sample] and returns one reward per sample,
    in order. Returns fn itself (no wrapper), so async-ness and signature stay inspectable.
    A callable class can instead set the class attribute `__reward_batched__ = True`."""
    setattr(fn, BATCHED_ATTR, True)
    return fn


@dataclass(frozen=True)
class RewardPlugin:
    """A resolved reward function and how to call it.

    timeout_s is the deadline of one call. It is RewardConfig.timeout_s, except for the remote
    reward, whose call may span several requests and backoffs (its own worst case).
    """

    name: str
    fn: Callable[..., Any]
    batched: bool
    is_async: bool
    timeout_s: float


def load_plugin(config: RewardConfig) -> RewardPlugin:
    """Resolve config.fn and check that it can be called as a reward function."""
    ref = config.fn
    if ":" in ref:
        fn = load_by_path(ref)
    elif ref in BUILTINS:
        fn = BUILTINS[ref](config)
    else:
        fn = _load_entry_point(ref)
    return as_plugin(fn, config, name=ref)


def as_plugin(fn: Callable[..., Any], config: RewardConfig, *, name: str | None = None) -> RewardPlugin:
    """Wrap an already-imported callable (tests, or a trainer that builds its own reward)."""
    name = name or getattr(fn, "__qualname__", None) or repr(fn)
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable (it is a {type(fn).__name__})")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(f"reward function {name!r} is a generator; it must return its reward(s)")
    _check_signature(fn, name)
    timeout_s = fn.call_timeout_s if isinstance(fn, RemoteReward) else config.timeout_s
    return RewardPlugin(
        name=name,
        fn=fn,
        batched=getattr(fn, BATCHED_ATTR, False) is True,
        is_async=is_async(fn),
        timeout_s=timeout_s,
    )


def known_names() -> list[str]:
    """Built-in names, then installed entry-point names (sorted, deduplicated)."""
    return sorted(BUILTINS) + sorted(set(_entry_points()) - set(BUILTINS))


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling fn returns an awaitable (an async function, partial of one, or async __call__)."""
    # iscoroutinefunction sees through functools.partial; a callable instance is async when its
    # __call__ is.
    if inspect.iscoroutinefunction(fn):
        return True
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isclass(fn)):
        return inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return False


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C callables have no signature; the call itself will tell
    try:
        signature.bind(object())
    except TypeError:
        raise ValueError(
            f"reward function {name!r} must accept exactly one positional argument "
            f"(a Sample, or list[Sample] when @batched); its signature is {signature}"
        ) from None


def load_by_path(ref: str, what: str = "reward function") -> Callable[..., Any]:
    """The callable a "module.path:attribute" reference names; ValueError starting with `what` and the
    reference for a malformed reference, a module that is missing or fails to import, a missing attribute
    or one that is not callable."""
    module_name, _, attr_path = ref.partition(":")
    well_formed = (
        module_name
        and attr_path
        and all(part.isidentifier() for part in module_name.split("."))
        and all(part.isidentifier() for part in attr_path.split("."))
    )
    if not well_formed:
        raise ValueError(
            f"{what} reference {ref!r} is malformed: expected 'module.path:function', e.g. 'my_project.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Distinguish "the plugin's module does not exist" from "it exists but imports something missing".
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(
                f"{what} {ref!r}: module {module_name!r} not found (is it installed or on sys.path?)"
            ) from exc
        raise ValueError(f"{what} {ref!r}: importing {module_name!r} failed: {exc}") from exc
    except (Exception, SystemExit) as exc:  # SystemExit: a module that calls sys.exit() on import
        raise ValueError(f"{what} {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {ref!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} {ref!r} is not callable (it is a {type(obj).__name__})")
    return obj


def _entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    # Looked up through the module attribute on every call so that tests can monkeypatch it.
    by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        same = by_name.setdefault(ep.name, [])
        if all(other.value != ep.value for other in same):  # one package seen twice (e.g. editable + site)
            same.append(ep)
    return by_name


def _load_entry_point(ref: str) -> Callable[..., Any]:
    eps = _entry_points()
    if ref not in eps:
        hint = ""
        if "." in ref:
            module_name, _, attr = ref.rpartition(".")
            suggestion = f"{module_name}:{attr}"
            hint = f"; to load a function by path write 'module.path:function' (did you mean {suggestion!r}?)"
        known = sorted(BUILTINS) + sorted(set(eps) - set(BUILTINS))
        raise ValueError(
            f"unknown reward function {ref!r}: not a built-in and not in the {ENTRY_POINT_GROUP!r} "
            f"entry-point group; known names: {', '.join(known)}{hint}"
        )
    candidates = eps[ref]
    if len(candidates) > 1:
        values = ", ".join(ep.value for ep in candidates)
        raise ValueError(f"reward function {ref!r} is ambiguous: several entry points use that name ({values})")
    (ep,) = candidates
    try:
        fn = ep.load()
    except Exception as exc:
        raise ValueError(
            f"reward function {ref!r}: entry point {ep.value!r} failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(fn):
        raise ValueError(f"reward function {ref!r} (entry point {ep.value!r}) is not callable")
    return fn
