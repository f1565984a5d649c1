"""The pictures' shared ends: matplotlib imported only when a picture is asked for, and a figure written as
PNG bytes that are the same on every run (no software or date stamp)."""

from __future__ import annotations

import io

from .errors import UserError


def pyplot():
    """matplotlib.pyplot on the Agg backend; one line naming the extra to install where it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'fxworkload[plot]' (make run installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(figure, axes) -> bytes:
    """The figure with its legend, laid out, as PNG bytes; the figure is closed."""
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    pyplot().close(figure)
    return buffer.getvalue()
