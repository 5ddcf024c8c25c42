"""What every lnmonitor figure is drawn with: matplotlib's object API (no pyplot) and atomic PNG writes."""

from __future__ import annotations

import io
from pathlib import Path

from lnmonitor.core.output.files import atomic_write_bytes

__all__ = ["new_figure", "save_png"]


def new_figure(width: float = 7.0, height: float = 4.5):
    """A matplotlib ``Figure`` on its own Agg canvas, ``width`` x ``height`` inches at 110 dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: Path) -> None:
    """Lay out ``fig`` and write it to ``path`` as a PNG, atomically."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
