"""Which reduced precision is fast here: ``mixed_precision: auto`` and the slow-bf16 warning.

bf16 autocast pays where the hardware multiplies bf16 natively: CUDA GPUs that support it, and
CPUs with AVX512-BF16 or AMX (oneDNN uses them). Elsewhere — AVX2-only x86 (most AMD Zen 2/3,
many Intel client CPUs), most ARM — PyTorch emulates bf16 and a bf16 ``Linear`` runs ~9-20x
slower than fp32, which turns a 9-minute ``make demo`` into hours.

``auto`` therefore picks bf16 on CUDA with bf16 support and on a CPU whose one-off micro-benchmark
(a ``Linear(576 -> 1536)`` forward + backward, fp32 against bf16 autocast) shows bf16 clearly
faster; otherwise fp32 (``no``). An x86 CPU without the AVX512-BF16/AMX flags is fp32 without
benchmarking. The benchmark is cached per machine (CPU model, torch version and the oneDNN / ATen
ISA caps in the environment), so it costs ~1 s once. An explicit ``bf16`` where it is slow warns
once, with the measured slowdown.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from functools import cache
from typing import TYPE_CHECKING

from attn2ssm.paths import atomic_write_text, cache_dir

if TYPE_CHECKING:
    import torch

PRECISIONS = ("auto", "no", "bf16", "fp16")
BF16_MIN_SPEEDUP = (
    1.2  # auto takes bf16 on a CPU only when its fwd+bwd is at least this much faster than fp32
)


@dataclass(frozen=True)
class Bf16Probe:
    """One machine's measured fp32 and bf16-autocast time of the probe layer (forward + backward)."""

    fp32_ms: float
    bf16_ms: float

    @property
    def speedup(self) -> float:
        """fp32 time / bf16 time: > 1 where bf16 is faster."""
        return self.fp32_ms / self.bf16_ms


@dataclass(frozen=True)
class PrecisionChoice:
    requested: str  # what the recipe or flag asked for
    used: str  # no | bf16 | fp16: what the run uses
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        label = {"no": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}[self.used]
        return f"mixed precision: {self.requested} -> {label} ({self.reason})"


def cpu_native_bf16() -> bool | None:
    """True/False where the CPU's flags tell (x86: AVX512-BF16 or AMX tiles), None where they cannot."""
    import torch  # heavy: this module is imported by recipe validation, which must stay light

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return None
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _machine_key() -> str:
    """What the probe's answer depends on: the CPU, torch, and the ISA caps a user may set."""
    import torch  # heavy: this module is imported by recipe validation, which must stay light

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model
            )
    except OSError:
        pass
    parts = [
        model,
        platform.machine(),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        os.environ.get("DNNL_MAX_CPU_ISA", ""),
        os.environ.get("ATEN_CPU_CAPABILITY", ""),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _measure_bf16(repeats: int = 3) -> Bf16Probe:
    """Min-of-``repeats`` time of a Linear(576 -> 1536) forward + backward on 256 tokens, fp32 and under bf16 autocast."""
    import torch  # heavy: this module is imported by recipe validation, which must stay light

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(576, 1536)
    x = torch.randn(256, 576, generator=gen, requires_grad=True)

    def best(bf16: bool) -> float:
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                y = layer(x)
            y.float().square().mean().backward()
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        return 1e3 * min(times)

    return Bf16Probe(fp32_ms=best(False), bf16_ms=best(True))


@cache
def cpu_bf16_probe() -> Bf16Probe:
    """This machine's bf16 probe, measured once and kept in the attn2ssm cache."""
    path = cache_dir() / "precision_probe.json"
    key = _machine_key()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), dict):
        try:
            return Bf16Probe(**known[key])
        except TypeError:
            pass
    probe = _measure_bf16()
    known = known if isinstance(known, dict) else {}
    known[key] = asdict(probe)
    try:
        atomic_write_text(path, json.dumps(known, indent=1))
    except OSError:  # a read-only cache only costs the probe again next time
        pass
    return probe


def choose_precision(requested: str, device: torch.device | str) -> PrecisionChoice:
    """Resolve ``requested`` (auto | no | bf16 | fp16) for ``device``; explicit values stay as asked."""
    import torch  # heavy: this module is imported by recipe validation, which must stay light

    device = torch.device(device)
    if requested != "auto":
        return PrecisionChoice(requested, requested, "as requested")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("auto", "bf16", f"{torch.cuda.get_device_name(device)} supports bf16")
        return PrecisionChoice("auto", "no", f"{torch.cuda.get_device_name(device)} has no bf16")
    if device.type != "cpu":
        return PrecisionChoice("auto", "no", f"no bf16 rule for device type '{device.type}'")
    if cpu_native_bf16() is False:
        return PrecisionChoice(
            "auto", "no", "this CPU has no AVX512-BF16/AMX, so bf16 would be emulated and slower than fp32"
        )
    probe = cpu_bf16_probe()
    if probe.speedup >= BF16_MIN_SPEEDUP:
        return PrecisionChoice(
            "auto", "bf16", f"bf16 measured {probe.speedup:.1f}x faster than fp32 on this CPU"
        )
    if probe.speedup >= 1.0:
        return PrecisionChoice(
            "auto",
            "no",
            f"bf16 measured only {probe.speedup:.1f}x faster than fp32 on this CPU (auto wants {BF16_MIN_SPEEDUP}x)",
        )
    return PrecisionChoice(
        "auto", "no", f"bf16 measured {1 / probe.speedup:.1f}x the time of fp32 on this CPU"
    )


_warned: set[str] = set()


def warn_if_slow_bf16(device: torch.device | str, what: str, advice: str) -> Bf16Probe | None:
    """Warn once per ``what`` when bf16 was asked for on a CPU where its matrix products are slower
    than fp32, with the measured slowdown and ``advice``; return the probe then (else None)."""
    import torch  # heavy: this module is imported by recipe validation, which must stay light

    if torch.device(device).type != "cpu" or what in _warned:
        return None
    probe = cpu_bf16_probe()
    if probe.speedup >= 1.0:
        return None
    _warned.add(what)
    warnings.warn(
        f"{what}: bf16 matrix products on this CPU (no native bf16 in use) measured {1 / probe.speedup:.1f}x the time of fp32 "
        f"({probe.bf16_ms:.1f} vs {probe.fp32_ms:.1f} ms, Linear(576->1536) on 256 tokens); {advice}",
        stacklevel=2,
    )
    return probe
