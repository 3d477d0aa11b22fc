"""`moeferry routing simulate --plot FILE`: the decode hit rate against the cache's size, one
curve per policy, as a PNG (matplotlib: `pip install 'moeferry[plot]'`)."""

from __future__ import annotations

import os


def plot_hit_rates(results: list, total_experts: int, out: str, title: str = "") -> None:
    """`results`: (CacheSize, policy, SimResult) of routing.simulate.report."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'moeferry[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[float, float]]] = {}
    for size, policy, result in results:
        rate = result.hit_rate("decode")
        if rate is not None:
            curves.setdefault(policy, []).append((100 * size.slots / total_experts, rate))
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=120)
    for policy, points in curves.items():
        points.sort()
        ax.plot([p for p, _ in points], [r for _, r in points], marker="o", label=policy)
    ax.set_xlabel("cache size (% of every MoE layer's experts)")
    ax.set_ylabel("decode hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
