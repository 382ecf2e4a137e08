"""The quality table of docs/quality.md and its picture docs/quality.png, made by `attnqat quality`.

    python bench/quality.py --device cuda                       # the shipped mini, every mode, GPU defaults
    python bench/quality.py --device cuda --model runs/mini/mini --variant qat=attn_qat:runs/mini_qat/flow ...
    python bench/quality.py --device cpu --model tiny --size 5x32x32 --steps 2 --prompts 2 --clips 2 --no-write

Every option but --out, --docs and --no-write goes to `attnqat quality` as it is (see `attnqat quality --help`:
--model, --variant, --bf16-steps, --prompts, --clips, --size, --steps, --device ...). The run writes into --out
(default bench/results/quality; an earlier output there is replaced). Then, unless --no-write, the table goes
between the BEGIN/END quality markers of DOCS/quality.md (the rest of the page is left alone), the picture to
DOCS/quality.png (at most --picture-width pixels wide, 1800 by default, 256 colours: the full-size grid stays in
--out) and every number to DOCS/quality.json.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench._report import ROOT, env_line, environment, update_section  # noqa: E402

SECTION = "quality"
DOC_PICTURE_WIDTH = 1800  # the full grid of 32 prompts is ~3 MB; this keeps the page's copy legible under 600 KB


def write_doc_picture(grid: pathlib.Path, target: pathlib.Path, width: int = DOC_PICTURE_WIDTH) -> None:
    """``grid`` scaled down to ``width`` (never up) in 256 colours, as ``target``."""
    from PIL import Image

    with Image.open(grid) as im:
        im = im.convert("RGB")
        if im.width > width:
            im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
        im.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(target, optimize=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality"), help="attnqat quality's --out")
    p.add_argument("--docs", default=str(ROOT / "docs"), help="folder of quality.md / .png / .json (default: docs/)")
    p.add_argument("--no-write", action="store_true", help="leave the docs alone (a smoke run)")
    p.add_argument("--picture-width", type=int, default=DOC_PICTURE_WIDTH,
                   help=f"the page's picture at most this wide (default {DOC_PICTURE_WIDTH})")
    args, rest = p.parse_known_args(argv)
    from attnqat.cli import main as attnqat

    rc = attnqat(["quality", *rest, "--out", args.out])
    if rc != 0 or args.no_write:
        return rc
    out, docs = pathlib.Path(args.out), pathlib.Path(args.docs)
    table = json.loads((out / "table.json").read_text())
    markdown = (out / "table.md").read_text()
    docs.mkdir(parents=True, exist_ok=True)
    if not (docs / "quality.md").exists():  # another folder (a smoke run): start from this page
        shutil.copyfile(ROOT / "docs" / "quality.md", docs / "quality.md")
    write_doc_picture(out / "grid.png", docs / "quality.png", args.picture_width)
    shutil.copyfile(out / "table.json", docs / "quality.json")
    env = environment()
    command = " ".join(["python bench/quality.py", *rest])
    block = (f"{env_line(env)} Run time {table['seconds']:.0f} s. Command: `{command}`.\n\n{markdown}\n"
             f"![first, middle and last frame of the first prompts, one row per variant; under each video what the "
             f"detector read, green where it matches the prompt](quality.png)\n")
    update_section(SECTION, block, doc=docs / "quality.md")
    print(f"wrote {docs / 'quality.md'} (section {SECTION}), {docs / 'quality.png'}, {docs / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
