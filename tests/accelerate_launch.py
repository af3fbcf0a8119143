"""The ``accelerate launch`` command the multi-process trainer tests run (tests/distill/).

On a machine without GPUs ``--multi_gpu`` spawns torch.distributed workers that use gloo on the CPU
(accelerate's ``--cpu`` with several processes would need mpirun); with ``config_file`` the launch
takes its distributed settings from that accelerate config instead (FSDP).
"""

from __future__ import annotations

import sys
from pathlib import Path


def accelerate_launch(*target: str | Path, processes: int = 2, config_file: Path | None = None) -> list[str]:
    """argv that runs ``target`` (a script and its arguments, or ``"-m", module, …``) in ``processes``
    processes on this machine, without mixed precision (and without dynamo on the ``--multi_gpu`` path)."""
    if config_file is None:
        how = ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    else:
        how = ["--config_file", str(config_file)]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *how,
        "--num_processes",
        str(processes),
        "--mixed_precision",
        "no",
        *map(str, target),
    ]
