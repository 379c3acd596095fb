"""The steps a playbook file may name, by name (the playbook engine and `dflash-ops playbooks` read it)."""

from __future__ import annotations

from dflash_ops.act.preflight import preflight, require_job_stopped
from dflash_ops.act.steps import (
    deploy,
    kill_gpu_processes,
    launch,
    mark_stopped,
    purge_cache,
    rollback,
    stop_session,
    wait_first_step,
    wait_gpu_free,
)

LIBRARY = {
    step.__name__: step
    for step in (
        preflight,
        require_job_stopped,
        stop_session,
        mark_stopped,
        kill_gpu_processes,
        wait_gpu_free,
        purge_cache,
        deploy,
        launch,
        wait_first_step,
        rollback,
    )
}
