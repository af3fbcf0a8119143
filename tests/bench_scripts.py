"""Scripts under ``benchmarks/`` loaded as modules for their tests (the folder is not a package).

``load_benchmark("mqar.py")`` executes the script once per call under a module name of its own,
registered in ``sys.modules`` (dataclasses and pickling look their module up there); scripts that
import a sibling script (``alignment_comparison.py``) get ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_path(relpath: str) -> Path:
    path = BENCHMARKS / relpath
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}: name one under {BENCHMARKS}")
    return path


def load_benchmark(relpath: str, name: str | None = None, *, siblings: bool = False) -> ModuleType:
    path = benchmark_path(relpath)
    if siblings and str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    name = name or f"bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
