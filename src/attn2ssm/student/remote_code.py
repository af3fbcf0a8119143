"""Write the student's modeling code next to a checkpoint, flattened for ``trust_remote_code``.

transformers copies the file named in ``auto_map`` plus the files it imports *relatively from the
same folder*. Our modeling code lives in a package (``attn2ssm.student.modeling`` importing
``attn2ssm.mixers…``, ``attn2ssm.ops…``), so we copy its import closure as flat files named
after their dotted path (``attn2ssm.ops.rope`` → ``attn2ssm_ops_rope.py``) and rewrite each
``from attn2ssm.x.y import …`` into ``from .attn2ssm_x_y import …``. The result loads in a
process where attn2ssm is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT_MODULES = ("attn2ssm.student.configuration", "attn2ssm.student.modeling")
_IMPORT_RE = re.compile(r"^(\s*)from\s+(attn2ssm(?:\.\w+)*)\s+import\s+", re.MULTILINE)


def flat_name(module: str) -> str:
    return module.replace(".", "_")


def auto_map() -> dict[str, str]:
    return {
        "AutoConfig": f"{flat_name('attn2ssm.student.configuration')}.Attn2SSMConfig",
        "AutoModel": f"{flat_name('attn2ssm.student.modeling')}.Attn2SSMModel",
        "AutoModelForCausalLM": f"{flat_name('attn2ssm.student.modeling')}.Attn2SSMForCausalLM",
    }


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find source of {module}")
    return Path(spec.origin).read_text(encoding="utf-8")


def _attn2ssm_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "attn2ssm"
            and node.level == 0
        ):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "attn2ssm":
                    raise ValueError(
                        f"use 'from {alias.name} import …' in modeling code, not 'import {alias.name}'"
                    )
    return found


def closure(roots=ROOT_MODULES) -> dict[str, str]:
    """Module name → source, for the roots and every attn2ssm module they import."""
    todo, seen = list(roots), {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen[module] = _source(module)
        todo.extend(_attn2ssm_imports(seen[module]) - set(seen))
    return seen


def write_remote_code(directory: str | Path, roots=ROOT_MODULES) -> list[Path]:
    """Write the flattened modeling files of ``roots`` (and what they import) into ``directory``;
    returns their paths. Image-classification students pass their own roots (student/vision.py)."""
    directory = Path(directory)
    if not __name__.startswith("attn2ssm."):
        # Running from an already flattened copy (a checkpoint loaded with trust_remote_code):
        # our siblings are the flat files, copy them as they are.
        written = []
        for src in sorted(Path(__file__).parent.glob("attn2ssm_*.py")):
            dst = directory / src.name
            if src.resolve() != dst.resolve():
                dst.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
            written.append(dst)
        return written
    written = []
    for module, source in sorted(closure(roots).items()):
        flat = _IMPORT_RE.sub(lambda m: f"{m.group(1)}from .{flat_name(m.group(2))} import ", source)
        path = directory / f"{flat_name(module)}.py"
        path.write_text(flat, encoding="utf-8")
        written.append(path)
    return written
