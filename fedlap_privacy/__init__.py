"""fedlap-privacy: differentially private federated learning you can audit.

The core package (data, models, checkpoints, ledger) plus four subpackages mapped from the
top-level folders: ``fedlap_privacy.accountant``, ``.fl``, ``.audit`` and ``.cli``.
This module imports nothing heavy (no torch), so ``fedlap_privacy.accountant`` stays light,
and changes nothing of the process (its environment among it): the package's own entry
points set torch's environment defaults (:mod:`fedlap_privacy.compute.runtime_env`).
"""

from fedlap_privacy.errors import CheckpointError, ConfigError, DataError, FedlapError

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "DataError", "FedlapError", "__version__"]
