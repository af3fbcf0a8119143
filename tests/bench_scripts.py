"""Scripts under ``benchmarks/`` loaded as modules for their tests (the folder is not a package).

``load_benchmark("mqar.py")`` executes the script under the module name ``bench_mqar``, registered in
``sys.modules`` (dataclasses and pickling look their module up there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(filename: str) -> ModuleType:
    path = BENCHMARKS / filename
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}: name one under {BENCHMARKS}")
    name = f"bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
