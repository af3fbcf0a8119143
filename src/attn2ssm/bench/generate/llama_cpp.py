"""``bench generate --backend llama.cpp``: every model a GGUF in ``llama_cpp.Llama``
(``LlamaCppBench``, a ``DecodeBackend`` like the torch one), built from the teacher and its
untrained students or reused from ``--gguf-dir``, decoded on the CPU into the torch backend's rows."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from attn2ssm.bench.generate.models import LLAMA_CPP_STUDENT_OPTIONS, STUDENTS, BenchSettings, prompt_ids
from attn2ssm.bench.generate.timing import DecodeBackend, Memory, decode_by_context


class LlamaCppBench(DecodeBackend):
    """A GGUF behind ``prefill`` / ``decode_round``, giving the rows an HF model gives. Each prefill
    opens a llama.cpp context just large enough for the prompt and the decoded tokens."""

    def __init__(self, path, threads: int | None, new_tokens: int, flash_attn: bool = True):
        self.path, self.threads, self.new_tokens, self.flash_attn = (
            Path(path),
            threads,
            new_tokens,
            flash_attn,
        )

    def prefill(self, prompt: torch.Tensor) -> dict:
        from attn2ssm.export.llamacpp import GGUFModel

        tokens = prompt[0].tolist()
        memory = Memory(torch.device("cpu"))
        memory.start()
        model = GGUFModel(
            self.path,
            n_ctx=len(tokens) + self.new_tokens + 8,
            threads=self.threads,
            flash_attn=self.flash_attn,
        )
        start = time.perf_counter()
        model.feed(tokens)
        first = int(model.last_logits().argmax())
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "peak_growth_mb": memory.peak_growth_mb(),
            "model": model,
            "state": model.state(),
            "ids": torch.tensor([[*tokens, first]]),
        }

    def decode_round(self, prefilled: dict, new_tokens: int) -> dict:
        """From the saved state after the prompt: feed the first token, then greedy ``new_tokens``
        tokens one at a time; the first token's time is left out as the HF rows leave it out."""
        model = prefilled["model"]
        model.restore(prefilled["state"])
        memory = Memory(torch.device("cpu"))
        memory.start()
        token, tokens, stamps = int(prefilled["ids"][0, -1]), [], [time.perf_counter()]
        for _ in range(new_tokens):
            model.feed([token])
            token = int(model.last_logits().argmax())
            tokens.append(token)
            stamps.append(time.perf_counter())
        seconds = [b - a for a, b in zip(stamps[1:], stamps[2:])]
        return {
            "seconds": seconds,
            "peak_growth_mb": memory.peak_growth_mb(),
            "cache_mb": len(model.state()[0]) / 2**20,
            "tokens": tokens,
        }

    def release(self, prefilled: dict) -> None:
        """Close the llama.cpp context the prefill opened."""
        prefilled.pop("state", None)
        model = prefilled.pop("model", None)
        if model is not None:
            model.close()


def build_gguf_models(
    teacher, tokenizer, source, settings: BenchSettings, work: Path, progress: bool = True
) -> tuple[dict, dict]:
    """name@quant → ``LlamaCppBench`` for every model × type in ``settings``, and what each file is.
    GGUFs already in ``work`` (``--gguf-dir``) are used as they are."""
    from attn2ssm.export.gguf import export_gguf
    from attn2ssm.export.llamacpp import to_gguf
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    work.mkdir(parents=True, exist_ok=True)
    n = teacher.config.num_hidden_layers
    models, files = {}, {}
    for name in settings.models:
        source_dir = None
        for quant in settings.quants:
            path = work / f"{name}-{quant}.gguf"
            info = {"path": str(path), "outtype": quant, "reused": path.exists()}
            if not path.exists():
                if progress:
                    print(f"bench: writing {path.name}", file=sys.stderr)
                if name == "teacher":
                    source_dir = source_dir or _teacher_hf_dir(teacher, tokenizer, source, work)
                    to_gguf(source_dir, path, quant, work, settings.threads)
                else:
                    if source_dir is None:
                        kind, ratio, options = STUDENTS[name]
                        student = convert(
                            teacher,
                            make_plan(n, kind, attention_ratio=ratio),
                            {kind: {**options, **LLAMA_CPP_STUDENT_OPTIONS[kind]}},
                        ).eval()
                        source_dir = work / f"{name}-student"
                        student.save_pretrained(source_dir)
                        tokenizer.save_pretrained(source_dir)
                    result = export_gguf(
                        source_dir, path, outtype=quant, force=True, threads=settings.threads
                    )
                    info.update(
                        {
                            "identity_layers": result.identity_layers,
                            "llama_cpp_max_abs_diff_vs_student": result.llama_cpp_max_abs_diff,
                            "notes": result.notes,
                        }
                    )
            info["bytes"] = path.stat().st_size
            models[f"{name}@{quant}"] = LlamaCppBench(
                path, settings.threads, settings.new_tokens, settings.flash_attn
            )
            files[f"{name}@{quant}"] = info
    return models, files


def _teacher_hf_dir(teacher, tokenizer, source, work: Path) -> Path:
    """A transformers directory of the teacher for llama.cpp's converter: its own, else saved here."""
    if source.kind in ("builtin", "dir"):
        return Path(source.location)
    target = work / "teacher-hf"
    teacher.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def run_llama_cpp_bench(settings: BenchSettings, progress: bool) -> dict:
    """The llama.cpp backend: GGUFs of the teacher and its students (built, or reused from
    ``gguf_dir``), decoded by llama.cpp on the CPU; the same rows, JSON and plot as the torch backend."""
    import tempfile

    from attn2ssm.eval.report import environment
    from attn2ssm.export.llamacpp import environment as llama_cpp_environment
    from attn2ssm.export.llamacpp import load_runtime
    from attn2ssm.teachers import load_teacher

    load_runtime()  # missing: one line naming make llama-cpp, before the teacher loads
    threads = settings.threads or os.cpu_count()
    settings.threads = threads
    torch.set_num_threads(threads)
    teacher, tokenizer, source = load_teacher(settings.teacher)
    with tempfile.TemporaryDirectory(prefix="attn2ssm-bench-gguf-") as tmp:
        work = Path(settings.gguf_dir) if settings.gguf_dir else Path(tmp)
        models, files = build_gguf_models(teacher, tokenizer, source, settings, work, progress)
        del teacher  # the GGUFs are written; llama.cpp holds its own copies
        prompt = prompt_ids(tokenizer, settings.corpus, max(settings.contexts), "cpu")
        decode = decode_by_context(models, settings, prompt, progress)
    return {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "backend": "llama.cpp",
        "device": "cpu",
        "threads": threads,
        "environment": {**environment(), "llama_cpp": llama_cpp_environment()},
        "gguf": files,
        "decode": decode,
    }
