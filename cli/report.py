"""titan-report: plot (and summarize) a titan-run --metrics file."""

from __future__ import annotations

import io
from pathlib import Path

import click

from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath
from titan.runtime.common.safe_files import replace_file

PLOT_HINT = "pip install -e '.[watch]' from a clone (or: pip install matplotlib)"
# Panel size in inches at DPI: the PNG is 800 px wide and 250 px high per panel.
PANEL_W, PANEL_H, DPI = 8.0, 2.5, 100


@click.command(cls=Command)
@click.argument("metrics", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--out", default=None, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="PNG to write: loss (and validation loss), learning rate, gradient norm, tokens/s and (when recorded) peak memory over steps.")
@click.option("--summary", "show_summary", is_flag=True,
              help="Print steps, first/last/min loss, median tokens/s (what titan-report does without -o).")
def main(metrics, out, show_summary):
    """Summarize METRICS (a titan-run --metrics file), or plot it into a PNG with -o (--summary: both)."""
    from titan.runtime.metrics_file import read_metrics, summary

    show_summary = show_summary or out is None
    records = read_metrics(metrics)
    if show_summary:
        for line in summary(records):
            click.echo(line)
    if out is not None:
        plot(records, out, title=metrics.name)
        click.echo(f"wrote {out}")


def plot(records: list[dict], out: Path, *, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"titan-report -o needs matplotlib: {PLOT_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [("loss", "loss")]
    if any("val_loss" in r for r in records):
        panels[0] = ("loss", "loss / validation loss")
    panels += [(key, label) for key, label in (("lr", "learning rate"), ("grad_norm", "gradient norm"))
               if any(key in r for r in records)]
    panels.append(("tokens_per_s", "tokens/s"))
    if any("peak_mem_gib" in r for r in records):
        panels.append(("peak_mem_gib", "peak memory (GiB)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(PANEL_W, PANEL_H * len(panels)), dpi=DPI, sharex=True)
    for ax, (key, label) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None)
        if key == "loss" and any("val_loss" in r for r in records):
            val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
            ax.plot([s for s, _ in val], [v for _, v in val], marker="o", label="validation")
            ax.legend()
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    plt.close(fig)
    replace_file(out, png.getvalue())


if __name__ == "__main__":
    main()
