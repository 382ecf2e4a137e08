"""The shape of ``attnqat/kernels``: who imports whom, read from the source (every import statement, also the
ones inside functions), so a lazy import cannot hide a cycle.

- ``reference.py`` checks the kernels, so it imports none of them: only torch, math and ``formats.py``.
- No import cycle among the kernel modules.
- Plain import statements only: ``torch.compile`` traces ``from . import x`` inside a function, not importlib.
"""
import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "attnqat" / "kernels"
PACKAGE = "attnqat.kernels"
MODULES = sorted(p.stem for p in KERNELS.glob("*.py"))


def _target(name: str) -> str:
    """The kernels module that ``<package>.<name>`` names: a submodule, else the package (``__init__``)."""
    head = name.split(".")[0]
    return head if head in MODULES else "__init__"


def imports(module: str) -> list[tuple[str, int, str]]:
    """(kind, line, name) for every import in ``module``: kind "kernels" with the kernels module it loads,
    "external" with the top-level package name, or "outside" with the module of the rest of attnqat."""
    tree = ast.parse((KERNELS / f"{module}.py").read_text(), filename=f"{module}.py")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.append(("kernels", node.lineno, _target(alias.name[len(PACKAGE) + 1:])))
                else:
                    found.append(("external", node.lineno, alias.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                sub = module
            elif node.level == 0 and (module == PACKAGE or module.startswith(PACKAGE + ".")):
                sub = module[len(PACKAGE) + 1:]
            elif node.level == 0 and module.split(".")[0] != "attnqat":
                found.append(("external", node.lineno, module.split(".")[0]))
                continue
            else:  # the rest of attnqat
                found.append(("outside", node.lineno, "." * node.level + module))
                continue
            if sub:  # from .x import y
                found.append(("kernels", node.lineno, _target(sub)))
            else:  # from . import x, y: submodules, or names of the package itself
                found.extend(("kernels", node.lineno, _target(a.name)) for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    return {m: {name for kind, _, name in imports(m) if kind == "kernels" and name != m} for m in MODULES}


def test_the_parser_sees_function_level_imports():
    """Guards the checks below: api.py imports its kernels inside functions, and they must count."""
    assert {"attn_qat", "sage3", "sagebwd", "reference"} <= graph()["api"]
    assert "__init__" not in MODULES or graph()["__init__"] >= {"api", "nvfp4", "sagebwd"}


def test_reference_imports_no_kernel_module():
    found = imports("reference")
    kernels = {(line, name) for kind, line, name in found if kind == "kernels"}
    assert {name for _, name in kernels} <= {"formats"}, f"reference.py imports kernel code: {sorted(kernels)}"
    assert not [f for f in found if f[0] == "outside"], found
    external = {name for kind, _, name in found if kind == "external"}
    assert external <= {"__future__", "math", "torch"}, f"reference.py depends on {sorted(external)}"
    formats = {name for kind, _, name in imports("formats") if kind != "external" or name != "__future__"}
    assert not formats, f"formats.py must import nothing (both sides read it): {formats}"


def test_no_import_cycle_among_kernel_modules():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)


def test_plain_imports_only():
    """api.py: "a plain import: torch.compile traces it (importlib it cannot)"; the same for every module."""
    for m in MODULES:
        assert "importlib" not in {name for kind, _, name in imports(m) if kind == "external"}, m
        tree = ast.parse((KERNELS / f"{m}.py").read_text())
        calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == "__import__"]
        assert not calls, f"{m}.py calls __import__ (lines {calls}): torch.compile cannot trace it"
