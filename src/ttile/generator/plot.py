"""Fig. 7-style heatmaps of a microkernel table (needs the ``plot`` extra: matplotlib)."""
from __future__ import annotations

from pathlib import Path

from .microkernels import MicrokernelTable


def plot_microkernels(table: MicrokernelTable, path: Path) -> Path:
    """One heatmap per unrolling scheme: alpha (k vectors) across, beta down, colour = %
    of peak (better of the h and w variants), selected microkernels outlined in red."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'ttile[plot]'") from exc

    families = sorted({m.shape.family for m in table.measurements})
    best: dict[tuple, float] = {}
    for m in table.measurements:
        if m.status == "ok":
            key = (m.shape.family, m.shape.alpha, m.shape.beta)
            best[key] = max(best.get(key, 0.0), m.percent_of_peak)
    selected = {(c.unroll_r, c.unroll_s, c.alpha, beta)
                for c in table.classes for beta in range(c.beta_min, c.beta_max + 1)}
    max_alpha = max(k[1] for k in best)
    max_beta = max(k[2] for k in best)

    cols = min(4, len(families))
    rows = -(-len(families) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.6 * rows), squeeze=False)
    image = None
    for ax, family in zip(axes.flat, families):
        grid = [[float("nan")] * max_alpha for _ in range(max_beta)]
        for (fam, alpha, beta), value in best.items():
            if fam == family:
                grid[beta - 1][alpha - 1] = value
        image = ax.imshow(grid, origin="lower", vmin=0, vmax=100, cmap="viridis",
                          extent=(0.5, max_alpha + 0.5, 0.5, max_beta + 0.5), aspect="auto")
        for (r, s, alpha, beta) in selected:
            if (r, s) == family:
                ax.add_patch(Rectangle((alpha - 0.5, beta - 0.5), 1, 1, fill=False,
                                       edgecolor="red", linewidth=1.2))
        ax.set_title(f"U{family[0]} r, U{family[1]} s" if family != (1, 1) else "no r/s unroll")
        ax.set_xlabel("alpha (vectors along k)")
        ax.set_ylabel("beta (outputs along h or w)")
    for ax in list(axes.flat)[len(families):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="% of measured peak")
    fig.suptitle(f"{table.isa.value} microkernels on {table.cpu.model_name} ({table.cpu.id}), "
                 f"{table.isa.value} peak {table.peak_gflops:.0f} GFLOP/s; red: within "
                 f"{100 * table.threshold:.0f} % of their scheme's best")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
