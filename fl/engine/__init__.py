"""The drivers: the in-process simulator, the Flower driver, sampling, cohorts, compare."""
