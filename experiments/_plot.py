"""What the plotting scripts of experiments/ share: writing a figure of panels to a PNG.

    from experiments._plot import save_figure
    save_figure(fig, args.out)   # grid on every panel, tight layout, written whole or not at all
"""
from __future__ import annotations

import pathlib


def save_figure(fig, out: pathlib.Path, dpi: int = 110) -> None:
    """Draw a light grid on every panel of ``fig``, lay it out tightly and write it to ``out`` (PNG, ``dpi``) whole
    or not at all: a temporary name beside it, then one rename. Prints the path written."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    tmp.replace(out)
    print(f"wrote {out}")
