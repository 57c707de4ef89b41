"""The privacy vocabulary: every word a guarantee is stated in, defined once.

Torch-free and importing nothing of the package, so that every layer can use it, the
accountant included (docs/architecture.md). Each word is a :class:`~enum.StrEnum`: a member
equals its text (``ThreatModel.SERVER == "server"``) and JSON writes it as that text, so
records and outputs hold the same words as before. What stays in files (checkpoints,
ledgers) is the plain text (``.value``): ``torch.load(weights_only=True)`` reads no enums.

* :class:`Notion`: what an epsilon protects (one record, a client's whole dataset, each
  uploaded weight, nothing).
* :class:`ThreatModel`: whom an epsilon holds against (docs/threat-model.md).
* :data:`NOTION_THREAT_MODELS`: the threat models each notion's epsilon can hold for.
* :class:`NoiseKind`: whether a run's DP randomness was secret.
* :class:`CanaryKind`: the canaries a one-run audit inserts (docs/audit.md).
* :data:`LARGE_EPSILON`: the epsilon above which ``plan``, ``train`` and a dry run warn.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "LARGE_EPSILON", "NOTION_THREAT_MODELS", "SMALL_CLIENT_RATE", "CanaryCoordinates",
    "CanaryKind", "NoiseKind", "Notion", "ThreatModel", "words",
]

#: an epsilon above this is flagged as promising little: DP training is usually reported and
#: deployed at or below it, and above it the bound on an attacker's odds (e^epsilon, over
#: 22,000 at 10) is loose
LARGE_EPSILON = 10.0
#: a per-access sampling rate B / N_k at or above this is "few records per client for the
#: batch": the reason a large epsilon's warning gives
SMALL_CLIENT_RATE = 0.1


def words(kind: type[StrEnum]) -> tuple[str, ...]:
    """The words of ``kind`` as plain text, in their order (choices, error messages)."""
    return tuple(member.value for member in kind)


class Notion(StrEnum):
    """What an epsilon protects.

    ``record-level``: (epsilon, delta)-DP for one record, composing Theorem 5.8 rounds
    (Wang et al. 2024, FedLAP-DP); ``client-level``: (epsilon, delta)-DP for a client's whole
    dataset, one SGM over clients per round; ``local``: pure epsilon-LDP of each uploaded
    weight per round; ``none``: no formal privacy.
    """

    RECORD = "record-level"
    CLIENT = "client-level"
    LOCAL = "local"
    NONE = "none"

    @property
    def gaussian(self) -> bool:
        """Gaussian noise accounted as (epsilon, delta)-DP (record or client level)."""
        return self in (Notion.RECORD, Notion.CLIENT)


class ThreatModel(StrEnum):
    """Whom an epsilon holds against.

    ``server``: the server, which sees every upload and knows whom it selected (client
    sampling amplifies nothing); ``hidden-selection``: those who see the uploads or the
    models but not who was selected (Theorem 5.8 with its amplified ``q1``);
    ``trusted-server``: those who see the released models only (the server adds the noise).
    """

    SERVER = "server"
    HIDDEN_SELECTION = "hidden-selection"
    TRUSTED_SERVER = "trusted-server"

    @property
    def hides_selection(self) -> bool:
        """Whether the epsilon assumes the adversary does not know who was selected: the
        release then withholds the selection."""
        return self is not ThreatModel.SERVER


#: the threat models each notion's epsilon can hold for; the first is the default
NOTION_THREAT_MODELS: dict[Notion, tuple[ThreatModel, ...]] = {
    Notion.RECORD: (ThreatModel.SERVER, ThreatModel.HIDDEN_SELECTION),
    Notion.CLIENT: (ThreatModel.TRUSTED_SERVER,),
    Notion.LOCAL: (ThreatModel.SERVER,),
    Notion.NONE: (),
}


class NoiseKind(StrEnum):
    """``secret``: DP randomness seeded by the operating system; ``seeded``: derived from the
    run's seed (``--reproducible-noise``), so anyone with the seed can remove the noise: NOT
    private; ``none``: a non-private method (no noise)."""

    SECRET = "secret"
    SEEDED = "seeded"
    NONE = "none"


class CanaryKind(StrEnum):
    """``white-box``: Dirac gradient canaries, scored on the released noisy gradients;
    ``black-box``: canary records, scored by their loss under the final model; ``clients``:
    canary clients whose uploads are scored (client-level DP)."""

    WHITE_BOX = "white-box"
    BLACK_BOX = "black-box"
    CLIENTS = "clients"


class CanaryCoordinates(StrEnum):
    """Where white-box canaries live: on the model's own ``weights``, or in a ``dedicated``
    block appended to every release of the DP step (one coordinate per canary)."""

    WEIGHTS = "weights"
    DEDICATED = "dedicated"
