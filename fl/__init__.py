"""Federated training: FedLAP / FedLAP-DP, DP-FedAvg / DP-FedProx / FedAvg (SPEC 2-3).

>>> from fedlap_privacy.fl import TrainConfig, train
>>> result = train(TrainConfig(), "runs/example")   # FedLAP-DP on digits
"""

from fedlap_privacy.fl.config import METHODS, PRESETS, TrainConfig
from fedlap_privacy.fl.simulation import TrainResult, resume, train

__all__ = ["METHODS", "PRESETS", "TrainConfig", "TrainResult", "resume", "train"]
