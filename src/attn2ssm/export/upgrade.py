"""``attn2ssm upgrade DIR``: refresh a saved student's modeling code with this attn2ssm's.

Kept out of export.py on purpose: export.py is copied into every checkpoint, this is not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from attn2ssm.errors import CheckpointError, OutputError
from attn2ssm.paths import atomic_write_text, check_writable, remove_stale_staging, staging_beside, writing
from attn2ssm.student.remote_code import auto_map, write_remote_code

AGAIN = "run attn2ssm upgrade again (the checkpoint still loads as it was)"


def check_upgradable(directory: str | Path) -> dict:
    """``directory``'s config.json if it is an attn2ssm student that ``upgrade_remote_code`` can
    write to; else a one-line ``CheckpointError`` (not a student) or ``OutputError`` (not writable)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory} has no config.json", "point attn2ssm upgrade at a saved student directory"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{config_path} is not readable JSON ({error})", "restore the checkpoint's config.json"
        ) from None
    if config.get("model_type") != "attn2ssm":
        raise CheckpointError(
            f"{directory} holds a {config.get('model_type', 'unknown')!r} model, not an attn2ssm student",
            "attn2ssm upgrade refreshes students written by attn2ssm (model_type 'attn2ssm')",
        )
    try:
        check_writable(directory, flag="DIR")
    except OutputError as error:
        raise OutputError(error.problem, f"make {directory} writable, then {AGAIN}") from None
    return config


def upgrade_remote_code(directory: str | Path) -> list[Path]:
    """Refresh a saved student's modeling code in place with this attn2ssm's (``attn2ssm upgrade``).

    Checkpoints carry the code of the attn2ssm that saved them; code written before hf_compat.py
    decodes without its recurrent state under transformers >= 5.24. ``check_upgradable`` first (a
    read-only folder is one line before anything is written). The new files are written beside the
    checkpoint first and each moved over its old copy (``os.replace``), then ``config.json``'s
    ``auto_map`` is updated the same way, so a failure leaves a loadable checkpoint (and a write the
    OS refuses is a one-line ``OutputError``); flat files the new code no longer uses are removed
    last. Weights are untouched."""
    directory = Path(directory)
    config = check_upgradable(directory)
    config_path = directory / "config.json"
    old = set(directory.glob("attn2ssm_*.py"))
    with writing(directory, "the refreshed modeling code", AGAIN):
        remove_stale_staging(directory)  # what a killed upgrade left
        with staging_beside(config_path, "upgrade") as staging:
            fresh = write_remote_code(staging)
            written = []
            for path in fresh:
                target = directory / path.name
                os.replace(path, target)
                written.append(target)
        config["auto_map"] = auto_map()
        atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for stale in old - set(written):
            stale.unlink()
    return written
