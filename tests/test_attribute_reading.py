"""bench/attribute_reading.py: the changed captions differ from the clip's own in one attribute only."""
import pathlib
import random

from attnqat.corpus import Corpus, parse_prompt
from conftest import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    return load_script(ROOT / "bench" / "attribute_reading.py", "bench_attribute_reading")


def test_changed_captions_name_one_other_attribute():
    bench = _bench()
    rng = random.Random()
    seed, split = rng.randrange(1000), rng.choice(Corpus.SPLITS)
    corpus = Corpus(seed, split)
    for index in rng.sample(range(100_000), 40):
        spec = corpus.spec(index)
        caps = bench.captions_for(spec, index)
        assert caps["empty"] == ""
        own = parse_prompt(caps["right"])
        assert own["colour"] == spec.colour and own["shape"] == spec.shape and own["motion"] == spec.motion
        for attr in ("motion", "colour", "shape"):
            read = parse_prompt(caps[attr])
            assert read[attr] != own[attr], (attr, caps[attr])
            for other in {"colour", "shape", "motion", "background"} - {attr}:
                assert read[other] == own[other], (attr, other, caps[attr], caps["right"])
        assert parse_prompt(caps["motion"])["motion"] == bench.OPPOSITE[spec.motion]
        assert bench.OPPOSITE[bench.OPPOSITE[spec.motion]] == spec.motion
