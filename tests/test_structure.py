"""The shape of the package: who imports whom, read from the source (every import statement, also the ones
inside functions, and the parent packages an import runs), so a lazy import cannot hide a cycle.

- The layers below, each importing only itself and the layers :data:`MAY_IMPORT` names: no upward import.
- No import cycle anywhere in the package.
- An import inside a function only where :data:`LAZY` lists it, with its reason; each listed one is real, keeps its
  module light (no torch, diffusers, transformers, triton or gradio at import) and loads something heavy.
- ``kernels/reference.py`` checks the kernels, so it imports none of them: only torch, math and ``formats.py``.
- Plain import statements only in the kernels: ``torch.compile`` traces an import statement, not importlib.
"""
import ast
import fnmatch
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "attnqat"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
MODULES = sorted(FILES)

# The layers, top first. A module is in the first layer one of whose patterns matches its name.
LAYERS: dict[str, tuple[str, ...]] = {
    # the package's face (attention, available_modes) and the console script's table of commands
    "entry": ("attnqat", "attnqat.cli", "attnqat.__main__", "attnqat.train.__main__"),
    # what the commands and the demo run
    "applications": ("attnqat.pipelines.generate", "attnqat.train.cli", "attnqat.train.mini",
                     "attnqat.mini.evaluation", "attnqat.mini.quality_cli", "attnqat.mini.build_cli", "attnqat.export_qat_cli",
                     "attnqat.demo", "attnqat.demo_app"),
    # the QAT loop, its config, data and objectives, precompute's encoding
    "train": ("attnqat.train", "attnqat.train.*"),
    # the diffusers integration: processors, schedules, loading, checkpoints, the built-in models (mini's building)
    "pipelines": ("attnqat.pipelines", "attnqat.pipelines.*", "attnqat.mini.model"),
    # what every layer above the kernels may use: errors, atomic writes, output locks, argument checks, the thread
    # cap, the list of attention options weights record, and the corpus side (the procedural clips and captions, the
    # pixel detector; the mini package itself imports nothing, so that each of its modules can sit in its own layer)
    "shared": ("attnqat.errors", "attnqat.outputs", "attnqat.locking", "attnqat.checks", "attnqat.threads",
               "attnqat.trained_options", "attnqat.mini", "attnqat.mini.corpus", "attnqat.mini.quality"),
    # attention(q, k, v, mode), the mode registry, the Triton kernels and their references
    "kernels": ("attnqat.kernels", "attnqat.kernels.*"),
}
# The allowed arrows: each layer imports itself and these.
MAY_IMPORT: dict[str, set[str]] = {
    "entry": {"applications", "train", "pipelines", "shared", "kernels"},
    "applications": {"train", "pipelines", "shared", "kernels"},
    "train": {"pipelines", "shared", "kernels"},
    "pipelines": {"shared", "kernels"},
    "shared": set(),
    "kernels": set(),
}

# The only imports of attnqat modules inside functions: (importer, imported) -> why. Each keeps its importer light
# at import time (the test checks that it is, and that what it imports is not).
_HELP = "keeps `attnqat {} --help` fast"
LAZY: dict[tuple[str, str], str] = {
    ("attnqat", "attnqat.kernels"): "`import attnqat` and `attnqat --help` load no torch",
    **{("attnqat.pipelines.generate", m): _HELP.format("generate") for m in (
        "attnqat.kernels", "attnqat.kernels.formats", "attnqat.pipelines.context_parallel",
        "attnqat.pipelines.loading", "attnqat.pipelines.processor", "attnqat.pipelines.schedule",
        "attnqat.pipelines.tiny")},
    **{("attnqat.mini.quality_cli", m): _HELP.format("quality") for m in (
        "attnqat.mini.evaluation", "attnqat.kernels", "attnqat.pipelines.loading", "attnqat.pipelines.schedule",
        "attnqat.pipelines.tiny", "attnqat.mini.quality")},
    **{("attnqat.demo_app", m): _HELP.format("demo") for m in (
        "attnqat.demo", "attnqat.kernels", "attnqat.pipelines.loading", "attnqat.pipelines.tiny")},
    **{("attnqat.export_qat_cli", m): _HELP.format("export-qat") for m in (
        "attnqat.kernels", "attnqat.pipelines.loading", "attnqat.pipelines.qat_export")},
    **{("attnqat.mini.model", m): "the commands read mini's name and folder from here before --help" for m in (
        "attnqat.mini.corpus", "attnqat.pipelines.tiny")},
}
HEAVY = {"torch", "diffusers", "transformers", "triton", "gradio"}


def layer_of(module: str) -> str:
    for layer, patterns in LAYERS.items():
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _resolve(name: str) -> str:
    """The attnqat module ``name`` loads: itself, else the longest package prefix (a name defined in it)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in FILES:
        parts.pop()
    return ".".join(parts)


def _parents(target: str, importer: str) -> list[str]:
    """The packages that importing ``target`` initialises too, except those ``importer`` is inside (already
    initialising when it runs) and the root (every module's first)."""
    parts = target.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
            if p in FILES and not (importer == p or importer.startswith(p + "."))]


def _scan(module: str) -> list[tuple[str, int, bool, set[str]]]:
    """(imported attnqat module, line, inside a function, external top-level packages) per import statement."""
    path = FILES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_function = set()
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(f) if n is not f)
    found = []
    for node in ast.walk(tree):
        lazy = id(node) in in_function
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "attnqat":
                    found.append((_resolve(a.name), node.lineno, lazy, set()))
                else:
                    found.append(("", node.lineno, lazy, {a.name.split(".")[0]}))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            if full.split(".")[0] != "attnqat":
                found.append(("", node.lineno, lazy, {full.split(".")[0]}))
                continue
            for a in node.names:  # a submodule, or a name defined in the module
                found.append((_resolve(f"{full}.{a.name}"), node.lineno, lazy, set()))
    return [(t, line, lazy, ext) for t, line, lazy, ext in found if t != module]


SCANS = {m: _scan(m) for m in MODULES}


def edges(*, lazy: bool = True) -> dict[str, set[str]]:
    """importer -> the attnqat modules it loads (with the parent packages they initialise); ``lazy``: also the
    imports inside functions."""
    out = {}
    for m in MODULES:
        targets = {t for t, _, is_lazy, _ in SCANS[m] if t and (lazy or not is_lazy)}
        out[m] = targets | {p for t in targets for p in _parents(t, m)}
    return out


def _loads_at_import(module: str) -> set[str]:
    """The heavy external packages ``module`` imports at import time, itself or through attnqat modules."""
    graph, seen, todo, heavy = edges(lazy=False), set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        heavy |= {e for _, _, is_lazy, ext in SCANS[m] if not is_lazy for e in ext} & HEAVY
        todo.extend(graph[m] | {p for p in _parents(m, "") if p != m})
    return heavy


def test_the_scan_sees_lazy_imports_relative_imports_and_parent_packages():
    """Guards the checks below against a parser that finds nothing."""
    assert ("attnqat.kernels", True) in {(t, lazy) for t, _, lazy, _ in SCANS["attnqat"]}
    assert {"attnqat.kernels.api", "attnqat.kernels.nvfp4", "attnqat.kernels.sagebwd"} <= edges()["attnqat.kernels"]
    assert "attnqat.pipelines.loading" in edges()["attnqat.pipelines.generate"]  # `from .loading import ...`
    assert "attnqat.pipelines" in edges()["attnqat.demo"]  # importing pipelines.generate runs pipelines/__init__
    assert "attnqat.train" in edges()["attnqat.mini.evaluation"]  # importing train.config runs train/__init__ too
    assert "attnqat.train" not in edges()["attnqat.train.loop"]  # a module's own package is already loading
    assert {"torch", "triton"} <= _loads_at_import("attnqat.kernels.formats")  # through the kernels package
    assert not _loads_at_import("attnqat.checks")


def test_every_module_is_in_a_layer_and_imports_no_layer_above_it():
    assert set(MAY_IMPORT) == set(LAYERS)
    upward = []
    for m, targets in edges().items():
        for t in sorted(targets):
            if layer_of(t) != layer_of(m) and layer_of(t) not in MAY_IMPORT[layer_of(m)]:
                lines = [line for tt, line, _, _ in SCANS[m] if tt == t or t in _parents(tt, m)]
                upward.append(f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)}) at line {lines[0]}")
    assert not upward, "imports across layers that MAY_IMPORT does not allow:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)


def test_imports_inside_functions_are_only_the_listed_ones_and_each_earns_its_place():
    found = {(m, t) for m in MODULES for t, _, lazy, _ in SCANS[m] if lazy and t}
    unlisted = sorted(found - set(LAZY))
    assert not unlisted, f"imports inside functions: move them to the module's top (or list them in LAZY): {unlisted}"
    stale = sorted(set(LAZY) - found)
    assert not stale, f"LAZY lists imports the code no longer makes lazily: {stale}"
    for importer in {m for m, _ in LAZY}:
        heavy = _loads_at_import(importer)
        assert not heavy, f"{importer} loads {sorted(heavy)} at import anyway: its lazy imports gain nothing"
    light = sorted(t for _, t in LAZY if not _loads_at_import(t))
    assert not light, f"lazily imported, though importing them is light: {light}; import them at the top"


def test_every_name_in_a_modules_all_exists():
    """``__all__`` is the public list (``from m import *``, the docs' API lists): a missing comma between two
    names joins them into one that does not exist. Imports every module but the ``__main__`` ones (importing
    those runs the command)."""
    import importlib

    listed, missing = set(), []
    for m in (m for m in MODULES if m.rpartition(".")[2] != "__main__"):
        module = importlib.import_module(m)
        names = getattr(module, "__all__", None)
        if names is not None:
            listed.add(m)
            missing += [f"{m}: {n!r}" for n in names if not (isinstance(n, str) and hasattr(module, n))]
    assert {"attnqat", "attnqat.pipelines", "attnqat.pipelines.loading", "attnqat.train"} <= listed
    assert not missing, "names in __all__ that the module does not define:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------------ kernels
def test_reference_imports_no_kernel_module():
    found = SCANS["attnqat.kernels.reference"]
    assert {t for t, *_ in found if t} <= {"attnqat.kernels.formats"}, f"reference.py imports kernel code: {found}"
    external = {e for *_, ext in found for e in ext}
    assert external <= {"__future__", "math", "torch"}, f"reference.py depends on {sorted(external)}"
    formats = [f for f in SCANS["attnqat.kernels.formats"] if f[0] or f[3] - {"__future__"}]
    assert not formats, f"formats.py must import nothing (both sides read it): {formats}"


def test_plain_imports_only_in_the_kernels():
    """torch.compile traces an import statement; importlib and __import__ it cannot."""
    for m in (m for m in MODULES if layer_of(m) == "kernels"):
        assert "importlib" not in {e for *_, ext in SCANS[m] for e in ext}, m
        tree = ast.parse(FILES[m].read_text())
        calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == "__import__"]
        assert not calls, f"{m} calls __import__ (lines {calls}): torch.compile cannot trace it"
