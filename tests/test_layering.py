"""The package layering DESIGN.md states, checked on the source (imports anywhere in a file,
lazy ones inside functions included): ops <- mixers <- student <- decode.

* ``ops/`` holds pure functions: no ``nn.Module`` (or any other) class swapping — no class
  defined there subclasses a torch module, nothing there assigns ``__class__``, no
  module-global state (``global``) — and it imports nothing from attn2ssm above it;
* ``mixers/`` imports nothing from ``attn2ssm.decode`` (nor from student);
* ``student/`` reaches ``attn2ssm.decode`` only in ``Attn2SSMForCausalLM.enable_decode_plan``,
  the user's entry point that defers to ``decode.plan``;
* ``decode/`` keeps no module-global state either.
"""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from torch import nn

import attn2ssm

ROOT = Path(attn2ssm.__file__).parent


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).glob("*.py"))


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(imported module, node) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, node))
    return found


def _enclosing_functions(tree: ast.AST) -> dict[int, str]:
    """id(node) → qualified name of the function it sits in."""
    where: dict[int, str] = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
            where[id(child)] = name
            visit(child, name)

    visit(tree, "")
    return where


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@pytest.mark.parametrize("path", _files("ops"), ids=lambda p: p.name)
def test_ops_are_pure_functions(path):
    tree = _parse(path)
    for module, _ in _imports(tree):
        assert not module.startswith(("attn2ssm.mixers", "attn2ssm.student", "attn2ssm.decode")), f"ops/{path.name} imports {module}"
        assert module not in ("torch.nn", "torch.nn.modules"), f"ops/{path.name} imports {module}: ops define no modules"
    for node in ast.walk(tree):
        assert not isinstance(node, ast.Global), f"ops/{path.name} keeps module-global state (line {node.lineno})"
        if isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            raise AssertionError(f"ops/{path.name} swaps a class (line {node.lineno})")
    # and at run time: no class in the module is a torch module (whatever it was imported as)
    module = importlib.import_module(f"attn2ssm.ops.{path.stem}")
    for name, obj in vars(module).items():
        if inspect.isclass(obj) and obj.__module__ == module.__name__:
            assert not issubclass(obj, nn.Module), f"ops/{path.name} defines the module class {name}"


@pytest.mark.parametrize("path", _files("mixers"), ids=lambda p: p.name)
def test_mixers_import_nothing_from_decode_or_student(path):
    for module, node in _imports(_parse(path)):
        assert not module.startswith(("attn2ssm.decode", "attn2ssm.student")), f"mixers/{path.name}:{node.lineno} imports {module}"


@pytest.mark.parametrize("path", _files("student"), ids=lambda p: p.name)
def test_student_reaches_decode_only_through_enable_decode_plan(path):
    tree = _parse(path)
    where = _enclosing_functions(tree)
    for module, node in _imports(tree):
        if module.startswith("attn2ssm.decode"):
            assert (path.name, where.get(id(node))) == ("modeling.py", "Attn2SSMForCausalLM.enable_decode_plan"), (
                f"student/{path.name}:{node.lineno} imports {module}"
            )


@pytest.mark.parametrize("path", _files("decode"), ids=lambda p: p.name)
def test_decode_keeps_no_module_global_state(path):
    for node in ast.walk(_parse(path)):
        assert not isinstance(node, ast.Global), f"decode/{path.name} keeps module-global state (line {node.lineno})"


def test_the_checks_can_fail(tmp_path):
    """The parsers see what they must: a module class, a global and a lazy decode import."""
    tree = ast.parse("from torch import nn\nclass A(nn.Module): pass\ndef f():\n    global X\n    from attn2ssm.decode.plan import DecodePlan\n")
    assert ("attn2ssm.decode.plan", "f") in [(m, _enclosing_functions(tree).get(id(n))) for m, n in _imports(tree)]
    assert any(isinstance(n, ast.Global) for n in ast.walk(tree))
