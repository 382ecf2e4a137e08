"""``python -m attnqat.train --config CONFIG.yaml`` / ``accelerate launch -m attnqat.train --config ...``."""
import sys

from attnqat.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
