"""Acting on a job: the steps the commands run (steps.py, preflight.py, both over processes.py: the
job's processes, the GPUs, the cache as the target sees them; library.py names those a playbook
may use), how they run (context.py: where a step acts and what it returns; runner.py: a plan of
steps in order, halting at the first failure), the launch (launch.py), releases (deploy.py), the
stop grace; a job's nodes (nodes.py: a step on every node of a job, a target being the one-node
job), the phases of a whole job (phases.py) and the checks across nodes (multinode_checks.py).
What the job is on its target is dflash_ops.job's."""
