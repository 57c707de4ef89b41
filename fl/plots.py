"""PNG plots of a run's history: test accuracy and epsilon per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedlap_privacy.atomic import write_figure


def plot_history(history: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write ``accuracy.png`` and ``epsilon.png`` into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [h["round"] for h in history]
    paths = []
    for key, name, label in (
        ("test_accuracy", "accuracy.png", "test accuracy"),
        ("epsilon", "epsilon.png", "epsilon spent"),
    ):
        values = [h[key] for h in history]
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
