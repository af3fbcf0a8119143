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

One known fault is routed around: fla's gated chunk backward (the gated delta rule's and SSD's) is
wrong on Hopper GPUs under Triton 3.4–3.7.0 for 64-wide key tiles (fla refuses it for every width),
unless fla's TileLang backend takes the function for that op (``fla_gated_backward_problem``, per
op and dtype). There a gated delta rule call that will be differentiated runs fla with d_k
zero-padded to a multiple of 128 (128-wide tiles, correct; ops/fla.py, ``gated_delta_pads_keys``);
an SSD call runs the PyTorch form; inference keeps fla's unpadded kernels.

A run resolves the setting once (``choose_kernels``), logs it and records it; the student's mixers
then pass the resolved name to every chunked form (``backend=``), which ``resolve_backend``
turns into what runs for the tensors at hand. A student built inside ``building_with(name)`` (the
run's conversion, layer selection's probes, decay calibration: forwards made before the run hands
the student its setting) starts with that name (``default_kernels``), so ``kernels: torch`` holds
from the run's first forward.
"""

from __future__ import annotations

import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cache

from attn2ssm.devices import enable_tf32
from attn2ssm.errors import ConfigError

KERNELS = ("auto", "torch", "fla")
ENV = "ATTN2SSM_KERNELS"
_BUILDING: list[str] = []  # the names of the enclosing ``building_with`` blocks, innermost last


def default_kernels() -> str:
    """What a newly built student's mixers run: the innermost ``building_with``'s name, else
    ``ATTN2SSM_KERNELS`` (a name that is no kernel choice: one line), else ``auto``."""
    if _BUILDING:
        return _BUILDING[-1]
    env = os.environ.get(ENV)
    return check_kernels(env, ENV) if env else "auto"


def check_environment(device_type: str) -> None:
    """Refuse, before a model loads for ``device_type`` outside a run (eval, generate, export), an
    ``ATTN2SSM_KERNELS`` that is no kernel choice or that cannot run there (fla on a CPU, or fla
    that does not import): the one-line ``ConfigError`` of ``choose_kernels``."""
    if os.environ.get(ENV):
        choose_kernels("auto", device_type)


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
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (CUDA: devices.enable_tf32)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"kernels: {self.requested} -> {self.used} ({self.reason}){'; fp32 matmuls in TF32' if self.tf32 else ''}"


def check_kernels(value: str, where: str = "kernels") -> str:
    if value not in KERNELS:
        raise ConfigError(f"{where}={value!r} is not a kernel choice", f"use one of: {', '.join(KERNELS)}")
    return value


def choose_kernels(requested: str, device_type: str) -> KernelChoice:
    """Resolve ``requested`` (or ``ATTN2SSM_KERNELS``, which wins) for a run on ``device_type``; on
    CUDA the run's fp32 matmuls go to TF32 too (``devices.enable_tf32``), recorded in the choice."""
    choice = _choose(requested, device_type)
    return replace(choice, tf32=enable_tf32(device_type))


def _choose(requested: str, device_type: str) -> KernelChoice:
    env = os.environ.get(ENV)
    if env:
        requested = check_kernels(env, ENV)
    check_kernels(requested)
    on_gpu = device_type == "cuda" or _interpreted()
    if requested == "torch":
        return KernelChoice(requested, "torch", "as requested")
    if requested == "fla" and not on_gpu:
        if env:
            raise ConfigError(
                f"{ENV}=fla runs Triton kernels on CUDA, and this model runs on the CPU",
                f"unset {ENV} or set it to auto or torch on a CPU",
            )
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
                f"{ENV + '=fla' if env else 'kernels=fla'}, but {problem}",
                "pip install 'attn2ssm[gpu]' (fla-core, triton), or use kernels: torch",
            )
        return KernelChoice(requested, "fla", "as requested" + _gated_note(device_type))
    if problem:
        return KernelChoice(requested, "torch", problem)
    return KernelChoice(requested, "fla", "fla's Triton kernels import" + _gated_note(device_type))


def _gated_note(device_type: str) -> str:
    """The run's record of fla's known gated-backward fault on its GPU (resolve_backend acts on it),
    judged for 16-bit inputs (the mixed-precision case; fp32 SSD can still go to TileLang)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return ""
    device = torch.device("cuda", torch.cuda.current_device())
    gdn, ssd = (fla_gated_backward_problem(device, op, torch.bfloat16) for op in ("gated_delta", "ssd"))
    if not (gdn or ssd):
        return ""
    how = [
        *(["the gated delta rule trains through fla with d_k padded to 128"] if gdn else []),
        *(["SSD with the PyTorch form"] if ssd else []),
    ]
    return f"; {', '.join(how)}: {gdn or ssd}"


def resolve_backend(backend: str, tensor, *, gated_backward: bool = False, op: str | None = None) -> str:
    """What a chunked form runs for ``tensor``: ``fla`` only where it can (CUDA, or the interpreter
    on a CPU) and imports; ``auto`` picks it there; anything else runs the PyTorch form.
    ``gated_backward``: the call will be differentiated through fla's gated chunk backward of ``op``
    (``gated_delta`` or ``ssd``; None: either, taken as SSD, the cautious one); where ``fla_gated_backward_problem`` knows that backward to be wrong
    here, the gated delta rule keeps fla (its adapter pads d_k to 128, where the backward is right)
    and SSD runs the PyTorch form instead (``fla`` too: fla itself would refuse it), with a warning."""
    if backend == "torch":
        return "torch"
    if backend not in ("auto", "fla"):
        check_kernels(backend, "backend")
    usable = (tensor.is_cuda or _interpreted()) and fla_problem() is None
    if backend == "fla" and not usable:
        raise ConfigError(
            f"kernels=fla asked for a {tensor.device.type} tensor, where fla cannot run ({fla_problem() or 'not CUDA'})",
            f"run the model on CUDA, or use kernels auto or torch (unset {ENV} or set it to auto or torch)",
        )
    if usable and gated_backward and op not in PADDED_OPS:
        problem = fla_gated_backward_problem(tensor.device, op or "ssd", _call_dtype(tensor))
        if problem:
            _warn_once(f"the gated forms train with the PyTorch form: {problem}")
            return "torch"
    return "fla" if usable else "torch"


def _call_dtype(tensor):
    """The dtype fla's kernels will see for ``tensor``: autocast's where it is on (ops/fla.py's ``_one_dtype``)."""
    import torch

    device = tensor.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


def needs_backward(*tensors) -> bool:
    """Whether an op on ``tensors`` will be differentiated (grad mode on, one of them requires grad)."""
    import torch  # heavy: torch (this module is read by the CLI's flag checks)

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# fla's own guard (fla/ops/common/chunk_o.py, ``chunk_bwd_dqkwg``, fla issue #640): with a gate, the
# chunked backward gives wrong gradients on Hopper (compute capability 9.x) under Triton >= 3.4.0 and
# < 3.7.1, unless fla's TileLang backend takes that function; fla 0.6.0 raises there in the backward.
_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


@cache  # read once: the check runs in every training forward of a gated mixer on CUDA
def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:3])


def _capability(device) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


GATED_OPS = ("gated_delta", "ssd")  # the ops whose fla backward runs the gated ``chunk_bwd_dqkwg``
PADDED_OPS = ("gated_delta",)  # the ones that train through fla with d_k padded to 128 where it is wrong


def _tilelang_ready() -> bool:
    try:
        from fla.backends import TileLangBackend
    except ImportError:  # an fla without backends: no TileLang path
        return False
    return bool(TileLangBackend.is_available() and TileLangBackend().is_enabled())


def _tilelang_takes_over(op: str, dtype) -> bool:
    """Whether fla's TileLang backend takes ``op``'s gated ``chunk_bwd_dqkwg`` for inputs of ``dtype``.
    Its verifier wants the chunk states in the inputs' dtype: the gated delta rule keeps them so;
    SSD (``chunk_simple_gla``) keeps them in fp32, so TileLang takes SSD's backward only for fp32
    inputs and rejects it under bf16 / fp16, where fla's Triton kernel (and its refusal) runs."""
    import torch

    if op not in GATED_OPS:
        raise ValueError(f"op {op!r} is not one of {GATED_OPS}")
    if not _tilelang_ready():
        return False
    return op == "gated_delta" or dtype in (None, torch.float32)


def fla_gated_backward_problem(device, op: str = "gated_delta", dtype=None) -> str | None:
    """Why fla's gated chunk backward of ``op`` (``gated_delta`` | ``ssd``) must not train on
    ``device`` for inputs of ``dtype`` (None: fp32) as fla calls it (None: no known fault)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None  # the interpreter: no Hopper
    key = (_capability(device), _triton_version(), op, dtype)
    if key not in _GATED_CHECKED:
        (major, _), version = key[:2]
        bad = (
            major == 9 and _BAD_TRITON[0] <= version < _BAD_TRITON[1] and not _tilelang_takes_over(op, dtype)
        )
        _GATED_CHECKED[key] = (
            "fla's gated chunk backward is wrong on Hopper GPUs under Triton "
            f"{'.'.join(map(str, version))} (fla issue #640): install triton>=3.7.1 or tilelang for the fused kernels"
            if bad
            else None
        )
    return _GATED_CHECKED[key]


def gated_delta_pads_keys(device, dtype) -> bool:
    """Whether a differentiated gated delta rule call through fla on ``device`` pads d_k to a
    multiple of 128: where fla's unpadded backward is known wrong (``fla_gated_backward_problem``).
    The fault is Triton's code for 64-wide key tiles (fla issue #640: 32- and 128-wide tiles are
    right); fla on Hopper tiles d_k by min(next power of 2, 128), so a padded d_k gives 128-wide
    tiles. ``ops.fla.PAD_GATED_KEYS`` forces it either way (the CPU tests, where this is never true)."""
    return fla_gated_backward_problem(device, "gated_delta", dtype) is not None


_GATED_CHECKED: dict = {}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
