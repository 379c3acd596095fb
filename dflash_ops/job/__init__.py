"""The job itself: what it is, where its files are on the target, its state, lock, session and launch."""
