"""Member / non-member sets of the membership-inference audit (docs/audit.md#sets).

Protocol of the paper: the members are the training records of the clients (the union of
the checkpoint's ``client_indices``, indices into the dataset's train set); the non-members
are test records. The test set is cut into two disjoint halves. The *attack* half, paired
with as many training records, trains the attack model; the *audit* half, paired with as
many *other* training records, is the only data the reported metrics are computed on.

Every set is balanced by construction (equal numbers of members and non-members in each
half), the two halves share no record, and all draws come from one
``numpy.random.default_rng(seed)``. When there are fewer members than half the test set,
fewer test records are used (the sets stay balanced); ``max_per_half`` caps the size of
each of the four sets (to bound the audit's cost on large datasets).

One deviation from a literal reading, to avoid a confound: non-members are drawn only from
test records whose class occurs among the members. With the paper's split every class does,
so nothing changes; with a checkpoint whose members cover only some classes (e.g. one
non-IID client), an attack could otherwise "detect membership" by recognising the class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedlap_privacy.errors import CheckpointError, ConfigError

__all__ = ["MembershipSplit", "make_membership_split", "member_indices"]


def member_indices(client_indices: object, num_train: int) -> np.ndarray:
    """Sorted unique train-set indices held by the clients; checked to lie in ``[0, num_train)``.

    ``client_indices`` is the checkpoint's list of per-client index tensors (or arrays, or
    lists of ints). Anything else, an empty union or an index out of range is a
    :class:`CheckpointError` (the checkpoint does not match the dataset).
    """
    if not isinstance(client_indices, list | tuple) or not client_indices:
        raise CheckpointError("checkpoint split has no client_indices (a list per client)")
    parts = []
    for k, part in enumerate(client_indices):
        try:
            arr = np.asarray(part.numpy() if hasattr(part, "numpy") else part)
        except Exception:
            arr = np.asarray([], dtype=object)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise CheckpointError(
                f"checkpoint split: client_indices[{k}] is not a 1-D array of integers"
            )
        parts.append(arr.astype(np.int64))
    members = np.unique(np.concatenate(parts))
    if members.size == 0:
        raise CheckpointError("checkpoint split: the clients hold no training records")
    if members[0] < 0 or members[-1] >= num_train:
        bad = int(members[0] if members[0] < 0 else members[-1])
        raise CheckpointError(
            f"checkpoint split: member index {bad} is out of range for a train set of "
            f"{num_train} records (the checkpoint does not match this dataset)"
        )
    return members


@dataclass(frozen=True)
class MembershipSplit:
    """Four disjoint index sets: members index the train set, non-members the test set."""

    attack_members: np.ndarray
    attack_nonmembers: np.ndarray
    audit_members: np.ndarray
    audit_nonmembers: np.ndarray
    seed: int

    @property
    def per_half(self) -> int:
        """Records of each kind in each half (the four sets all have this size)."""
        return len(self.audit_members)

    def gather(
        self, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Stack the records of the four sets: ``(x, y, is_member, is_audit)``.

        Order: attack members, attack non-members, audit members, audit non-members.
        """
        x = np.concatenate(
            [
                x_train[self.attack_members],
                x_test[self.attack_nonmembers],
                x_train[self.audit_members],
                x_test[self.audit_nonmembers],
            ]
        )
        y = np.concatenate(
            [
                y_train[self.attack_members],
                y_test[self.attack_nonmembers],
                y_train[self.audit_members],
                y_test[self.audit_nonmembers],
            ]
        )
        n = self.per_half
        is_member = np.tile(np.repeat([True, False], n), 2)
        is_audit = np.repeat([False, True], 2 * n)
        return x, y, is_member, is_audit


def make_membership_split(
    members: np.ndarray,
    y_train: np.ndarray,
    y_test: np.ndarray,
    seed: int = 0,
    max_per_half: int | None = None,
) -> MembershipSplit:
    """Draw the balanced attack and audit sets of the paper's protocol (module docstring).

    ``members`` are train-set indices (see :func:`member_indices`). Each of the four sets
    gets ``n = min(|eligible test| // 2, |members| // 2, max_per_half)`` records.
    """
    if max_per_half is not None and max_per_half < 1:
        raise ConfigError(f"max_per_half must be a positive integer, got {max_per_half}")
    members = np.asarray(members, dtype=np.int64)
    classes = np.unique(np.asarray(y_train)[members])
    eligible = np.flatnonzero(np.isin(np.asarray(y_test), classes))
    n = min(len(eligible) // 2, len(members) // 2)
    if max_per_half is not None:
        n = min(n, max_per_half)
    if n < 1:
        raise ConfigError(
            f"too few records for a membership audit: {len(members)} members and "
            f"{len(eligible)} test records of the members' classes (need at least 2 of each)"
        )
    rng = np.random.default_rng(seed)
    test = rng.permutation(eligible)
    train = rng.permutation(members)
    return MembershipSplit(
        attack_members=np.sort(train[:n]),
        attack_nonmembers=np.sort(test[:n]),
        audit_members=np.sort(train[n : 2 * n]),
        audit_nonmembers=np.sort(test[n : 2 * n]),
        seed=seed,
    )
