"""``python app.py [options]`` runs ``attnqat demo [options]`` (the side-by-side demo page, :mod:`attnqat.demo_app`)
from a source checkout."""
import sys

from attnqat.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
