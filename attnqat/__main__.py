"""``python -m attnqat ...``: the console script, also for launchers that start a module
(``torchrun --nproc-per-node 2 -m attnqat generate --parallel ulysses ...``)."""
import sys

from attnqat.cli import main

sys.exit(main())
