"""The slow tests' view of the user's real attn2ssm cache (the built-in teacher, llama.cpp).

Fast tests run on a private throwaway cache (conftest.py); the slow ones that need the converted
built-in teacher or the llama.cpp build read ``$ATTN2SSM_REAL_CACHE`` (default ``~/.cache/attn2ssm``)
and skip, naming the command that provides what is missing.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import pytest

# Prompts the llama.cpp tests generate from (State of the Union openings, the built-in teacher's domain).
PROMPTS = [
    "The state of the Union is",
    "In the beginning of the year, the Congress",
    "My fellow citizens, tonight",
]


def real_cache() -> Path:
    return Path(os.environ.get("ATTN2SSM_REAL_CACHE", str(Path.home() / ".cache" / "attn2ssm")))


def needs_llama_cpp() -> Path:
    """llama.cpp's source tree of the installed llama-cpp-python (its converter and gguf-py), or skip."""
    from attn2ssm.export.llamacpp import LLAMA_CPP_PYTHON, runtime_version

    if find_spec("llama_cpp") is None:
        pytest.skip(
            "llama_cpp is not importable: run 'make llama-cpp' (builds llama-cpp-python into the venv, ~8 min on 2 cores)"
        )
    root = (
        real_cache()
        / "llama-cpp"
        / f"llama_cpp_python-{runtime_version() or LLAMA_CPP_PYTHON}"
        / "vendor"
        / "llama.cpp"
    )
    if not (root / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not in {root}: run 'make llama-cpp'")
    return root
