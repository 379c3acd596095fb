"""The inventory: where jobs run, how to reach them, and the job each runs."""
