"""Privacy accounting for FedLAP-DP (docs/accounting.md). Needs only numpy and scipy.

Mechanism assumed everywhere: Poisson sampling of records, per-record L2 clipping to C,
Gaussian noise N(0, sigma^2 C^2) added to the sum, add/remove-one neighbouring datasets.

>>> from fedlap_privacy.accountant import FedLAPSchedule, epsilon
>>> s = FedLAPSchedule(batch_size=256, client_size=10000, local_steps=200)
>>> round(epsilon(s, sigma=1.0, rounds=15, delta=1e-5), 2)
10.18
"""

from fedlap_privacy.accountant.accountants import (
    Accountant,
    AccountantName,
    PLDAccountant,
    RDPAccountant,
)
from fedlap_privacy.accountant.distributed import (
    DistributedMechanism,
    DistributedNoise,
    DistributedPlan,
    distributed_epsilon,
    plan_distributed,
)
from fedlap_privacy.accountant.planning import (
    composed_epsilon,
    epsilon,
    epsilon_curve,
    plan_rounds,
    plan_sigma,
    rdp_epsilon,
)
from fedlap_privacy.accountant.rdp import DEFAULT_ORDERS, EXTENDED_ORDERS, rdp_to_epsilon, sgm_rdp
from fedlap_privacy.accountant.registry import (
    accountant_names,
    get_accountant,
    register_accountant,
)
from fedlap_privacy.accountant.schedule import FedLAPSchedule, RoundRates

__all__ = [
    "DEFAULT_ORDERS",
    "EXTENDED_ORDERS",
    "Accountant",
    "AccountantName",
    "DistributedMechanism",
    "DistributedNoise",
    "DistributedPlan",
    "FedLAPSchedule",
    "PLDAccountant",
    "RDPAccountant",
    "RoundRates",
    "accountant_names",
    "composed_epsilon",
    "distributed_epsilon",
    "epsilon",
    "epsilon_curve",
    "get_accountant",
    "plan_distributed",
    "plan_rounds",
    "plan_sigma",
    "rdp_epsilon",
    "rdp_to_epsilon",
    "register_accountant",
    "sgm_rdp",
]
