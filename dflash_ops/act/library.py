"""The steps a playbook file may name, by name (the playbook engine and `dflash-ops playbooks` read it)."""

from __future__ import annotations

from dflash_ops.act import preflight as p, steps as s

LIBRARY = {
    step.__name__: step
    for step in (
        p.preflight,
        p.require_job_stopped,
        s.stop_session,
        s.mark_stopped,
        s.kill_gpu_processes,
        s.wait_gpu_free,
        s.purge_cache,
        s.deploy,
        s.launch,
        s.wait_first_step,
        s.rollback,
    )
}
