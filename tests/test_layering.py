"""The package layering and the size ceilings docs/design.md states, checked on the source.

Every import counts, wherever it sits in a file (lazy ones inside functions included) and in each of
its forms: ``import attn2ssm.a.b``, ``from attn2ssm.a import b`` (``b`` itself when it is a module,
so ``from attn2ssm import decode`` imports ``decode``), relative ones (``from ..decode import x``,
``from . import x``) and ``importlib.import_module("attn2ssm.…")`` with a literal name.

Every package (and every leaf module at the top of ``attn2ssm``) has a rank; a file may import
attn2ssm code only from its own package or from a package of lower rank. So dependencies point
one way and no two packages import each other:

    leaf utilities (errors, config, paths, precision, devices, hf_compat) < ops < mixers, adapters, data
    < teachers < student < decode < generation < eval, export < distill < bench < cli

plus the rules the ranks alone do not say: ``bench/`` is imported only by ``cli/``; ``export/``
only by ``cli/`` and ``bench/``. Inside a package, modules that import one another (a cycle of the
module graph) are counted: at most one such knot in the whole tree. And, as before: ``ops/`` holds
pure functions (no module class, no class swapping, no module-global state); ``decode/`` keeps no
module-global state.

And the ceilings: no module over 800 lines, no class over 600, no function (methods and nested ones
included) over 80 lines and at most 18 over 60 (the target is 10), no ``cli/`` module over 300.

Every rule has a can-fail test: the same checker run on a made-up source that breaks it.
"""

import ast
import importlib
import inspect
import types
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

MAX_PACKAGE_CYCLES = 1
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 80
# issue 47: 28 functions over 60 lines before the carve, 18 after it, none now; a new one fails this test
LONG_FUNCTION_LINES, MAX_LONG_FUNCTIONS = 60, 0
MAX_CLI_MODULE_LINES = 300


def _files(package: str = "") -> list[Path]:
    return sorted((ROOT / package).rglob("*.py") if package else ROOT.rglob("*.py"))


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_name(path: Path) -> str:
    """``…/attn2ssm/student/cache.py`` → ``attn2ssm.student.cache`` (a package's ``__init__.py``: the package)."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = frozenset(module_name(path) for path in _files())


def _import_module_name(node: ast.AST) -> str | None:
    """The literal name in ``importlib.import_module("…")`` / ``import_module("…")``, else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    name = node.args[0].value
    return name if called == "import_module" and isinstance(name, str) and not name.startswith(".") else None


def imported_modules(path: Path, tree: ast.AST, modules=MODULES) -> list[tuple[str, ast.AST]]:
    """(imported module, node) for every import in the file, at any depth and in every form; a
    ``from`` import names each imported module (``from attn2ssm import decode``: ``attn2ssm.decode``),
    or the module it reads names from. Relative imports are resolved from the file's place."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # one dot: this file's package; each further dot: one package up
                parents = package.split(".")
                parents = parents[: len(parents) - node.level + 1]
                base = ".".join([*parents, *([node.module] if node.module else [])])
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found += [(module, node) for module in submodules]
            if len(submodules) < len(node.names):
                found.append((base, node))
        elif (name := _import_module_name(node)) is not None:
            found.append((name, node))
    return found


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
    for module, node in imported_modules(path, tree):
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


def mutual_imports(sources: dict[Path, ast.AST]) -> list[tuple[str, str]]:
    """Pairs of packages that import each other."""
    edges: dict[str, set[str]] = {}
    for path, tree in sources.items():
        for module, _ in imported_modules(path, tree):
            theirs = imported_package(module)
            if theirs and theirs != package_of(path):
                edges.setdefault(package_of(path), set()).add(theirs)
    return sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))


def package_cycles(sources: dict[Path, ast.AST]) -> list[list[str]]:
    """The knots of each package's module graph: sets of modules of one package that import one
    another (directly or round a longer loop), as sorted module names. An import of a name a package's
    ``__init__`` exports counts as an import of the ``__init__``; the parent packages that Python
    imports first do not count."""
    modules = MODULES | {module_name(path) for path in sources}
    graph: dict[str, set[str]] = {}
    for path, tree in sources.items():
        me = module_name(path)
        for module, _ in imported_modules(path, tree, modules):
            while module and module not in modules:  # a name inside a module: the module
                module = module.rpartition(".")[0]
            if module != me and imported_package(module) == package_of(path):
                graph.setdefault(me, set()).add(module)
    return _strongly_connected(graph)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                knots.append(sorted(component))

    for node in sorted(set(graph) | {m for targets in graph.values() for m in targets}):
        if node not in index:
            visit(node)
    return sorted(knots)


def impurities(path: Path, tree: ast.AST) -> list[str]:
    """What keeps an ``ops/`` module from holding pure functions: a torch.nn import, module-global
    state, a class swap."""
    found = [
        f"{path.name} imports {module}: ops define no modules"
        for module, _ in imported_modules(path, tree)
        if module in ("torch.nn", "torch.nn.modules")
    ]
    found += global_state(path, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            found.append(f"{path.name} swaps a class (line {node.lineno})")
    return found


def global_state(path: Path, tree: ast.AST) -> list[str]:
    return [
        f"{path.name} keeps module-global state (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Global)
    ]


def module_classes(module: types.ModuleType) -> list[str]:
    """The torch module classes a module defines (whatever nn was imported as)."""
    return [
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and issubclass(obj, nn.Module)
    ]


# ------------------------------------------------------------------------------------ layering


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
    assert mutual_imports({path: _parse(path) for path in _files()}) == []


def test_few_modules_import_each_other_inside_a_package():
    """A knot of modules that import one another (lazily or not) cannot be read one at a time: open
    it by moving what both need into a module of its own."""
    knots = package_cycles({path: _parse(path) for path in _files()})
    assert len(knots) <= MAX_PACKAGE_CYCLES, (
        f"{len(knots)} import cycles inside packages (at most {MAX_PACKAGE_CYCLES}):\n"
        + "\n".join(" <-> ".join(knot) for knot in knots)
    )


@pytest.mark.parametrize("path", _files("ops"), ids=lambda p: p.name)
def test_ops_are_pure_functions(path):
    assert impurities(path, _parse(path)) == []
    # and at run time: no class in the module is a torch module (whatever it was imported as)
    assert module_classes(importlib.import_module(f"attn2ssm.ops.{path.stem}")) == []


@pytest.mark.parametrize("path", _files("decode"), ids=lambda p: p.name)
def test_decode_keeps_no_module_global_state(path):
    assert global_state(path, _parse(path)) == []


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
        ("ops/x.py", "from attn2ssm.newpackage import thing", "package 'newpackage' has no rank"),
        # the three forms an import can also take: a subpackage imported by name ...
        ("student/x.py", "from attn2ssm import decode", "'student' (rank 4) may not import 'decode'"),
        ("mixers/x.py", "from attn2ssm import errors, student", "'mixers' (rank 2) may not import 'student'"),
        # ... a relative import ...
        ("student/x.py", "from ..decode import plan", "'student' (rank 4) may not import 'decode'"),
        (
            "student/sub/x.py",
            "def f():\n    from ...decode.plan import DecodePlan",
            "'student' (rank 4) may not import 'decode'",
        ),
        ("errors.py", "from . import decode", "'errors' (rank 0) may not import 'decode'"),
        # ... and importlib with a literal name
        (
            "eval/x.py",
            "import importlib\nq = importlib.import_module('attn2ssm.bench.quality')",
            "'eval' (rank 7) may not import 'bench'",
        ),
        (
            "mixers/x.py",
            "from importlib import import_module\ndef f():\n    return import_module('attn2ssm.decode')",
            "'mixers' (rank 2) may not import 'decode'",
        ),
        # what may pass
        (
            "student/x.py",
            "from attn2ssm.mixers.base import HeadRMSNorm\nfrom attn2ssm.student.cache import Attn2SSMCache",
            None,
        ),
        (
            "student/x.py",
            "from . import cache\nfrom .cache import Attn2SSMCache\nfrom .. import errors",
            None,
        ),
        (
            "student/x.py",
            "from attn2ssm import errors, ops\nimport importlib\nimportlib.import_module('.x')",
            None,
        ),
    ],
)
def test_the_checks_can_fail(where, source, expect):
    """The checker sees what it must: an upward import, a lazy one inside a function, an import of
    bench/export from elsewhere, a leaf importing upward, an unranked package, and each in every
    form an import takes; and lets a downward one through."""
    found = violations(ROOT / where, ast.parse(source))
    if expect is None:
        assert found == []
    else:
        assert any(expect in f for f in found), found


def test_the_mutual_import_check_can_fail():
    """Two packages importing each other are found, through any import form; one way is fine."""
    student, decode = ROOT / "student" / "x.py", ROOT / "decode" / "y.py"
    one_way = {student: ast.parse("import torch"), decode: ast.parse("from ..student import cache")}
    assert mutual_imports(one_way) == []
    both = {**one_way, student: ast.parse("def f():\n    from attn2ssm import decode")}
    assert mutual_imports(both) == [("decode", "student")]


def test_the_cycle_check_can_fail():
    """Modules of one package importing each other round a loop, in any form, make one knot; a loop
    through another package's module or a chain make none."""
    a, b, c = (ROOT / "distill" / f"knot_{n}.py" for n in "abc")
    chain = {
        a: ast.parse("from .knot_b import f"),
        b: ast.parse("from attn2ssm.distill import knot_c"),
        c: ast.parse("import attn2ssm.student.cache"),
    }
    assert package_cycles(chain) == []
    loop = {
        **chain,
        c: ast.parse(
            "def g():\n    import importlib\n    importlib.import_module('attn2ssm.distill.knot_a')"
        ),
    }
    assert package_cycles(loop) == [
        ["attn2ssm.distill.knot_a", "attn2ssm.distill.knot_b", "attn2ssm.distill.knot_c"]
    ]
    init = ROOT / "distill" / "knots" / "__init__.py"
    inner = ROOT / "distill" / "knots" / "inner.py"
    through_init = {
        init: ast.parse("from .inner import f"),
        inner: ast.parse("from attn2ssm.distill.knots import g"),
    }
    assert package_cycles(through_init) == [["attn2ssm.distill.knots", "attn2ssm.distill.knots.inner"]]


def test_the_purity_checks_can_fail():
    path = ROOT / "ops" / "x.py"
    assert impurities(path, ast.parse("import torch\ndef f(x):\n    return x")) == []
    for source, expect in [
        ("from torch import nn", None),  # reads nn from torch: the run-time check below sees its classes
        ("import torch.nn", "imports torch.nn"),
        ("X = 0\ndef f():\n    global X", "module-global state"),
        ("def f(m, c):\n    m.__class__ = c", "swaps a class"),
    ]:
        found = impurities(path, ast.parse(source))
        assert (found == []) if expect is None else any(expect in f for f in found), (source, found)
    assert global_state(ROOT / "decode" / "x.py", ast.parse("def f():\n    global CACHE")) != []
    module = types.ModuleType("attn2ssm.ops.fake")
    module.Layer = type("Layer", (nn.Module,), {"__module__": "attn2ssm.ops.fake"})
    module.Linear = nn.Linear  # imported, not defined here
    assert module_classes(module) == ["Layer"]


def test_test_modules_have_unique_names():
    """tests/ has no __init__.py files (pytest's default rootdir import), so two test modules with one
    basename in different folders stop collection of the whole suite."""
    tests = Path(__file__).parent
    clashes = basename_clashes(sorted(tests.rglob("test_*.py")))
    assert not clashes, "test modules share a basename: " + "; ".join(str(c) for c in clashes)


def basename_clashes(paths: list[Path]) -> list[tuple[Path, Path]]:
    seen: dict[str, Path] = {}
    clashes = []
    for path in paths:
        if path.name in seen:
            clashes.append((seen[path.name], path))
        seen[path.name] = path
    return clashes


def test_the_unique_name_check_can_fail():
    assert basename_clashes([Path("a/test_x.py"), Path("b/test_y.py")]) == []
    assert basename_clashes([Path("a/test_x.py"), Path("b/test_x.py")]) == [
        (Path("a/test_x.py"), Path("b/test_x.py"))
    ]


# ------------------------------------------------------------------------------------- sizes


def long_functions(path: Path, tree: ast.AST, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name:lines`` for every function in the file (methods and nested ones included) longer
    than ``limit`` lines, counted from its ``def`` to its last line (docstring included)."""
    return _long_nodes(path, tree, (ast.FunctionDef, ast.AsyncFunctionDef), limit)


def long_classes(path: Path, tree: ast.AST, limit: int = MAX_CLASS_LINES) -> list[str]:
    """``path:name:lines`` for every class in the file longer than ``limit`` lines."""
    return _long_nodes(path, tree, ast.ClassDef, limit)


def _long_nodes(path: Path, tree: ast.AST, kinds, limit: int) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(ROOT)}:{node.name}:{lines}")
    return found


def long_modules(paths: list[Path], limit: int, root: Path = ROOT) -> list[str]:
    """``path: lines`` for every file of more than ``limit`` lines (paths relative to ``root``)."""
    found = []
    for path in paths:
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_function_over_80_lines():
    offenders = [found for path in _files() for found in long_functions(path, _parse(path))]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(offenders)


def test_few_functions_over_60_lines():
    """The cap is a ceiling, not a target: functions rarely run past 60 lines."""
    long = [found for path in _files() for found in long_functions(path, _parse(path), LONG_FUNCTION_LINES)]
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {LONG_FUNCTION_LINES} lines (at most {MAX_LONG_FUNCTIONS}; split by job):\n"
        + "\n".join(long)
    )


def test_no_class_over_600_lines():
    offenders = [found for path in _files() for found in long_classes(path, _parse(path))]
    assert not offenders, f"classes over {MAX_CLASS_LINES} lines (split them by job):\n" + "\n".join(
        offenders
    )


def test_no_module_over_800_lines():
    offenders = long_modules(_files(), MAX_MODULE_LINES)
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them by job):\n" + "\n".join(
        offenders
    )


def test_cli_modules_are_short():
    """One module per command group, each short enough to read: a long group keeps subcommands in
    modules beside it (bench_generate, data_info, ...)."""
    long = long_modules(_files("cli"), MAX_CLI_MODULE_LINES)
    assert not long, f"cli modules over {MAX_CLI_MODULE_LINES} lines (split them): " + "; ".join(long)


def _function_source(name: str, lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_the_function_length_check_can_fail():
    """A method or a nested function counts; 80 lines (def included) pass, 81 do not; at 60 lines
    the same count."""
    method = "class C:\n" + _function_source("short", 3, "    ") + _function_source("long", 81, "    ")
    nested = "def outer():\n" + _function_source("inner", 81, "    ") + "    return inner\n"
    assert long_functions(ROOT / "x.py", ast.parse(method)) == ["x.py:long:81"]
    assert long_functions(ROOT / "x.py", ast.parse(nested)) == ["x.py:outer:83", "x.py:inner:81"]
    assert long_functions(ROOT / "x.py", ast.parse(_function_source("f", 80))) == []
    assert long_functions(ROOT / "x.py", ast.parse(_function_source("f", 61)), LONG_FUNCTION_LINES) == [
        "x.py:f:61"
    ]
    assert long_functions(ROOT / "x.py", ast.parse(_function_source("f", 60)), LONG_FUNCTION_LINES) == []


def test_the_class_and_module_length_checks_can_fail(tmp_path):
    """A class counts from ``class`` to its last line; a module by its lines: 800 pass, 801 do not."""
    big = "class Big:\n" + _function_source("a", 300, "    ") + _function_source("b", 300, "    ")
    assert long_classes(ROOT / "x.py", ast.parse(big)) == ["x.py:Big:601"]
    assert long_classes(ROOT / "x.py", ast.parse(big), 601) == []
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text(_function_source("f", 801))
    short.write_text(_function_source("f", 800))
    assert long_modules([long, short], MAX_MODULE_LINES, root=tmp_path) == ["long.py: 801 lines"]
