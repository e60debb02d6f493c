"""Figures drawn with matplotlib's object API on the Agg canvas: no pyplot, no global backend
switch, nothing left open between plots."""

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvcalib.io.atomic import file_staging


def figure(width: float, height: float) -> Figure:
    """A new figure of width x height inches on its own Agg canvas."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path, dpi: int = 100) -> Path:
    """Write `fig` to `path` as PNG, replacing it whole or not at all."""
    with file_staging(Path(path)) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return Path(path)
