"""Playbooks: ordered step lists in YAML, validated as a whole before anything runs.

A playbook names steps from a `StepRegistry` (the step library lives elsewhere and is passed in),
gives each its parameters, and may make a step conditional on a run option. Parameters may
reference the target, its job, the run options and the outputs of earlier steps with
`{job.cache_dir}`- or `{steps.launch.log}`-style templates: a lookup of plain data fields, never an
evaluation; a value is substituted once and never re-parsed, so hostile text in the inventory
stays data. Parameters are a step's only input.

    description: Stop the job and free its GPUs
    options:
      grace: {type: float, default: 30, help: seconds between the stop signal and kill}
    steps:
      - step: stop_session
        params: {session: "{job.session}", grace_s: "{options.grace}"}
      - step: purge_cache
        when: options.purge          # or "not options.x", or true/false
        params: {paths: ["{job.cache_dir}"]}
      - deploy                       # a bare name: a step with default parameters
      - step: launch
        params: {session: "{job.session}", cache_dir: "{job.cache_dir}"}
      - step: wait_first_step
        params: {log: "{steps.launch.log}"}   # an earlier step's declared output

A step is `fn(ctx: StepContext, **params) -> StepOutcome | str | None`; it fails by raising a
`DflashOpsError` (e.g. RemoteCommandError, TransportError, StepFailed) or returning
`StepOutcome(ok=False)`. Under dry-run it gets `ctx.dry_run=True` and a transport that can only
describe commands: `ctx.run` records the exact command line and returns None.
"""

from __future__ import annotations

from ..errors import StepFailed
from .builtin import Loaded, load_builtin
from .binding import bind_options, parse_option_assignments, validate_playbook
from .document import Condition, OptionSpec, Playbook, StepEntry, parse_playbook
from .dry_run import DryRunTransport, DryRunViolation
from .registry import Param, StepRegistry, StepSpec
from .runner import (
    DRY_RUN,
    FAILED,
    NOT_RUN,
    OK,
    SKIPPED,
    PlaybookResult,
    Progress,
    StepContext,
    StepOutcome,
    StepReport,
    format_progress,
    plan_playbook,
    run_playbook,
)
from .search import ENV_PLAYBOOK_DIRS, SHIPPED_PLAYBOOKS, list_playbooks, load_playbook, playbook_search_dirs
from .templates import NAMESPACES, Ref, parse_template, render
from .typecheck import REQUIRED, type_name

__all__ = [
    "DRY_RUN",
    "ENV_PLAYBOOK_DIRS",
    "FAILED",
    "NAMESPACES",
    "NOT_RUN",
    "OK",
    "REQUIRED",
    "SHIPPED_PLAYBOOKS",
    "SKIPPED",
    "Condition",
    "DryRunTransport",
    "DryRunViolation",
    "OptionSpec",
    "Param",
    "Playbook",
    "PlaybookResult",
    "Progress",
    "Ref",
    "StepContext",
    "StepEntry",
    "StepFailed",
    "StepOutcome",
    "StepRegistry",
    "StepReport",
    "StepSpec",
    "Loaded",
    "bind_options",
    "load_builtin",
    "format_progress",
    "list_playbooks",
    "load_playbook",
    "parse_option_assignments",
    "parse_playbook",
    "parse_template",
    "plan_playbook",
    "playbook_search_dirs",
    "render",
    "run_playbook",
    "type_name",
    "validate_playbook",
]
