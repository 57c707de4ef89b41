"""What a run with canaries keeps in its private state, read by training and by the audit.

Plain tensors only (so ``private.pt`` stays loadable with ``weights_only``). The meaning of
each field, per kind of canary (``fedlap_privacy.fl.auditing.canaries`` inserts them, the audit in
``fedlap_privacy.audit.canaries.canary_audit`` scores them):

* every kind: ``included`` — the secret coins S_i (each canary in with probability 1/2);
  ``client`` — the client each canary belongs to (public);
* ``white-box``: ``coordinates`` — each Dirac canary's flat weight index, or, when
  ``dedicated``, its index in the dedicated canary block appended to every release (a block
  of ``size`` coordinates no real record's gradient reaches, ``fedlap_privacy.fl.methods.dp``);
  ``scores`` — the sum, over every release of its client, of the released noisy sum on that
  coordinate, in units of the clipping bound C;
* ``black-box``: ``images`` / ``labels`` — the canary records;
* ``clients``: ``direction_seed`` and ``dimension`` — each canary client's unit update
  direction is derived from them (:meth:`CanaryState.direction`: public, so only the seed is
  kept, not an m x d matrix); ``cosines`` — per round, the cosine of every direction with
  that round's model change;
  ``total_delta`` — the model's change over all rounds (the final-model statistic).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from fedlap_privacy.errors import CheckpointError
from fedlap_privacy.vocabulary import CanaryKind, words

if TYPE_CHECKING:  # importing this module must not load torch
    from torch import Tensor

__all__ = ["MIN_AUDIT_CANARIES", "CanaryState"]

#: the fewest canaries the one-run audit ranks (Steinke, Nasr and Jagielski 2023; the
#: ``audit`` of a run, :func:`fedlap_privacy.audit.bounds.one_run.one_run_audit`): its guesses
#: order the canaries by score, which takes two; ``train`` refuses a count between 0 (no
#: canaries) and this one, which it could insert but no audit could use
MIN_AUDIT_CANARIES = 2


@dataclass
class CanaryState:
    """A run's canaries and what was observed of them (module docstring)."""

    kind: str
    included: Tensor
    client: Tensor
    coordinates: Tensor | None = None
    scores: Tensor | None = None
    images: Tensor | None = None
    labels: Tensor | None = None
    direction_seed: int | None = None
    dimension: int | None = None
    cosines: list[Tensor] = field(default_factory=list)
    total_delta: Tensor | None = None
    dedicated: bool = False

    @property
    def size(self) -> int:
        return len(self.included)

    def direction(self, j: int) -> Tensor:
        """Canary client j's unit direction in R^dimension (float64), from its own seed."""
        import torch

        assert self.direction_seed is not None and self.dimension is not None
        gen = torch.Generator().manual_seed((self.direction_seed + j) % 2**63)
        z = torch.randn(self.dimension, generator=gen, dtype=torch.float64)
        return z / z.norm()

    def cosines_with(self, vector: Tensor) -> Tensor:
        """The cosine of every canary client's direction with ``vector`` (0 for a zero one)."""
        import torch

        v = vector.detach().double().cpu()
        norm = float(v.norm())
        if norm == 0:
            return torch.zeros(self.size, dtype=torch.float64)
        return torch.stack([self.direction(j) @ v for j in range(self.size)]) / norm

    def to_state(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    @classmethod
    def from_state(cls, state: Any) -> CanaryState:
        """Read back :meth:`to_state`, refusing a malformed one (one line)."""
        import torch
        from torch import Tensor

        names = {f.name for f in fields(cls)}
        if not isinstance(state, dict) or not set(state) <= names:
            raise CheckpointError("the run's canary state is malformed")
        try:
            out = cls(**state)
        except TypeError as exc:
            raise CheckpointError(f"the run's canary state is malformed ({exc})") from None
        ok = (
            out.kind in words(CanaryKind)
            and isinstance(out.included, Tensor) and out.included.dtype == torch.bool
            and isinstance(out.client, Tensor) and out.client.shape == out.included.shape
            and (out.kind != CanaryKind.WHITE_BOX or out.scores is not None)
            and (out.kind != CanaryKind.BLACK_BOX
                 or (out.images is not None and out.labels is not None))
            and (out.kind != CanaryKind.CLIENTS
                 or (out.direction_seed is not None and out.dimension is not None))
        )
        if not ok:
            raise CheckpointError("the run's canary state is malformed")
        return out
