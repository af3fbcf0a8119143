"""The package layering docs/design.md states, checked on the source (imports anywhere in a file,
lazy ones inside functions included).

Every package (and every leaf module at the top of ``attn2ssm``) has a rank; a file may import
attn2ssm code only from its own package or from a package of lower rank. So dependencies point
one way and no two packages import each other:

    leaf utilities (errors, config, paths, precision, devices, hf_compat) < ops < mixers, adapters, data
    < teachers < student < decode < generation < eval, export < distill < bench < cli

plus the rules the ranks alone do not say: ``bench/`` is imported only by ``cli/``; ``export/``
only by ``cli/`` and ``bench/``. And, as before: ``ops/`` holds pure functions (no module class,
no class swapping, no module-global state); ``decode/`` keeps no module-global state.

And the layout: no function (methods and nested ones included) over 80 lines, no ``cli/`` module
over 300.
"""

import ast
import importlib
import inspect
from pathlib import Path

import pytest
from torch import nn

import attn2ssm

ROOT = Path(attn2ssm.__file__).parent

RANKS = {
    "errors": 0,
    "config": 0,
    "paths": 0,
    "precision": 0,
    "devices": 0,
    "hf_compat": 0,
    "ops": 1,
    "mixers": 2,
    "adapters": 2,
    "data": 2,
    "teachers": 3,
    "student": 4,
    "decode": 5,
    "generation": 6,
    "eval": 7,
    "export": 7,
    "distill": 8,
    "bench": 9,
    "cli": 10,
    "__main__": 11,
    "__init__": 11,  # the package root and `python -m attn2ssm`
}
# Leaf utilities may import one another (paths uses errors, precision uses paths): by these ranks.
LEAF_RANKS = {"errors": 0, "config": 1, "paths": 1, "precision": 2, "devices": 1, "hf_compat": 0}
ONLY_IMPORTED_BY = {"bench": {"cli"}, "export": {"cli", "bench"}}


def _files(package: str = "") -> list[Path]:
    return sorted((ROOT / package).rglob("*.py") if package else ROOT.rglob("*.py"))


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(imported module, node) for every import in the file, at any depth."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, node))
    return found


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def package_of(path: Path) -> str:
    """The first path component under attn2ssm/ (a leaf module's own name)."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_package(module: str) -> str | None:
    """``attn2ssm.student.cache`` → ``student``; not attn2ssm code → None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "attn2ssm" and len(parts) > 1 else None


def violations(path: Path, tree: ast.AST) -> list[str]:
    """What in one file breaks the layering (empty: nothing)."""
    mine, found = package_of(path), []
    for module, node in _imports(tree):
        theirs = imported_package(module)
        if theirs is None or theirs == mine:
            continue
        where = f"{path.relative_to(ROOT)}:{node.lineno} imports {module}"
        if theirs not in RANKS:
            found.append(f"{where}: package '{theirs}' has no rank in tests/test_layering.py")
        elif mine in LEAF_RANKS and theirs in LEAF_RANKS:
            if LEAF_RANKS[theirs] >= LEAF_RANKS[mine]:
                found.append(f"{where}: leaf utilities import only lower ones")
        elif RANKS[theirs] >= RANKS[mine]:
            found.append(
                f"{where}: '{mine}' (rank {RANKS[mine]}) may not import '{theirs}' (rank {RANKS[theirs]})"
            )
        if theirs in ONLY_IMPORTED_BY and mine not in ONLY_IMPORTED_BY[theirs]:
            found.append(f"{where}: '{theirs}' is imported only by {sorted(ONLY_IMPORTED_BY[theirs])}")
    return found


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_dependencies_point_one_way(path):
    assert violations(path, _parse(path)) == []


def test_every_package_has_a_rank():
    for path in _files():
        assert package_of(path) in RANKS, (
            f"{path.relative_to(ROOT)}: add its package to RANKS (docs/design.md says where it sits)"
        )


def test_no_two_packages_import_each_other():
    """Implied by the ranks; checked on its own so a wrong rank table cannot hide a cycle."""
    edges = {}
    for path in _files():
        for module, _ in _imports(_parse(path)):
            theirs = imported_package(module)
            if theirs and theirs != package_of(path):
                edges.setdefault(package_of(path), set()).add(theirs)
    mutual = sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))
    assert mutual == []


@pytest.mark.parametrize("path", _files("ops"), ids=lambda p: p.name)
def test_ops_are_pure_functions(path):
    tree = _parse(path)
    for module, _ in _imports(tree):
        assert module not in ("torch.nn", "torch.nn.modules"), (
            f"ops/{path.name} imports {module}: ops define no modules"
        )
    for node in ast.walk(tree):
        assert not isinstance(node, ast.Global), (
            f"ops/{path.name} keeps module-global state (line {node.lineno})"
        )
        if isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            raise AssertionError(f"ops/{path.name} swaps a class (line {node.lineno})")
    # and at run time: no class in the module is a torch module (whatever it was imported as)
    module = importlib.import_module(f"attn2ssm.ops.{path.stem}")
    for name, obj in vars(module).items():
        if inspect.isclass(obj) and obj.__module__ == module.__name__:
            assert not issubclass(obj, nn.Module), f"ops/{path.name} defines the module class {name}"


@pytest.mark.parametrize("path", _files("decode"), ids=lambda p: p.name)
def test_decode_keeps_no_module_global_state(path):
    for node in ast.walk(_parse(path)):
        assert not isinstance(node, ast.Global), (
            f"decode/{path.name} keeps module-global state (line {node.lineno})"
        )


@pytest.mark.parametrize(
    "where, source, expect",
    [
        (
            "mixers/x.py",
            "from attn2ssm.decode.fusion import call_linear",
            "'mixers' (rank 2) may not import 'decode'",
        ),
        (
            "student/x.py",
            "def f():\n    from attn2ssm.decode.plan import DecodePlan",
            "'student' (rank 4) may not import 'decode'",
        ),
        ("eval/x.py", "import attn2ssm.distill.recipe", "'eval' (rank 7) may not import 'distill'"),
        ("distill/x.py", "from attn2ssm.export.native import export_native", "'export' is imported only by"),
        ("eval/x.py", "from attn2ssm.bench import quality", "'eval' (rank 7) may not import 'bench'"),
        ("paths.py", "from attn2ssm.precision import PRECISIONS", "leaf utilities import only lower ones"),
        (
            "ops/x.py",
            "from attn2ssm.mixers.base import HeadRMSNorm",
            "'ops' (rank 1) may not import 'mixers'",
        ),
        (
            "student/x.py",
            "from attn2ssm.mixers.base import HeadRMSNorm\nfrom attn2ssm.student.cache import Attn2SSMCache",
            None,
        ),
    ],
)
def test_the_checks_can_fail(where, source, expect):
    """The checker sees what it must: an upward import, a lazy one inside a function, an import of
    bench/export from elsewhere, a leaf importing upward; and lets a downward one through."""
    found = violations(ROOT / where, ast.parse(source))
    if expect is None:
        assert found == []
    else:
        assert any(expect in f for f in found), found


MAX_FUNCTION_LINES = 80
MAX_CLI_MODULE_LINES = 300


def long_functions(path: Path, tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name:lines`` for every function in the file (methods and nested ones included) longer
    than ``limit`` lines, counted from its ``def`` to its last line (docstring included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.name}:{lines}")
    return found


def test_no_function_over_80_lines():
    offenders = [found for path in _files() for found in long_functions(path, _parse(path))]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(offenders)


def _function_source(name: str, lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_function_length_check_can_fail():
    """A method or a nested function counts; 80 lines (def included) pass, 81 do not."""
    method = "class C:\n" + _function_source("short", 3, "    ") + _function_source("long", 81, "    ")
    nested = "def outer():\n" + _function_source("inner", 81, "    ") + "    return inner\n"
    assert long_functions(ROOT / "x.py", ast.parse(method)) == ["x.py:long:81"]
    assert long_functions(ROOT / "x.py", ast.parse(nested)) == ["x.py:outer:83", "x.py:inner:81"]
    assert long_functions(ROOT / "x.py", ast.parse(_function_source("f", 80))) == []


def test_cli_modules_are_short():
    """One module per command group, each short enough to read: a long group keeps subcommands in
    modules beside it (bench_generate, data_info, ...)."""
    long = []
    for path in _files("cli"):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_CLI_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"cli modules over {MAX_CLI_MODULE_LINES} lines (split them): " + "; ".join(long)


def test_test_modules_have_unique_names():
    """tests/ has no __init__.py files (pytest's default rootdir import), so two test modules with one
    basename in different folders stop collection of the whole suite."""
    tests = Path(__file__).parent
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen[path.name] = path
    assert not clashes, "test modules share a basename: " + "; ".join(clashes)
