"""The mode registry owns every fact about a mode: no module outside ``attnqat/kernels`` compares a mode name to a
string literal, every ``Mode`` field is read somewhere, the facts agree with each other, and a name or q/k/v is
checked once per edge, with one message."""
import ast
import dataclasses
import pathlib

import pytest
import torch

from attnqat.kernels import REFERENCE_MODE, Mode, attention, available_modes, mode_of, reference_first
from attnqat.kernels import api, attn_qat, sage3, sagebwd

ROOT = pathlib.Path(__file__).resolve().parents[1]
# attnqat/kernels is the registry and the code of the modes it registers (whose own option values, such as
# sagebwd's pv="bf16", share a mode's name)
SOURCES = (sorted(p for p in (ROOT / "attnqat").rglob("*.py") if "kernels" not in p.parts) + [ROOT / "app.py"]
           + sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "experiments").glob("*.py")))
# Comparisons with a literal that happens to be a mode's name but is not a mode
NOT_A_MODE = {("attnqat/train/loop.py", 'mp == "bf16"'),  # accelerate's mixed precision
              ("attnqat/train/config.py", 'tr.teacher_dtype == "bf16"')}  # a dtype (train.teacher_dtype)


def _trees():
    for path in SOURCES + sorted((ROOT / "attnqat" / "kernels").glob("*.py")):
        text = path.read_text()
        yield path.relative_to(ROOT).as_posix(), text, ast.parse(text, filename=str(path))


def test_no_mode_name_is_compared_to_a_string_literal_outside_the_registry():
    names = set(available_modes())
    found = []
    for where, text, tree in _trees():
        if where.startswith("attnqat/kernels/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(x, ast.Constant) and x.value in names
                                                     for x in (node.left, *node.comparators)):
                found.append((where, ast.get_source_segment(text, node)))
    assert len(SOURCES) > 20 and set(found) == NOT_A_MODE, sorted(set(found) - NOT_A_MODE)


def _fields_read() -> set[str]:
    """Mode fields read as ``mode_of(...).f``, ``x.f`` for an ``x`` assigned from ``mode_of(...)`` (or the
    api's ``_checked``), ``m.f`` in a ``lambda m: ...`` given to ``available_modes``, and ``self.f`` in Mode's
    own methods: reads that are of a Mode record, not of something else with a field's name (the processors'
    ``high_precision`` flag)."""
    fields = {f.name for f in dataclasses.fields(Mode)}
    makers = {"mode_of", "_checked"}

    def called(node, names):
        return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in names

    read = set()
    for _, _, tree in _trees():
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]
        for scope in scopes:
            records = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and called(n.value, makers)
                       for t in n.targets if isinstance(t, ast.Name)}
            if isinstance(scope, ast.FunctionDef) and scope.name == "check_options":
                records.add("self")
            for n in ast.walk(scope):
                if called(n, {"available_modes"}) and n.args and isinstance(n.args[0], ast.Lambda):
                    lam = n.args[0]
                    param = lam.args.args[0].arg
                    read |= {x.attr for x in ast.walk(lam.body) if isinstance(x, ast.Attribute)
                             and getattr(x.value, "id", None) == param}
                if isinstance(n, ast.Attribute) and n.attr in fields and (
                        called(n.value, makers) or getattr(n.value, "id", None) in records):
                    read.add(n.attr)
    return read & fields


def test_every_mode_field_is_consulted():
    fields = {f.name for f in dataclasses.fields(Mode)}
    unread = fields - _fields_read() - {"description"}  # description: for people reading the registry
    assert not unread, f"Mode fields nothing reads: {sorted(unread)}"


def test_the_facts_agree():
    for name in available_modes():
        m = mode_of(name)
        assert m.name == name
        if m.same_forward_as is not None:  # a forward shared is shared whole
            base = mode_of(m.same_forward_as)
            assert base.same_forward_as is None and base.naive_fp4_forward == m.naive_fp4_forward
            assert base.with_lse is m.with_lse
        assert not (m.uses_qat_weights and not m.trainable)  # a QAT fine-tune is trained in its mode
    ref = mode_of(REFERENCE_MODE)
    assert ref.high_precision and ref.trainable and ref.head_dims is None and ref.demo_column == 0
    assert len(available_modes(lambda m: m.uses_qat_weights)) == 1  # the one mode a shipped QAT file is for
    columns = [mode_of(m).demo_column for m in available_modes(lambda m: m.demo_column is not None)]
    assert sorted(columns) == list(range(len(columns)))
    for name in available_modes(lambda m: m.demo_column is not None):  # a title that fits its column
        assert 0 < len(mode_of(name).demo_label or "") <= 27, name
    assert reference_first(["nvfp4", REFERENCE_MODE, "nvfp4", "sage3"]) == [REFERENCE_MODE, "nvfp4", "sage3"]


def test_an_unknown_name_gets_one_message_at_every_edge():
    from attnqat.demo import validate_request
    from attnqat.kernels.api import attention_with_lse
    from attnqat.pipelines import AttnQATProcessor, PrecisionSchedule, patch_attention
    from attnqat.pipelines.tiny import build_tiny_transformer

    q = torch.randn(1, 1, 8, 64)
    message = f"unknown attention mode 'fp3'; available: {', '.join(available_modes())}"
    edges = {
        "attention": lambda: attention(q, q, q, "fp3"),
        "attention_with_lse": lambda: attention_with_lse(q, q, q, "fp3"),
        "AttnQATProcessor": lambda: AttnQATProcessor("fp3"),
        "AttnQATProcessor high": lambda: AttnQATProcessor(REFERENCE_MODE, high_precision_mode="fp3"),
        "patch_attention": lambda: patch_attention(build_tiny_transformer(), "fp3"),
        "patch_attention (every layer high-precision)": lambda: patch_attention(
            build_tiny_transformer(), "fp3", [0], schedule=PrecisionSchedule(blocks=(0,))),
        "demo": lambda: validate_request(model="tiny", prompt="p", height=32, width=32, frames=5, steps=2, seed=0,
                                         modes=[REFERENCE_MODE, "fp3"]),
    }
    for edge, call in edges.items():
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message, edge
    with pytest.raises(ValueError, match="^unknown --mode 'fp3'; available: bf16, "):
        mode_of("fp3", "--mode")  # a command's edge names its flag
    with pytest.raises(ValueError) as err:
        mode_of("x" * 10_000)
    assert len(str(err.value)) < 200 and "..." in str(err.value)  # a pasted novel stays one readable line
    with pytest.raises(ValueError, match="high-precision mode 'nvfp4' not in bf16, sagebwd"):
        PrecisionSchedule(mode="nvfp4")  # known, but not one a schedule may switch to


@pytest.mark.parametrize("mode", ["nvfp4", "attn_qat", "attn_qat_dropin", "sage3", "sagebwd"])
def test_attention_checks_its_inputs_once(mode, monkeypatch):
    """attention() checks q, k, v once and calls the mode's unchecked path (here the Triton path, under the
    interpreter); the kernel modules' public functions, edges of their own, check them too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    for module in (api, attn_qat, sage3, sagebwd):
        check = module.check_qkv
        monkeypatch.setattr(module, "check_qkv",
                            lambda *a, _check=check, **kw: calls.append(kw["name"]) or _check(*a, **kw))
    q, k, v = (torch.randn(1, 1, 16, 64).bfloat16() for _ in range(3))
    with torch.no_grad():
        out = attention(q, k, v, mode)
    assert calls == [f"attention(mode={mode!r})"] and torch.isfinite(out).all()
    public = {"nvfp4": attn_qat.nvfp4_attention, "attn_qat": attn_qat.attn_qat_attention,
              "attn_qat_dropin": attn_qat.attn_qat_dropin_attention, "sage3": sage3.sage3_attention,
              "sagebwd": sagebwd.sagebwd_attention}[mode]
    with torch.no_grad():
        assert torch.equal(public(q, k, v), out)
    assert calls[1:] == [public.__name__]
