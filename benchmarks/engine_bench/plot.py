"""The PNG: tokens/s per configuration, one panel per batch size."""

from __future__ import annotations

from pathlib import Path

from . import BATCH


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib  # here, not at the top: only the plot needs it, and Agg must be set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [7, 5]})
    for ax, b in zip(axes, (1, BATCH), strict=True):
        sel = [r for r in rows if r["batch"] == b and "rate" in r]
        names = [r["label"].split(")")[0] + ")" for r in sel]
        rates = [r["rate"] for r in sel]
        colors = ["#888888" if r["key"] in ("a", "f") else "#d62728" if r["key"] == "g" else "#1f77b4" for r in sel]
        bars = ax.bar(names, rates, color=colors)
        for bar, r in zip(bars, sel, strict=True):
            ax.annotate(f"{r['rate']:.0f}\n{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(f"batch {b}" + (" (HF rows: batch 1 only)" if b == 1 else ""))
        ax.set_ylabel("generated tokens / s")
        ax.set_ylim(0, max(rates) * 1.25)
    legend = "\n".join(sorted({r["label"] for r in rows if "rate" in r}))
    fig.text(0.01, 0.01, legend, fontsize=7, va="bottom", family="monospace")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.22, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
