"""`megatron-opd plot RUN_DIR [RUN_DIR ...]`: the paper's training-dynamics figure (response length,
truncation rate, repetition rate, advantage on repetitive vs other tokens, held-out accuracy vs step) from
runs' metrics.jsonl, one colour per run. Steps where the run's collapse detector fired
(`health/collapsed`) are marked on every panel and named in the legend."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from megatron_opd.metrics.runlog import read_metrics

ADV_PANEL = "adv/repetitive_vs_other"  # two lines per run: adv/repetitive_mean dashed, adv/other_mean solid
LOGP_PANEL = "logp/teacher_vs_student"  # two lines per run: logp/teacher_mean solid, logp/student_mean dashed
PAIRED = {ADV_PANEL: [("adv/other_mean", "-"), ("adv/repetitive_mean", "--")],
          LOGP_PANEL: [("logp/teacher_mean", "-"), ("logp/student_mean", "--")]}
PANELS = [
    ("rollout/response_len_mean", "response length (tokens)"),
    ("rollout/truncation_rate", "truncation rate"),
    ("rollout/repetition_rate", "repetition rate"),
    (ADV_PANEL, "advantage: repetitive (--) vs other (-)"),
    ("eval/accuracy", "held-out accuracy"),
]
# the paper's figure layout (arXiv 2604.08527, Fig. 2): the onset shows in every panel at once
REPRODUCTION_PANELS = PANELS[:4] + [(LOGP_PANEL, "mean log-prob: teacher (-) vs student (--)")] + PANELS[4:]


def plot_runs(run_dirs: list[str | Path], out: str | Path, panels: Optional[list[tuple[str, str]]] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels or PANELS
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        color = f"C{i % 10}"
        fired = [r["step"] for r in rows if (r.get("health/collapsed") or 0) > 0]
        label = Path(run).name + (f" (collapse flagged at step {fired[0]})" if fired else "")
        for ax, (key, _) in zip(axes, panels):
            lines = PAIRED.get(key, [(key, "-")])
            for k, style in lines:
                pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, color=color, marker="o" if len(xs) < 30 else None, ms=3,
                            label=label if ax is axes[0] else None)
            for step in fired:
                ax.axvline(step, color=color, alpha=0.35, lw=1, ls=":")
    for ax, (key, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no '{key}' logged", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="megatron-opd plot", description=__doc__)
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/dynamics.png)")
    args = p.parse_args(argv)
    out = args.out or str(Path(args.runs[0]) / "dynamics.png")
    try:
        print(plot_runs(args.runs, out))
    except (FileNotFoundError, ValueError) as e:  # no run there, or a damaged metrics.jsonl (file:line)
        print(f"megatron-opd plot: {e}", file=sys.stderr)
        return 2
    return 0
