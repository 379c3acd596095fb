"""preflight reports the Gated DeltaNet kernels the job's python has (a hybrid target's fast or slow path)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from dflash_ops.act import preflight
from dflash_ops.transport.local import LocalTransport


def python_with(tmp_path, packages: dict[str, str]):
    """A job python that sees fake installed distributions (metadata only) beside the real ones."""
    site = tmp_path / "site"
    for name, version in packages.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return str(python)


@pytest.mark.parametrize(
    "packages, answer, says",
    [
        ({}, "none, causal-conv1d none", "slow PyTorch fallback; pip install 'dflash-ops[kernels]'"),
        ({"flash-linear-attention": "0.6.0"}, "fla 0.6.0, causal-conv1d none", "runs fla kernels"),
        (
            {"flash-linear-attention": "0.6.0", "causal-conv1d": "1.7.0"},
            "fla 0.6.0, causal-conv1d 1.7.0",
            "runs fla",
        ),
    ],
)
def test_preflight_names_the_kernel_packages_and_the_path(local_target, tmp_path, packages, answer, says):
    job = dataclasses.replace(
        local_target.job, workdir=str(tmp_path / "work"), python=python_with(tmp_path, packages)
    )
    with LocalTransport("local") as t:
        found = preflight._answers(
            t.check(preflight._shell_checks(job, need_release=False, import_torch=False)).stdout
        )
    assert found["gdn_kernels"] == answer
    assert says in preflight.gdn_kernels_phrase(found["gdn_kernels"])


def test_a_python_that_cannot_run_gives_no_kernel_answer(local_target, tmp_path):
    job = dataclasses.replace(
        local_target.job, workdir=str(tmp_path / "work"), python=str(tmp_path / "absent")
    )
    with LocalTransport("local") as t:
        found = preflight._answers(
            t.check(preflight._shell_checks(job, need_release=False, import_torch=False)).stdout
        )
    assert "gdn_kernels" not in found and found["python_error"] == "not installed"
