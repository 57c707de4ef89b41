"""A run's privacy state and files: accounting, randomness, released metrics, run folder."""
