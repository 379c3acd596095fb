"""Your own playbooks: YAML lists of library steps, checked before anything runs, run like the commands."""
