"""The root `dflash-ops` group, its context object, and what every command module shares."""

from __future__ import annotations

import dataclasses
import functools

import click

from dflash_ops.inventory import load as inventory_lib
from dflash_ops.errors import InputError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
TARGET_ENV_VAR = "DFLASH_OPS_TARGET"
TARGET_HELP = "Target or group from the inventory (default: the inventory's default_target, else `local`)."


@dataclasses.dataclass
class Obj:
    inventory_path: str | None
    playbook_dir: str | None
    target: str | None = None  # -t before the subcommand, or $DFLASH_OPS_TARGET
    target_from_env: bool = False

    @functools.cached_property
    def inventory(self):
        return inventory_lib.load_inventory(self.inventory_path)

    def targets(self, name):
        return self.inventory.resolve(name)

    def search_dirs(self):
        from dflash_ops.playbook import user

        return user.search_dirs(self.playbook_dir, self.inventory.source)


def _merge_target(ctx, param, value):
    """-t/--target before or after the subcommand is one option (both: the same name); beats the env var."""
    obj = ctx.find_object(Obj)
    root = None if obj is None else obj.target
    if value is None:
        return root
    if root is not None and root != value and not obj.target_from_env:
        raise click.BadParameter(f"{value!r} here but {root!r} before the subcommand; give the target once")
    return value


def target_option(f):
    return click.option(
        "-t", "--target", default=None, metavar="NAME|GROUP", callback=_merge_target, help=TARGET_HELP
    )(f)


@click.group(context_settings=CONTEXT)
@click.option(
    "--inventory",
    "inventory_path",
    envvar=inventory_lib.ENV_VAR,
    metavar="PATH",
    help=f"Inventory file (default: ${inventory_lib.ENV_VAR}, ./inventory.yaml, "
    "~/.config/dflash-ops/inventory.yaml, else only the built-in `local` target).",
)
@click.option(
    "--playbook-dir",
    envvar="DFLASH_OPS_PLAYBOOKS",
    metavar="DIR",
    help="Directory searched first for your playbooks (then playbooks/ next to the inventory).",
)
@click.option("-t", "--target", "target", envvar=TARGET_ENV_VAR, metavar="NAME|GROUP", help=TARGET_HELP)
@click.version_option(package_name="dflash-ops")
@click.pass_context
def cli(ctx, inventory_path, playbook_dir, target):
    """Run and babysit DFlash drafter training on a GPU box: local, over ssh, or in a Proxmox
    LXC container (ssh to the host, then `pct exec`).

    -t/--target works before or after the subcommand (`dflash-ops -t gpu-box status` is
    `dflash-ops status -t gpu-box`)."""
    from_env = ctx.get_parameter_source("target") == click.core.ParameterSource.ENVIRONMENT
    ctx.obj = Obj(inventory_path, playbook_dir, target, from_env)


def acting_options(f):
    """-t and --dry-run, which every command that acts on a job takes first."""
    dry_run = click.option("--dry-run", is_flag=True, help="Print every exact remote command; touch nothing.")
    return target_option(dry_run(f))


def command_flag(flag: str, option: str, value: bool, help_text: str):
    """A flag setting the command's `option` to `value`; left out, None: the command's own default holds."""
    return click.option(flag, option, flag_value=value, default=None, help=help_text)


def grace_option(help_text: str):
    """--grace S: seconds between the polite stop signal and the kill."""
    return click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="S", help=help_text)


def answer_within_option(default_s: float, help_text: str):
    """--timeout S of the commands that must answer in time (status, health)."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=1),
        default=default_s,
        show_default=True,
        metavar="S",
        help=help_text,
    )


def one_target(obj: Obj, target):
    targets = obj.targets(target)
    if len(targets) != 1:
        raise InputError(f"--target {target}: this command needs one target, not a group of {len(targets)}")
    return targets[0]


def node_or_target(obj: Obj, target, node: str | None):
    """A multinode job's node (`--node`, default 0) or the one target, for commands reading one machine."""
    job = obj.inventory.multinode.get(target) if target is not None else None
    if job is not None:
        return job.node_named(node)
    if node is not None:
        raise InputError(
            f"--node {node}: applies to a multinode job (-t JOB); {target or 'the default target'} is not one"
        )
    return one_target(obj, target)
