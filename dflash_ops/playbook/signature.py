"""What a step takes, from its signature: literal parameters, the Job, and earlier steps' results."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Any, Callable, Mapping

from dflash_ops.job.model import Job
from dflash_ops.act.context import StepOutcome


@dataclasses.dataclass(frozen=True)
class Inputs:
    literals: Mapping[str, Any]  # parameter -> annotation
    job: str | None  # the parameter that takes the Job
    results: Mapping[str, type]  # parameter -> the StepOutcome subclass it takes
    defaults: Mapping[str, Any]  # of the parameters that have one
    gives: type | None  # the StepOutcome subclass the step returns

    @property
    def required(self) -> set[str]:
        return {*self.literals, *self.results} - set(self.defaults)


@functools.lru_cache(maxsize=None)
def inputs_of(step: Callable[..., Any]) -> Inputs:
    hints = typing.get_type_hints(step)
    literals, results, job, defaults = {}, {}, None, {}
    for p in list(inspect.signature(step).parameters.values())[1:]:  # after ctx
        hint = hints.get(p.name, Any)
        if hint is Job:
            job = p.name
        elif result_type(hint) is not None:
            results[p.name] = result_type(hint)
        else:
            literals[p.name] = hint
        if p.default is not p.empty:
            defaults[p.name] = p.default
    return Inputs(literals, job, results, defaults, result_type(hints.get("return")))


def result_type(hint: Any) -> Any:
    """The StepOutcome subclass `hint` names (alone or `| None`), or None."""
    for t in typing.get_args(hint) or (hint,):
        if isinstance(t, type) and issubclass(t, StepOutcome) and t is not StepOutcome:
            return t
    return None


def describe(name: str, step: Callable[..., Any]) -> str:
    """`wait_first_step(timeout_s: float, poll_s: float = 1.0) takes Launched`, for listings."""
    info = inputs_of(step)
    shown = [
        f"{k}: {type_name(t)}" + (f" = {info.defaults[k]!r}" if k in info.defaults else "")
        for k, t in info.literals.items()
    ]
    takes = "".join(f" takes {t.__name__}" for t in info.results.values())
    return f"{name}({', '.join(shown)}){takes}" + (f" gives {info.gives.__name__}" if info.gives else "")


def fits(value: Any, hint: Any) -> bool:
    """Whether a literal value fits a parameter's annotation (an int does for a float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin in (list, dict) and args:
        items = value.values() if isinstance(value, dict) else value
        return isinstance(value, origin) and all(fits(v, args[-1]) for v in items)
    return isinstance(value, origin or hint)


def type_name(hint: Any) -> str:
    return hint.__name__ if hint in (bool, int, float, str) else str(hint).replace("typing.", "")
