"""Which kernels the chunked forms run: the one dispatch point.

``kernels`` is ``auto`` | ``torch`` | ``fla`` (a recipe key, ``--kernels`` on the commands that
run models, or ``ATTN2SSM_KERNELS`` in the environment, which wins):

* ``torch`` — attn2ssm's PyTorch forms (ops/*.py): the reference and the CPU default;
* ``fla`` — flash-linear-attention's Triton kernels through ops/fla.py (CUDA; on a CPU only under
  Triton's interpreter, for tests): linear attention, Mamba-2 / HedgeMamba SSD, the short conv,
  the gated delta rule. Where fla has no kernel for a form (LoLCATs' window + linear, whose window
  row max is part of the model; Mamba-1's per-channel scan, which uses mamba_ssm where it imports)
  the PyTorch form runs;
* ``auto`` — ``fla`` on CUDA when it imports, else ``torch``.

A run resolves the setting once (``choose_kernels``), logs it and records it; the student's mixers
then pass the resolved name to every chunked form (``backend=``), which ``resolve_backend``
turns into what runs for the tensors at hand. A student built inside ``building_with(name)`` (the
run's conversion, layer selection's probes, decay calibration: forwards made before the run hands
the student its setting) starts with that name (``default_kernels``), so ``kernels: torch`` holds
from the run's first forward.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache

from attn2ssm.errors import ConfigError

KERNELS = ("auto", "torch", "fla")
ENV = "ATTN2SSM_KERNELS"
_BUILDING: list[str] = []  # the names of the enclosing ``building_with`` blocks, innermost last


def default_kernels() -> str:
    """What a newly built student's mixers run: the innermost ``building_with``'s name, else
    ``ATTN2SSM_KERNELS``, else ``auto``."""
    return _BUILDING[-1] if _BUILDING else os.environ.get(ENV, "auto")


@contextmanager
def building_with(kernels: str):
    """Students built inside start with ``kernels`` (a run's resolved choice) instead of the default."""
    _BUILDING.append(check_kernels(kernels))
    try:
        yield
    finally:
        _BUILDING.pop()


@cache
def fla_problem() -> str | None:
    """Why fla's kernels cannot run here (None: they import)."""
    try:
        with warnings.catch_warnings():  # fla warns at import where no GPU driver is (the interpreter's case)
            warnings.simplefilter("ignore")
            import fla.modules.causal_conv1d  # noqa: F401  (optional: attn2ssm[gpu])
            import fla.ops.gated_delta_rule  # noqa: F401
            import fla.ops.simple_gla  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - not installed, or installed without a working triton
        return f"fla does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelChoice:
    requested: str
    used: str  # torch | fla
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"kernels: {self.requested} -> {self.used} ({self.reason})"


def check_kernels(value: str, where: str = "kernels") -> str:
    if value not in KERNELS:
        raise ConfigError(f"{where}={value!r} is not a kernel choice", f"use one of: {', '.join(KERNELS)}")
    return value


def choose_kernels(requested: str, device_type: str) -> KernelChoice:
    """Resolve ``requested`` (or ``ATTN2SSM_KERNELS``, which wins) for a run on ``device_type``."""
    env = os.environ.get(ENV)
    if env:
        requested = check_kernels(env, ENV)
    check_kernels(requested)
    on_gpu = device_type == "cuda" or _interpreted()
    if requested == "torch":
        return KernelChoice(requested, "torch", "as requested")
    if requested == "fla" and not on_gpu:
        raise ConfigError(
            "kernels=fla runs Triton kernels on CUDA, and this run is on the CPU",
            "use kernels: auto or torch on a CPU",
        )
    if not on_gpu:
        return KernelChoice(requested, "torch", "on the CPU the PyTorch forms are the kernels")
    problem = fla_problem()
    if requested == "fla":
        if problem:
            raise ConfigError(
                f"kernels=fla, but {problem}",
                "pip install 'attn2ssm[gpu]' (fla-core, triton), or use kernels: torch",
            )
        return KernelChoice(requested, "fla", "as requested")
    if problem:
        return KernelChoice(requested, "torch", problem)
    return KernelChoice(requested, "fla", "fla's Triton kernels import")


def resolve_backend(backend: str, tensor) -> str:
    """What a chunked form runs for ``tensor``: ``fla`` only where it can (CUDA, or the interpreter
    on a CPU) and imports; ``auto`` picks it there; anything else runs the PyTorch form."""
    if backend == "torch":
        return "torch"
    if backend not in ("auto", "fla"):
        raise ValueError(f"backend must be one of {KERNELS}, got {backend!r}")
    usable = (tensor.is_cuda or _interpreted()) and fla_problem() is None
    if backend == "fla" and not usable:
        raise RuntimeError(
            f"backend 'fla' asked for a {tensor.device.type} tensor, where fla cannot run ({fla_problem() or 'not CUDA'})"
        )
    return "fla" if usable else "torch"
