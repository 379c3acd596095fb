"""Acting on a job: the steps the commands run (steps.py, preflight.py), how they run (context.py:
where a step acts and what it returns; runner.py: a plan of steps in order, halting at the first
failure), and what they stand on: where the job's files are (jobpaths.py), its recorded state
(jobstate.py), its lock, tmux, the launch line (launch.py, torchrun.py), releases (deploy.py), the
cache guard, the stop grace; multinode*.py drive one job across several targets."""
