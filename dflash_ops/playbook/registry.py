"""The step registry: step names -> functions with their declared, typed parameters."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from typing import Any, Callable, Mapping

from .typecheck import REQUIRED, Mismatch, conform, is_supported_type, type_name


@dataclasses.dataclass(frozen=True)
class Param:
    """One declared step parameter. `default=REQUIRED` means the playbook must give it."""

    type: Any
    default: Any = REQUIRED
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclasses.dataclass(frozen=True)
class StepSpec:
    name: str
    fn: Callable[..., Any]
    params: Mapping[str, Param]
    doc: str = ""
    # What a successful run returns in StepOutcome.data for later steps: `{steps.NAME.KEY}`.
    outputs: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def signature(self) -> str:
        """`launch(session: str, resume: bool = True) -> log: str`, for listings."""
        parts = [
            f"{k}: {type_name(p.type)}" + ("" if p.required else f" = {p.default!r}")
            for k, p in self.params.items()
        ]
        gives = ", ".join(f"{k}: {type_name(t)}" for k, t in self.outputs.items())
        return f"{self.name}({', '.join(parts)})" + (f" -> {gives}" if gives else "")


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class StepRegistry:
    """Step names -> functions plus their declared parameters, so playbooks can be checked.

        registry = StepRegistry()

        @registry.step("wait_gpu_free", params={"gpus": list[int], "timeout_s": (float, 120.0)})
        def wait_gpu_free(ctx, gpus, timeout_s): ...

    A parameter is declared as a type (required), `(type, default)` or `Param(type, default, help)`.
    `outputs={"log": str}` declares what the step returns in StepOutcome.data for later steps to
    read as `{steps.launch.log}`; a successful run (a dry run too) must return every one of them.
    Parameters are a step's only input: it reads earlier steps' outputs through them, never directly.
    """

    def __init__(self) -> None:
        self._steps: dict[str, StepSpec] = {}

    def step(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        doc: str | None = None,
        outputs: Mapping[str, Any] | None = None,
    ):
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(name, fn, params, doc, outputs)
            return fn

        return register

    def add(
        self,
        name: str,
        fn: Callable[..., Any],
        params: Mapping[str, Any] | None = None,
        doc: str | None = None,
        outputs: Mapping[str, Any] | None = None,
    ) -> StepSpec:
        # Mistakes here are programming errors in the step library: fail loudly at import time.
        if not IDENTIFIER.match(name):
            raise ValueError(f"step name {name!r} must be an identifier")
        if name in self._steps:
            raise ValueError(f"step {name!r} is registered twice")
        declared = {key: _as_param(name, key, spec) for key, spec in (params or {}).items()}
        try:
            inspect.signature(fn).bind(None, **{key: None for key in declared})
        except TypeError as e:
            raise ValueError(
                f"step {name!r}: function {fn.__name__} does not match its declared "
                f"parameters {sorted(declared)}: {e}"
            ) from None
        for key, typ in (outputs or {}).items():
            if not IDENTIFIER.match(key) or not is_supported_type(typ):
                raise ValueError(f"step {name!r} output {key!r}: give an identifier and a supported type")
        spec = StepSpec(
            name,
            fn,
            types.MappingProxyType(declared),
            doc if doc is not None else inspect.getdoc(fn) or "",
            types.MappingProxyType(dict(outputs or {})),
        )
        self._steps[name] = spec
        return spec

    def get(self, name: str) -> StepSpec | None:
        return self._steps.get(name)

    def names(self) -> list[str]:
        return list(self._steps)

    def __contains__(self, name: object) -> bool:
        return name in self._steps

    def __iter__(self):
        return iter(self._steps.values())

    def __len__(self) -> int:
        return len(self._steps)


def _as_param(step: str, key: str, spec: Any) -> Param:
    if isinstance(spec, Param):
        param = spec
    elif isinstance(spec, tuple) and len(spec) == 2:
        param = Param(spec[0], spec[1])
    else:
        param = Param(spec)
    if not is_supported_type(param.type):
        raise ValueError(f"step {step!r} parameter {key!r}: unsupported type {param.type!r}")
    if not param.required:
        try:
            conform(param.default, param.type)
        except Mismatch as e:
            raise ValueError(f"step {step!r} parameter {key!r}: default {e}") from None
    return param
