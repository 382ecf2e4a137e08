"""What a first-time user copies from the docs works: the README's Python snippet runs on a CPU in
seconds, the docs point at files in this repository (the numerics too), and the licence that
pyproject.toml names is there."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_pipeline_snippet_runs_on_a_cpu():
    snippet = next(b for b in _python_blocks((ROOT / "README.md").read_text()) if "load_pipeline" in b)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    r = subprocess.run([sys.executable, "-c", snippet + "\nprint('SHAPE', tuple(video.shape))"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT),
                                                              "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SHAPE (9, 64, 64, 3)" in r.stdout


def test_docs_link_only_to_files_in_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "shared folder" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://", target):
                assert (doc.parent / target).exists(), (doc.name, target)
    readme = (ROOT / "README.md").read_text()
    assert "(docs/numerics.md)" in readme and "(docs/reliability.md)" in readme
    numerics = (ROOT / "docs" / "numerics.md").read_text()
    for must in ("## 1. NVFP4", "## 2. Attn-QAT", "## 3. SageAttention3", "## 4. SageBwd", "2688 = 448·6",
                 "Integer running max", "D   = rowsum(dO ∘ O')"):
        assert must in numerics, must


def test_scripts_named_in_the_docs_and_device_scripts_exist():
    """Every bench/, experiments/ and scripts/ file the docs, CONTRIBUTING, the folders' READMEs and the device
    scripts name is there (the CHANGELOG keeps history, so it may name files that have gone)."""
    texts = [*DOCS, ROOT / "CONTRIBUTING.md", ROOT / "experiments" / "README.md", *(ROOT / "bench").glob("*.sh"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "experiments").glob("*.py"), *(ROOT / "scripts").glob("*")]
    named = {(doc.name, m) for doc in texts
             for m in re.findall(r"\b(?:bench|experiments|scripts)/[\w./-]+\.(?:py|sh)\b", doc.read_text())}
    assert len(named) > 20
    missing = sorted((doc, m) for doc, m in named if not (ROOT / m).is_file())
    assert not missing, missing


def test_every_environment_variable_read_is_in_the_one_table():
    """docs/environment.md's table names every ATTNQAT_* variable the package, app.py, the benchmarks, the
    experiments, the scripts and the tests read, and each variable it names is read somewhere."""
    sources = [ROOT / "app.py", *(ROOT / "attnqat").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    for folder in ("bench", "experiments", "scripts"):
        sources += [p for p in (ROOT / folder).glob("*") if p.suffix in (".py", ".sh")]
    read = {name for p in sources for name in re.findall(r"ATTNQAT_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    table = (ROOT / "docs" / "environment.md").read_text().split("| variable |")[1]
    documented = set(re.findall(r"`(ATTNQAT_[A-Z0-9_]+)`", table))
    assert read == documented, (sorted(read - documented), sorted(documented - read))
    assert "(docs/environment.md)" in (ROOT / "README.md").read_text()


def test_license_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for section in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional Liability.",
                    "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License to your work."):
        assert section in text
    assert len(text.splitlines()) == 202
