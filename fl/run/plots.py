"""PNG plots of a run's history: test accuracy and epsilon per round."""

from __future__ import annotations

from pathlib import Path

from fedlap_privacy.fl.run.run_records import RoundRecord
from fedlap_privacy.state.atomic import write_figure


def plot_history(history: list[RoundRecord], out: Path) -> list[Path]:
    """Write ``accuracy.png`` and ``epsilon.png`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h.round for h in history]
    paths = []
    for values, name, label in (
        ([h.test_accuracy for h in history], "accuracy.png", "test accuracy"),
        ([h.epsilon for h in history], "epsilon.png", "epsilon spent"),
    ):
        if not values or any(v is None for v in values):
            continue
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(rounds, values, marker="o")
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / name
        write_figure(fig, path)
        plt.close(fig)
        paths.append(path)
    return paths
