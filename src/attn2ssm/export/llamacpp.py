"""llama.cpp: its own HF → GGUF converter, quantiser and runtime, as ``llama-cpp-python`` ships them.

``make llama-cpp`` downloads the ``llama-cpp-python`` sdist (it vendors llama.cpp whole), keeps it
unpacked under attn2ssm's cache and builds the package from it into the venv (CPU). From that one
download we run llama.cpp's ``convert_hf_to_gguf.py`` (with its own ``gguf-py``, not PyPI's
``gguf``) and its ``gguf_set_metadata.py`` as subprocesses, quantise with
``llama_cpp.llama_model_quantize`` (the pip build has no ``llama-quantize`` binary) and decode with
``llama_cpp.Llama``. Nothing of llama.cpp is copied here. ``$ATTN2SSM_LLAMA_CPP`` may point at
another llama.cpp checkout for the converter.

Import-light: ``llama_cpp`` and torch load only when a function needs them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

from attn2ssm.errors import Attn2SSMError
from attn2ssm.paths import cache_dir

LLAMA_CPP_PYTHON = "0.3.36"  # the Makefile's LLAMA_CPP_PYTHON: what 'make llama-cpp' builds
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert_hf_to_gguf.py --outtype
# Further types through llama_model_quantize (name → llama_ftype; llama.h's LLAMA_FTYPE_MOSTLY_*).
QUANTIZE_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
OUTTYPES = (*CONVERTER_TYPES, *QUANTIZE_TYPES)
_MAKE = (
    "run 'make llama-cpp' (downloads the llama-cpp-python sdist, builds it into the venv: ~8 min on 2 cores)"
)


class LlamaCppMissing(Attn2SSMError):
    """llama.cpp's converter or runtime is not installed."""


def llama_cpp_source_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    """Where ``make llama-cpp`` keeps the unpacked ``llama-cpp-python`` sdist of ``version``."""
    return cache_dir() / "llama-cpp" / f"llama_cpp_python-{version}"


def runtime_version() -> str | None:
    """The installed ``llama_cpp``'s version, or None (without importing its shared library)."""
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return None


def converter_dir() -> Path:
    """The llama.cpp tree whose ``convert_hf_to_gguf.py`` and ``gguf-py`` we run: ``$ATTN2SSM_LLAMA_CPP``,
    else the sdist of the installed ``llama_cpp`` (converter and runtime from one release), else
    that of ``LLAMA_CPP_PYTHON``. A one-line ``LlamaCppMissing`` naming ``make llama-cpp`` if absent."""
    env = os.environ.get("ATTN2SSM_LLAMA_CPP")
    if env:
        root = Path(env).expanduser()
        if not (root / "convert_hf_to_gguf.py").is_file():
            raise LlamaCppMissing(
                f"$ATTN2SSM_LLAMA_CPP={env} has no convert_hf_to_gguf.py",
                "point it at a llama.cpp checkout, or unset it and " + _MAKE,
            )
        return root
    version = runtime_version() or LLAMA_CPP_PYTHON
    root = llama_cpp_source_dir(version) / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppMissing(
            f"llama.cpp's converter (llama-cpp-python {version}'s convert_hf_to_gguf.py) is not in {root.parent.parent}",
            _MAKE,
        )
    return root


def load_runtime():
    """``import llama_cpp``, or a one-line ``LlamaCppMissing`` naming ``make llama-cpp``."""
    try:
        import llama_cpp  # optional: llama-cpp-python ('make llama-cpp')
    except ImportError as exc:
        raise LlamaCppMissing(
            f"llama-cpp-python is not importable ({exc.__class__.__name__}: {exc})", _MAKE
        ) from None
    return llama_cpp


class ToolFailed(Attn2SSMError):
    """One of llama.cpp's Python tools exited with an error; ``cmd`` is what ran."""

    def __init__(self, problem: str, cmd: list[str]):
        super().__init__(
            problem, "see the message; run the command by hand for the full log: " + shlex.join(cmd)
        )
        self.cmd = cmd


def _run(cmd: list[str], what: str) -> str:
    """Run one of llama.cpp's Python tools; its last error line becomes a one-line ``ToolFailed``."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line] or lines
        raise ToolFailed(
            f"{what} failed (exit {result.returncode}): {(errors or ['no output'])[-1][:300]}", cmd
        )
    return result.stderr


def convert_hf(
    hf_dir: str | Path, out: str | Path, outtype: str = "f16", converter_args: tuple[str, ...] = ()
) -> Path:
    """A transformers checkpoint directory to a GGUF file through llama.cpp's own converter
    (``outtype`` one of ``CONVERTER_TYPES``; the others through ``quantize`` after an f32 pass);
    ``converter_args``: more of its flags (e.g. ``--no-mtp`` for a Qwen3.5 without MTP layers)."""
    if outtype not in CONVERTER_TYPES:
        raise Attn2SSMError(
            f"{outtype!r} is not one of the converter's outtypes {CONVERTER_TYPES}",
            "convert to f32, then quantize()",
        )
    cmd = [
        sys.executable,
        str(converter_dir() / "convert_hf_to_gguf.py"),
        str(hf_dir),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        *converter_args,
    ]
    _run(cmd, "llama.cpp's convert_hf_to_gguf.py")
    return Path(out)


def set_metadata(path: str | Path, key: str, value) -> None:
    """Set one scalar metadata value of a GGUF file in place with llama.cpp's gguf_set_metadata.py."""
    root = converter_dir()
    script = root / "gguf-py" / "gguf" / "scripts" / "gguf_set_metadata.py"
    _run(
        [sys.executable, str(script), str(path), key, str(value), "--force"],
        f"llama.cpp's gguf_set_metadata.py ({key})",
    )


def read_metadata(path: str | Path) -> dict:
    """The GGUF file's scalar metadata (key → value) through llama.cpp's gguf-py reader."""
    root = converter_dir()
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from gguf import GGUFReader, GGUFValueType\n"
        "r = GGUFReader(sys.argv[2]); out = {}\n"
        "for k, f in r.fields.items():\n"
        "    if f.types and f.types[0] not in (GGUFValueType.ARRAY,):\n"
        "        v = f.contents()\n"
        "        out[k] = v if isinstance(v, (int, float, str, bool)) else str(v)\n"
        "print(json.dumps(out))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(root / "gguf-py"), str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise Attn2SSMError(
            f"could not read {path}'s GGUF metadata: {(result.stderr.strip().splitlines() or ['?'])[-1]}",
            "check that it is a GGUF file",
        )
    return json.loads(result.stdout)


def quantize(src: str | Path, dst: str | Path, qtype: str, threads: int | None = None) -> Path:
    """``src`` (an f32/f16 GGUF) quantised to ``qtype`` (``QUANTIZE_TYPES``) with llama.cpp's
    ``llama_model_quantize``; llama.cpp keeps the tensors it does not quantise (norms, SSM A/D/conv) as they are."""
    if qtype not in QUANTIZE_TYPES:
        raise Attn2SSMError(
            f"{qtype!r} is not a quantisation type here", f"choose one of {', '.join(QUANTIZE_TYPES)}"
        )
    llama_cpp = load_runtime()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZE_TYPES[qtype]
    params.nthread = threads or 0
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise Attn2SSMError(
            f"llama_model_quantize could not write {qtype} from {src}",
            "check that the source is an f32/f16/bf16 GGUF",
        )
    return Path(dst)


def to_gguf(
    hf_dir: str | Path,
    out: str | Path,
    outtype: str,
    work: str | Path,
    threads: int | None = None,
    converter_args: tuple[str, ...] = (),
) -> Path:
    """``hf_dir`` → ``out`` at ``outtype`` (any of ``OUTTYPES``): the converter, then ``quantize``
    from f32 where the converter has no such type. ``work``: a folder for the f32 intermediate."""
    if outtype in CONVERTER_TYPES:
        return convert_hf(hf_dir, out, outtype, converter_args)
    f32 = convert_hf(hf_dir, Path(work) / "f32.gguf", "f32", converter_args)
    try:
        return quantize(f32, out, outtype, threads)
    finally:
        f32.unlink(missing_ok=True)


def environment() -> dict:
    """What a benchmark or export records about llama.cpp: versions, the converter's tree, CPU features."""
    info = {"llama_cpp_python": runtime_version()}
    try:
        info["converter"] = str(converter_dir() / "convert_hf_to_gguf.py")
    except LlamaCppMissing:
        info["converter"] = None
    if info["llama_cpp_python"]:
        try:
            info["system_info"] = load_runtime().llama_print_system_info().decode().strip()
        except (LlamaCppMissing, OSError, AttributeError):
            pass
    return info


# ------------------------------------------------------------------------------------- runtime
_LOGITS = """
import sys, numpy as np
from attn2ssm.export.llamacpp import GGUFModel
tokens = [int(t) for t in sys.argv[2].split(",")]
model = GGUFModel(sys.argv[1], n_ctx=max(32, len(tokens)), logits_all=True, flash_attn=False, kv_type="f32")
model.feed(tokens)
np.save(sys.argv[3], model.all_logits())
model.close()  # before interpreter shutdown, where llama_cpp's own __del__ finds its library gone
"""


def logits_in_subprocess(path: str | Path, tokens: list[int]):
    """(len(tokens), n_vocab) float32 logits of ``tokens`` from the GGUF in llama.cpp, run in a child
    process (an f32 KV cache, no flash attention: only the weights' type differs from float32 math)
    so that a llama.cpp abort (GGML_ASSERT) is a one-line error here, not the end of this process."""
    load_runtime()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        result = subprocess.run(
            [sys.executable, "-c", _LOGITS, str(path), ",".join(map(str, tokens)), str(out)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0 or not out.exists():
            lines = [
                line.strip()
                for line in result.stderr.splitlines()
                if "GGML_ASSERT" in line or "Error" in line
            ] or result.stderr.strip().splitlines()[-1:]
            raise Attn2SSMError(
                f"llama.cpp could not run {Path(path).name} (exit {result.returncode}): {(lines or ['no output'])[0][:300]}",
                "the GGUF is not usable in this llama.cpp; report it with the student's config.json",
            )
        return np.load(out)


_GGML_TYPES = {"f32": 0, "f16": 1}  # ggml.h's GGML_TYPE_F32 / GGML_TYPE_F16


class GGUFModel:
    """One GGUF in ``llama_cpp.Llama`` with a context of ``n_ctx`` tokens: feed tokens, read the last
    token's logits, save and restore the whole context state (KV cells and recurrent states)."""

    def __init__(
        self,
        path: str | Path,
        n_ctx: int,
        threads: int | None = None,
        *,
        logits_all: bool = False,
        flash_attn: bool = True,
        n_batch: int = 512,
        kv_type: str | None = None,
    ):
        """``kv_type``: the KV cache's type, "f32" or "f16" (None: llama.cpp's default, f16)."""
        llama_cpp = load_runtime()
        self._lib = llama_cpp
        self.path = Path(path)
        kv = {} if kv_type is None else {"type_k": _GGML_TYPES[kv_type], "type_v": _GGML_TYPES[kv_type]}
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            flash_attn=flash_attn,
            verbose=False,
            **kv,
        )
        self.n_vocab = self.llm.n_vocab()

    def feed(self, tokens: list[int]) -> None:
        """Run ``tokens`` after those already in the context (prefill in n_batch pieces, or one step)."""
        self.llm.eval(tokens)

    def last_logits(self):
        """The float32 logits (numpy, n_vocab) after the last token fed."""
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def all_logits(self):
        """(tokens fed, n_vocab) logits of every position (needs ``logits_all``)."""
        return self.llm.scores[: self.llm.n_tokens].copy()

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt`` from an empty context."""
        self.reset()
        self.feed(prompt)
        out = []
        for i in range(new_tokens):
            out.append(int(self.last_logits().argmax()))
            if i + 1 < new_tokens:
                self.feed(out[-1:])
        return out

    def reset(self) -> None:
        """Empty the context (recurrent states cleared now, KV cells at the next ``feed``)."""
        self.llm.reset()

    def state(self) -> tuple[bytes, int]:
        """(the context's state, tokens in it): llama.cpp's own serialisation (llama_state_get_data)."""
        lib, ctx = self._lib, self.llm.ctx
        size = lib.llama_state_get_size(ctx)
        buf = (lib.ctypes.c_uint8 * int(size))()
        n = lib.llama_state_get_data(ctx, buf, size)
        return bytes(buf[: int(n)]), self.llm.n_tokens

    def restore(self, saved: tuple[bytes, int]) -> None:
        data, n_tokens = saved
        lib = self._lib
        buf = (lib.ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if lib.llama_state_set_data(self.llm.ctx, buf, len(data)) != len(data):
            raise Attn2SSMError(
                f"llama.cpp could not restore a saved state of {self.path.name}", "this is a bug: report it"
            )
        self.llm.n_tokens = n_tokens

    def close(self) -> None:
        self.llm.close()
