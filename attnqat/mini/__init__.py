"""The ``mini`` model's parts: its procedural corpus (:mod:`.corpus`), the pixel detector that scores its videos
(:mod:`.quality`), the building and saving of its diffusers folder (:mod:`.model`), the evaluation of attention
modes and checkpoints on it (:mod:`.evaluation`) and the ``attnqat quality`` command (:mod:`.quality_cli`).

The shipped weights stay package data in ``attnqat/models/mini``; ``attnqat build-mini`` builds them.
Nothing is imported here: each part is imported by its own name, in the layer tests/test_structure.py gives it.
"""
