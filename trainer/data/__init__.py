"""Data: sequences, the target that turns them into features, regeneration and the feature cache."""
