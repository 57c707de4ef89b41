"""fedlap-privacy: differentially private federated learning you can audit.

The core package (data, models, checkpoints, ledger) plus four subpackages mapped from the
top-level folders: ``fedlap_privacy.accountant``, ``.fl``, ``.audit`` and ``.cli``.
This module imports nothing heavy (no torch), so ``fedlap_privacy.accountant`` stays light.
It sets the environment defaults torch reads when it loads (huge pages:
:mod:`fedlap_privacy.runtime_env`) where the user set none.
"""

from fedlap_privacy.errors import CheckpointError, ConfigError, DataError, FedlapError
from fedlap_privacy.runtime_env import apply_runtime_defaults

apply_runtime_defaults()

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "DataError", "FedlapError", "__version__"]
