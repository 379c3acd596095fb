"""GPU proof scripts (run directly; see README.md here)."""
