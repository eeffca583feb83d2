"""How a schema section is typed and checked: `Section`, `component_fields`, `Check`.

A section that configures a component takes the component's fields, types and defaults through
`component_fields` (written once, in the component, which checks them when it is built). A section of
the trainer's own declares its fields and checks them in `Section.check`, with `Check`'s rules, whose
messages start with the field's name (`resolve` puts the section in front).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import typing
from dataclasses import field, make_dataclass
from typing import Any


class Section:
    """A schema section. `check` raises ValueError("<field> <rule>, got <value>") for a value that is wrong
    on its own; `resolve` prefixes the section."""

    def check(self) -> None:
        pass

    def values(self, names: tuple[str, ...] | None = None) -> dict[str, Any]:
        """This section's values (those of `names`), as keyword arguments for a component."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if names is None or f.name in names}


def component_fields(component: type, names: tuple[str, ...] | None = None) -> type:
    """A mutable dataclass (a Section) holding `component`'s fields, or those in `names`, with the component's
    types and defaults: the schema node Hydra fills. A field without a default is mandatory (`???` until a
    recipe sets it). The frozen component cannot be the node itself: OmegaConf makes a frozen dataclass's
    node read-only, and no recipe or override could then be merged into it."""
    hints = typing.get_type_hints(component)
    specs = []
    for f in dataclasses.fields(component):
        if names is not None and f.name not in names:
            continue
        if f.default is not dataclasses.MISSING:
            default = field(default=f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        else:
            default = field(default="???")  # OmegaConf's MISSING
        specs.append((f.name, _schema_type(hints[f.name]), default))
    unknown = set(names or ()) - {name for name, _, _ in specs}
    if unknown:
        raise TypeError(f"{component.__name__} has no field(s) {sorted(unknown)}")
    return make_dataclass(f"{component.__name__}Fields", specs, bases=(Section,))


def field_names(component: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(component))


def _schema_type(t: Any) -> Any:
    # OmegaConf types dict values but not the abstract Mapping (RewardConfig.headers)
    if typing.get_origin(t) is collections.abc.Mapping:
        return dict[typing.get_args(t)]
    return t


class Check:
    """Value rules for one section's fields; each failure names the field and the value."""

    def __init__(self, obj: Any):
        self.obj = obj

    def fail(self, name: str, rule: str) -> ValueError:
        return ValueError(f"{name} {rule}, got {getattr(self.obj, name)!r}")

    def int_at_least(self, name: str, low: int) -> None:
        v = getattr(self.obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self.fail(name, f"must be an integer >= {low}")

    def number(self, name: str, low: float | None = None, high: float | None = None, *, open_low: bool = False) -> None:
        v = getattr(self.obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(name, "must be a finite number")
        if low is not None and (v < low or (open_low and v == low)):
            raise self.fail(name, f"must be {'>' if open_low else '>='} {low}")
        if high is not None and v > high:
            raise self.fail(name, f"must be <= {high}")

    def choice(self, name: str, options: tuple[str, ...]) -> None:
        if getattr(self.obj, name) not in options:
            raise self.fail(name, f"must be one of {options}")
