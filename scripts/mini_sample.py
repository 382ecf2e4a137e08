"""The README's picture of the quick-start command: frames 0, 16 and 32 of `attnqat generate` on the shipped
mini, bf16 attention (top row) and `--mode attn_qat` with mini's shipped QAT weights (bottom row).

    python scripts/mini_sample.py --out docs/mini_sample.png     # CPU: about a minute
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "a blue square moves up over a checkered background"
FRAMES = (0, 16, 32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--prompt", default=PROMPT)
    args = p.parse_args(argv)
    from PIL import Image

    from attnqat.outputs import write_file_atomically

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("bf16", "attn_qat"):
            frames = Path(tmp) / mode
            subprocess.run([sys.executable, "-m", "attnqat", "generate", "--prompt", args.prompt, "--mode", mode,
                            "--out", str(Path(tmp) / f"{mode}.mp4"), "--frames-dir", str(frames)], check=True)
            rows.append([Image.open(frames / f"frame_{i:04d}.png").convert("RGB") for i in FRAMES])
    # CPU frames are 128x128: twice that, pixel for pixel, so a page shows them at a readable size
    rows = [[im.resize((2 * im.width, 2 * im.height), Image.NEAREST) for im in row] for row in rows]
    w, h = rows[0][0].size
    sheet = Image.new("RGB", (len(FRAMES) * w + (len(FRAMES) - 1) * 4, 2 * h + 4), "white")
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            sheet.paste(im, (c * (w + 4), r * (h + 4)))
    write_file_atomically(args.out, lambda t: sheet.save(t, format="PNG"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
