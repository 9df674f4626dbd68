"""Pictures of a result: a diff's per-step drift, and a replay's collectives per step.

The one place matplotlib is imported (lazily: it costs a second, and most commands draw nothing).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# what a plot may be written as (matplotlib picks the format by the file name)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def plot_drift(result: dict[str, Any], path_png: str) -> str:
    """Draw, per rank and step, the number of differing parameter fingerprints and |loss_a - loss_b|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5), constrained_layout=True)
    for pr in result.get("ranks", []):
        d = pr["drift"]
        steps = d["step"]
        marker = "." if len(steps) <= 200 else None
        ax1.plot(steps, d["params_differing"], marker=marker, label=f"rank {pr['rank']}")
        loss = [x if (x is not None and math.isfinite(x)) else float("nan") for x in d["loss_abs_diff"]]
        line = ax2.plot(steps, loss, marker=marker, label=f"rank {pr['rank']}")[0]
        bad = [
            s for s, x in zip(steps, d["loss_abs_diff"], strict=False) if x is None or not math.isfinite(x)
        ]
        if bad:  # a NaN or Inf difference is drawn as such, at the top, not left out or drawn as 0
            ax2.scatter(
                bad,
                [0.95] * len(bad),
                marker="x",
                color=line.get_color(),
                transform=ax2.get_xaxis_transform(),
                label=f"rank {pr['rank']}: non-finite",
            )
        first = pr.get("first")
        if first is not None:
            for ax in (ax1, ax2):
                ax.axvline(first["step"], linestyle=":", linewidth=1, color="grey")
    ax1.set_ylabel("parameters differing")
    ax2.set_ylabel("|loss A - loss B|")
    ax2.set_xlabel("step")
    if any(
        x and math.isfinite(x) and x > 0
        for pr in result.get("ranks", [])
        for x in pr["drift"]["loss_abs_diff"]
    ):
        ax2.set_yscale("symlog", linthresh=1e-9)
        ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if result.get("ranks"):
            ax.legend(loc="upper left", fontsize="small")
    ax1.set_title("drift between traces", fontsize="medium")
    fig.savefig(path_png, dpi=100)
    plt.close(fig)
    return path_png


def plot_replay(report: dict[str, Any], path: Path) -> bool:
    """Collectives replayed per step, verified steps in green, the divergent step in red."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_step = {int(k): v for k, v in (report.get("collectives_per_step") or {}).items()}
    verified = set(report.get("verified_steps") or [])
    d = report.get("first_divergence")
    steps = sorted(per_step)
    colors = [
        "tab:red" if d and s == d["step"] else ("tab:green" if s in verified else "tab:gray") for s in steps
    ]
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(steps, [per_step[s] for s in steps], color=colors)
    if d:
        ax.axvline(d["step"], color="tab:red", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("collectives")
    ax.set_title(f"replay of rank {report.get('rank')}: {report.get('status')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
