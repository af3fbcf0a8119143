"""``attn2ssm bench generate``: decode speed, prefill time and memory against context length, and
(``--spec``) speculative decoding with the student as the target (acceptance, tokens per target
forward, speedup over the target's own plain greedy decode) for each drafter and K.

What is measured, per model and context length L:
- prefill: time from calling ``generate`` to the first new token (one forward over L tokens);
- decode: per-token times of ``new_tokens`` greedy tokens after it, stamped by a streamer inside
  ``model.generate`` (HF's own loop, KV cache for the teacher, our cache for students). Every
  model prefills once; then ``rounds`` rounds decode from copies of the prefilled caches, the
  models taking turns within a round, so a slow spell of a shared machine hits all of them. The
  rate is 1 / the median per-token time (quartiles and every time are kept in the JSON);
- memory: the bytes held by the cache after decoding (KV grows with L, a recurrent state does
  not), and peak memory growth during decode (CUDA: max_memory_allocated; CPU: the process's
  peak RSS, reset before decoding through /proc/self/clear_refs).
Students are converted from the teacher without training: speed and memory do not depend on the
weights. On CPU every model, teacher included, gets ``cpu_decode_layout`` (one-row matmuls over
row blocks of the weight on every core, gate/up and mixer input projections fused, fused
RMSNorm) unless ``cpu_layout`` is off; pure students of a Llama-structured teacher also decode
through their one-token ``DecodePlan`` there (HF's per-layer plumbing skipped), with
``compile_students`` (``--compile``) as one ``torch.compile``d function (compiled before any
timing), while the teacher runs HF's own forward with its KV cache (the reference the issue names).

Speculative decoding (``run_spec_bench``, Mamba in the Llama §4): the target is a student (a pure
Mamba-2 and a 25 % hybrid; trained ones with ``NAME=DIR``), the drafters prompt lookup ("ngram",
no model) and any ``--draft`` models (a shallow student). Target and draft models prefill the
prompt once; the target's plain greedy decode (one token per forward, its fast decode path) and
speculative decoding for each drafter and K start from copies of those caches, taking turns in
each round, so every variant decodes the same text from the same state. Two tasks: the corpus' own
text, and a passage the prompt asks to repeat (where lookup shines).

``backend="llama.cpp"`` measures the same rows where users run small models: each model is a GGUF in
``llama_cpp.Llama`` (llamacpp.py), ``threads`` threads, flash attention on (llama.cpp's own CLI picks
it on CPU), the default f16 KV cache. The teacher's GGUF comes from its HF checkpoint through
llama.cpp's converter and the students' through ``attn2ssm export --format gguf``
(student/gguf_export.py), each at every type in ``quants`` (teacher and students at the same type:
``teacher@q8_0`` is the reference of ``mamba2@q8_0``). Students are untrained conversions built
with ``LLAMA_CPP_STUDENT_OPTIONS``, what a GGUF export needs (``gdn``, a pure gated delta-rule
student, runs as llama.cpp's ``qwen35``). Prefill = feeding the L prompt tokens
and taking the first token; a round restores llama.cpp's saved context state (KV cells and recurrent
states) after the prefill and decodes one token at a time; the cache column is that state's size
after decoding (llama_state_get_size, which also holds one row of logits).
"""

from __future__ import annotations

import copy
import ctypes
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from attn2ssm.generation.drafters import Runner
from attn2ssm.generation.speculative import speculative_generate
from attn2ssm.hf_compat import CACHE_KWARG

# name → (mixer kind, attention ratio, mixer options): the students the benchmark builds
STUDENTS = {
    "linear": ("linear_attention", 0.0, {"feature_map": "hedgehog"}),
    "mamba": ("mamba", 0.0, {}),
    "mamba2": ("mamba2", 0.0, {}),
    "hybrid25": ("mamba2", 0.25, {}),
    "gdn": ("gated_delta", 0.0, {}),
}
# The llama.cpp backend's students: what exports exactly to GGUF (export/native.py llama_cpp_problem,
# export/native_qwen35.py qwen35_problem), built with their kind's options for it.
LLAMA_CPP_STUDENTS = ("mamba2", "hybrid25", "gdn")
LLAMA_CPP_STUDENT_OPTIONS = {
    "mamba2": {"norm": True, "norm_eps": "auto", "gate": True, "gate_bias": False},
    "gated_delta": {
        "norm": True,
        "norm_eps": "auto",
        "gate": True,
        "gate_bias": False,
        "beta_bias": False,
        "conv_bias": False,
    },
}


# ------------------------------------------------------------------------------------- memory
def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _Memory:
    """Peak memory growth over a window of code: CUDA allocator stats, else Linux peak RSS."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
            return
        try:  # hand freed memory back to the OS so the baseline is honest, then reset the peak
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = _status_mb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak_growth_mb(self) -> float | None:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20 - self.base
        peak = _status_mb("VmHWM")
        return None if peak is None or self.base is None or not self.resettable else peak - self.base


def cache_bytes(cache) -> int:
    """Bytes of every tensor a cache holds (KV rows for attention layers, states for mixers)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "state_bytes"):
            total += layer.state_bytes()
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _new_cache(model):
    return model.new_cache() if hasattr(model, "new_cache") else DynamicCache(config=model.config)


# ------------------------------------------------------------------------------------- decode
class _Clock(BaseStreamer):
    """Time stamps of ``generate``'s streamer calls: the prompt, then each new token."""

    def __init__(self, after_first=None):
        self.times: list[float] = []
        self.after_first = after_first

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 2 and self.after_first is not None:
            self.after_first()

    def end(self) -> None:
        pass


def _greedy(model, ids: torch.Tensor, cache, new_tokens: int, clock: _Clock) -> torch.Tensor:
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        streamer=clock,
        **{CACHE_KWARG: cache},
    )


@torch.no_grad()
def prefill(model, prompt: torch.Tensor) -> dict:
    """Prefill ``prompt`` (1, L) through ``generate`` (one new token); returns the timing, the
    peak memory growth, the cache holding L tokens and the prompt extended by its first token."""
    if isinstance(model, LlamaCppBench):
        return model.prefill(prompt)
    memory = _Memory(prompt.device)
    memory.start()
    clock, cache = _Clock(), _new_cache(model)
    start = time.perf_counter()
    out = _greedy(model, prompt, cache, 1, clock)
    return {
        "seconds": clock.times[1] - start,
        "peak_growth_mb": memory.peak_growth_mb(),
        "cache": cache,
        "ids": out,
    }


@torch.no_grad()
def decode_round(model, prefilled: dict, new_tokens: int) -> dict:
    """Greedy ``new_tokens`` from a copy of a prefilled cache: per-token seconds (the first
    token's time, which includes generate's set-up, is left out), peak memory growth, cache bytes."""
    if isinstance(model, LlamaCppBench):
        return model.decode_round(prefilled, new_tokens)
    cache = copy.deepcopy(prefilled["cache"])
    memory = _Memory(prefilled["ids"].device)
    memory.start()
    clock = _Clock()
    out = _greedy(model, prefilled["ids"], cache, new_tokens, clock)
    t = clock.times  # t[0]: prompt handed over, t[i]: i-th new token
    return {
        "seconds": [b - a for a, b in zip(t[1:], t[2:])],
        "peak_growth_mb": memory.peak_growth_mb(),
        "cache_mb": cache_bytes(cache) / 2**20,
        "tokens": out[0, prefilled["ids"].shape[1] :].tolist(),
    }


class _Stamps:
    """A logits processor that only notes when it is called: once per forward, before the token
    is chosen (what an outside observer of ``generate`` sees)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.no_grad()
def plain_generate(model, prompt: torch.Tensor, new_tokens: int) -> dict:
    """A user's plain ``model.generate`` over ``prompt`` (1, L): its own fresh cache, greedy,
    nothing passed but the prompt, its mask and a logits processor stamping each forward. The
    benchmark's reference: its rounds must decode as fast as this and the same tokens.
    Returns the per-token seconds of the decode forwards (the prefill's left out) and the tokens."""
    from transformers import LogitsProcessorList

    stamps = _Stamps()
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([stamps]),
    )
    t = stamps.times  # t[0]: after the prefill forward, t[i]: after the i-th one-token forward
    return {"seconds": [b - a for a, b in zip(t, t[1:])], "tokens": out[0, prompt.shape[1] :].tolist()}


def stream_rate(device: torch.device, megabytes: int = 512, repeats: int = 5) -> dict:
    """How fast this machine streams memory with torch's own kernels, the floor of a decode step
    (weight bytes / rate): a sum over, and a copy of, a ``megabytes`` float32 tensor (far larger
    than any cache), ``repeats`` times each; the medians in GB/s (a copy moves its bytes twice)."""
    if device.type != "cpu":
        return {}
    big = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(big)
    sums, copies = [], []
    big.sum(), dst.copy_(big)  # first touch of every page outside the timing
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        sums.append(big.numel() * 4 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        dst.copy_(big)
        copies.append(2 * big.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return {
        "sum_gb_per_s": _quantile(sums, 0.5),
        "copy_gb_per_s": _quantile(copies, 0.5),
        "sum_all": [round(v, 2) for v in sums],
        "copy_all": [round(v, 2) for v in copies],
        "tensor_mb": megabytes,
        "threads": torch.get_num_threads(),
    }


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def decode_row(length: int, pre: dict, rounds: list[dict], plain: list[dict] | None = None) -> dict:
    """One model at one context: rates from the median per-token time over every round; with
    ``plain`` (``plain_generate`` runs taking turns with the rounds) the same for a user's plain
    ``generate``, the benchmark's rate over it, and whether both chose the same tokens."""
    times = [s for r in rounds for s in r["seconds"]]
    median = _quantile(times, 0.5)
    check = {}
    if plain:
        plain_times = [s for r in plain for s in r["seconds"]]
        plain_median = _quantile(plain_times, 0.5)
        n = len(
            rounds[0]["tokens"]
        )  # a round decodes after the prefill's token; plain's tokens start with it
        check = {
            "plain_generate_tokens_per_second": 1.0 / plain_median,
            "plain_generate_ms_per_token_all": [round(1000 * s, 3) for s in plain_times],
            "benchmark_vs_plain_generate": plain_median / median,
            "plain_generate_same_tokens": all(
                p["tokens"][1:] == rounds[0]["tokens"][: len(p["tokens"]) - 1] for p in plain
            )
            and n > 0,
        }
    return {
        "context": length,
        "prefill_seconds": pre["seconds"],
        "decode_tokens_per_second": 1.0 / median,
        "decode_ms_per_token": 1000 * median,
        "decode_ms_per_token_p25": 1000 * _quantile(times, 0.25),
        "decode_ms_per_token_p75": 1000 * _quantile(times, 0.75),
        "decode_ms_per_token_mean": 1000 * sum(times) / len(times),
        "timed_tokens": len(times),
        "rounds": len(rounds),
        "same_tokens_every_round": all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
        "cache_mb": rounds[0]["cache_mb"],
        "prefill_peak_growth_mb": pre["peak_growth_mb"],
        "decode_peak_growth_mb": max(
            (r["peak_growth_mb"] for r in rounds if r["peak_growth_mb"] is not None), default=None
        ),
        "load_average_1min": os.getloadavg()[0]
        if hasattr(os, "getloadavg")
        else None,  # recorded, not hidden
        "ms_per_token_all": [round(1000 * s, 3) for s in times],
        **check,
    }


def measure_decode(model, prompt: torch.Tensor, new_tokens: int, rounds: int = 1) -> dict:
    """One model alone: prefill ``prompt`` (1, L), then ``rounds`` × ``new_tokens`` greedy tokens."""
    return measure_decode_interleaved({"model": model}, prompt, new_tokens, rounds)["model"]


def measure_decode_interleaved(
    models: dict, prompt: torch.Tensor, new_tokens: int, rounds: int, plain_check: bool = False
) -> dict:
    """Several models at one context: each prefills once, then in every round each decodes in turn
    (with ``plain_check``, each also runs a user's plain ``generate`` right after its round)."""
    if new_tokens < 3:
        raise ValueError("measure at least 3 new tokens (the first is not timed, 2+ give decode times)")
    pres, skipped = {}, {}
    for name, m in models.items():
        try:
            pres[name] = prefill(m, prompt)
        except (
            torch.OutOfMemoryError
        ) as exc:  # e.g. a teacher's one-forward prefill of a long prompt on a GPU
            skipped[name] = {
                "context": prompt.shape[1],
                "skipped": f"out of memory on {prompt.device} in the prefill: {str(exc).splitlines()[0][:160]}",
            }
            if prompt.device.type == "cuda":
                torch.cuda.empty_cache()
    done: dict[str, list] = {name: [] for name in pres}
    plain: dict[str, list] = {name: [] for name in pres}
    for _ in range(rounds):
        for name in pres:
            done[name].append(decode_round(models[name], pres[name], new_tokens))
            if plain_check and not isinstance(models[name], LlamaCppBench):
                plain[name].append(plain_generate(models[name], prompt, new_tokens))
    rows = {name: decode_row(prompt.shape[1], pres[name], done[name], plain[name]) for name in pres}
    for name, pre in pres.items():
        if isinstance(models[name], LlamaCppBench):
            models[name].release(pre)
    pres.clear()  # the caches (a long KV cache is GBs) go before the next context
    return {name: rows.get(name) or skipped[name] for name in models}


# ------------------------------------------------------------------------------------- llama.cpp
class LlamaCppBench:
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
        memory = _Memory(torch.device("cpu"))
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
        memory = _Memory(torch.device("cpu"))
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
        prefilled.pop("state", None)
        model = prefilled.pop("model", None)
        if model is not None:
            model.close()


def build_gguf_models(
    teacher, tokenizer, source, settings: "BenchSettings", work: Path, progress: bool = True
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


def reference_name(name: str) -> str:
    """The teacher row a model is compared with: ``teacher``, or ``teacher@q8_0`` for ``mamba2@q8_0``."""
    _, sep, quant = name.partition("@")
    return "teacher" + sep + quant


# ------------------------------------------------------------------------------------- speculative
def _plain_greedy(target, cache, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """The target's own greedy decode from a prefilled cache (all of ``prompt`` but its last
    token), one token per forward: the path a user's ``generate`` takes (the decode plan where
    the student has one). Returns the seconds and the tokens."""
    plain = Runner(target)
    plain.cache, plain.consumed = cache, prompt.shape[1] - 1
    text = prompt[0].tolist()
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = plain.feed(torch.tensor([text[plain.consumed :]], device=prompt.device), keep=1)
        text.append(int(logits[-1].argmax()))
    return time.perf_counter() - start, text[prompt.shape[1] :]


@torch.no_grad()
def measure_speculative(
    target, drafts: dict, prompt: torch.Tensor, ks: list[int], new_tokens: int, rounds: int = 1
) -> dict:
    """The target's plain greedy decode vs speculative decoding with each drafter (name → a model
    or "ngram") at each K, every run from copies of one prefill of each model. In each of
    ``rounds`` rounds the plain decode and every variant take turns, so a slow spell of a shared
    machine hits all of them; times are medians over the rounds. Speedup = plain seconds / spec
    seconds for the same number of tokens; tokens are compared with the plain decode's."""
    t0 = time.perf_counter()
    prefilled = {}
    for name, draft in {"target": target, **drafts}.items():
        if isinstance(draft, str):
            prefilled[name] = None
            continue
        runner = Runner(draft)
        runner.feed(prompt[:, :-1], keep=1)
        prefilled[name] = runner.cache
    prefill_seconds = time.perf_counter() - t0
    plain_times, reference, runs = [], None, {(name, k): [] for name in drafts for k in ks}
    for _ in range(rounds):
        seconds, tokens = _plain_greedy(target, copy.deepcopy(prefilled["target"]), prompt, new_tokens)
        plain_times.append(seconds)
        reference = reference or tokens
        for name, draft in drafts.items():
            for k in ks:
                caches = copy.deepcopy(prefilled["target"]), copy.deepcopy(prefilled[name])
                start = time.perf_counter()
                out = speculative_generate(
                    target,
                    draft,
                    prompt,
                    max_new_tokens=new_tokens,
                    num_draft_tokens=k,
                    past_key_values=caches,
                )
                runs[name, k].append((time.perf_counter() - start, out))
    plain = _quantile(plain_times, 0.5)
    by_drafter = {}
    for name in drafts:
        rows = []
        for k in ks:
            seconds = _quantile([t for t, _ in runs[name, k]], 0.5)
            out = runs[name, k][0][1]
            tokens = out.sequences[0, prompt.shape[1] :].tolist()
            rows.append(
                {
                    "k": k,
                    "seconds": seconds,
                    "seconds_all": [round(t, 4) for t, _ in runs[name, k]],
                    "tokens_per_second": len(tokens) / seconds,
                    "speedup": plain / seconds * len(tokens) / new_tokens,
                    "tokens_per_target_forward": out.stats.tokens_per_round,
                    "identical_to_plain_greedy": all(
                        r.sequences[0, prompt.shape[1] :].tolist() == reference[: len(tokens)]
                        for _, r in runs[name, k]
                    ),
                    **out.stats.as_dict(),
                }
            )
        by_drafter[name] = rows
    return {
        "context": prompt.shape[1],
        "prefill_seconds": prefill_seconds,
        "plain_seconds": plain,
        "plain_seconds_all": [round(t, 4) for t in plain_times],
        "plain_tokens_per_second": new_tokens / plain,
        "plain_tokens": reference,
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "by_drafter": by_drafter,
    }


COPY_INSTRUCTION = "\n\nRepeat the passage above word for word.\n\n"
COPY_PASSAGE, COPY_PRIMER = 256, 8


def copy_prompt(tokenizer, corpus: str, length: int, device) -> tuple[torch.Tensor, list[int]]:
    """A prompt where prompt lookup should shine: ``length`` tokens ending in a passage of the
    corpus, an instruction to repeat it and the passage's first ``COPY_PRIMER`` tokens; returns
    it and the passage's rest (what a faithful copy continues with)."""
    instruction = tokenizer(COPY_INSTRUCTION, add_special_tokens=False)["input_ids"]
    filler = length - COPY_PASSAGE - len(instruction) - COPY_PRIMER
    if filler < 0:
        raise ValueError(f"a copy prompt needs at least {length - filler} tokens, not {length}")
    ids = _prompt_ids(tokenizer, corpus, filler + COPY_PASSAGE, device)[0].tolist()
    passage = ids[filler:]
    prompt = ids[:filler] + passage + instruction + passage[:COPY_PRIMER]
    return torch.tensor([prompt], device=device), passage[COPY_PRIMER:]


def _spec_targets(teacher, names: tuple[str, ...], device) -> dict:
    """name → target: ``NAME=DIR`` loads a trained student, a bare name converts an untrained
    one from ``STUDENTS``."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    targets, untrained = {}, [n for n in names if "=" not in n]
    targets.update(build_models(teacher, untrained, device))
    for item in names:
        name, sep, path = item.partition("=")
        if sep:
            model, _ = load_model_and_tokenizer(path)
            targets[name] = model.to(device).eval()
    return {n.partition("=")[0]: targets[n.partition("=")[0]] for n in names}


def run_spec_bench(settings: "BenchSettings", progress: bool = True) -> dict:
    """``bench generate --spec``: each target (a pure Mamba-2 and a 25 % hybrid student) with each
    drafter (prompt lookup, and ``--draft`` models), at each context, on two tasks: the corpus'
    own text (``continue``) and a passage to repeat (``copy``), where lookup should shine."""
    from tqdm.auto import tqdm

    from attn2ssm.eval.report import environment
    from attn2ssm.student.loading import load_model_and_tokenizer
    from attn2ssm.teachers import load_teacher

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    teacher, tokenizer, _ = load_teacher(settings.teacher, device=device)
    targets = _spec_targets(teacher, settings.spec_targets, device)
    drafts: dict = {name: name for name in settings.spec_drafters}
    for path in settings.draft or ():
        model, _ = load_model_and_tokenizer(path)
        drafts[f"model:{Path(path).name if Path(path).name != 'student' else Path(path).parent.name}"] = (
            model.to(device).eval()
        )
    if settings.cpu_layout and device.type == "cpu":
        from attn2ssm.decode.layout import cpu_decode_layout

        for model in [*targets.values(), *(d for d in drafts.values() if not isinstance(d, str))]:
            cpu_decode_layout(model)
    longest = max(settings.spec_contexts)
    text = _prompt_ids(tokenizer, settings.corpus, longest, device)
    rows = []
    points = [
        (t, length, task)
        for t in targets
        for length in settings.spec_contexts
        for task in ("continue", "copy")
    ]
    bar = tqdm(points, desc="speculative", disable=not progress, file=sys.stderr)
    for target_name, length, task in bar:
        bar.set_postfix_str(f"{target_name} @ {length} {task}")
        if task == "copy":
            prompt, passage = copy_prompt(tokenizer, settings.corpus, length, device)
        else:
            prompt, passage = text[:, :length], None
        row = measure_speculative(
            targets[target_name],
            drafts,
            prompt,
            list(settings.spec_ks),
            settings.spec_new_tokens,
            settings.rounds,
        )
        if passage is not None:
            plain = row["plain_tokens"]
            row["plain_copies_passage"] = sum(a == b for a, b in zip(plain, passage)) / len(plain)
        rows.append({"target": target_name, "task": task, **row})
    return {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "backend": "torch",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "environment": environment(),
        "targets": {
            name: (item.partition("=")[2] or f"untrained {name} conversion of the teacher")
            for item in settings.spec_targets
            for name in [item.partition("=")[0]]
        },
        "drafters": {
            name: (
                d
                if isinstance(d, str)
                else f"{sum(p.numel() for p in d.parameters()) / 1e6:.1f}M parameters, {d.config.num_hidden_layers} layers"
            )
            for name, d in drafts.items()
        },
        "speculative": rows,
    }


def plot_spec_bench(result: dict, path: Path) -> Path:
    """Speedup over the target's plain greedy decode (solid) and acceptance rate (dashed) vs K:
    one panel per target × task, one colour per drafter × context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in result["speculative"]))
    tasks = list(dict.fromkeys(r["task"] for r in result["speculative"]))
    fig, axes = plt.subplots(
        len(tasks), len(targets), figsize=(4.6 * len(targets), 3.6 * len(tasks)), squeeze=False
    )
    for (row_i, task), (col_i, target) in ((t, g) for t in enumerate(tasks) for g in enumerate(targets)):
        ax, i = axes[row_i][col_i], 0
        ticks: dict = {}
        for row in result["speculative"]:
            if (row["target"], row["task"]) != (target, task):
                continue
            for name, rows in row["by_drafter"].items():
                fixed = [r["k"] for r in rows if r["k"] != "auto"]
                ks = [
                    r["k"] if r["k"] != "auto" else max(fixed, default=0) + 2 for r in rows
                ]  # "auto" drawn right of the fixed K
                ticks.update({x: str(r["k"]) for x, r in zip(ks, rows)})
                ax.plot(
                    ks,
                    [r["speedup"] for r in rows],
                    marker="o",
                    color=f"C{i}",
                    label=f"{name} @ {row['context']}: speedup",
                )
                ax.plot(
                    ks,
                    [r["acceptance_rate"] for r in rows],
                    marker="x",
                    linestyle="--",
                    color=f"C{i}",
                    label=f"{name} @ {row['context']}: acceptance",
                )
                i += 1
        ax.set_xticks(list(ticks), list(ticks.values()))
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.axhline(1.5, color="gray", linewidth=1, linestyle=":")
        ax.set_title(f"target {target}, task {task}", fontsize=9)
        ax.set_xlabel("draft tokens per target forward (K)", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5)
    where = f"{result['device']} ({result['environment'].get('processor')}, {result['threads']} threads)"
    fig.suptitle(
        f"speculative decoding, the student as target (Mamba in the Llama §4), greedy, on {where}; "
        "speedup over the target's plain decode (solid), acceptance (dashed)",
        fontsize=10,
    )
    return _save_figure(fig, path)


def format_spec_bench(result: dict) -> str:
    """The speculative table ``bench generate --spec`` prints: per target, context and task, each drafter's K."""
    lines = [
        f"speculative decoding ({result['device']}, {result['threads']} threads), the student as target; speedup over its plain greedy decode"
    ]
    for row in result["speculative"]:
        lines.append(
            f"{row['target']} @ {row['context']} {row['task']} (plain {row['plain_tokens_per_second']:.2f} tok/s):"
        )
        for name, rows in row["by_drafter"].items():
            for r in rows:
                lines.append(
                    f"  {name} K={r['k']}: {r['tokens_per_second']:.2f} tok/s ({r['speedup']:.2f}x), acceptance {r['acceptance_rate']:.1%}, "
                    f"{r['tokens_per_target_forward']:.2f} tokens/forward, identical {r['identical_to_plain_greedy']}"
                )
    return "\n".join(lines)


def _save_figure(fig, path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- driver
@dataclass
class BenchSettings:
    teacher: str | None = None
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    models: tuple[str, ...] = ("teacher", "linear", "mamba", "mamba2", "hybrid25")
    new_tokens: int = 16
    max_context: dict | None = None  # model → longest context to run (longer ones are recorded as skipped)
    spec: bool = False  # run the speculative benchmark (run_spec_bench) instead of the decode table
    spec_targets: tuple[str, ...] = (
        "mamba2",
        "hybrid25",
    )  # NAME (untrained, from STUDENTS) or NAME=DIR (a trained student)
    spec_drafters: tuple[str, ...] = ("ngram",)
    draft: tuple[str, ...] | None = None  # model drafts (student directories or teacher specs)
    spec_contexts: tuple[int, ...] = (1024, 8192)
    spec_ks: tuple = (2, 4, 6, "auto")
    spec_new_tokens: int = 64
    corpus: str = "sotu"
    device: str | None = None
    threads: int | None = None
    rounds: int = 3
    cpu_layout: bool = True
    compile_students: bool = (
        False  # CPU: students decode through a torch.compile'd step (compiled before timing)
    )
    backend: str = "torch"  # or "llama.cpp": every model a GGUF in llama_cpp (see the module docstring)
    quants: tuple[str, ...] = ("q8_0", "f16")  # llama.cpp: the GGUF types, teacher and students alike
    flash_attn: bool = True  # llama.cpp: flash attention (llama.cpp's CLI default on CPU)
    gguf_dir: str | None = None  # llama.cpp: keep (and reuse) the GGUF files here; None: a temporary folder
    formats: tuple[str, ...] = (
        "float32",
    )  # torch: weight formats (decode/quantize.py): float32, bfloat16, int8, bfloat16+int8
    plain_check: str = "shortest"  # torch: also time a user's plain generate at the "shortest" context, "all" of them, or "none"


def _prompt_ids(tokenizer, corpus: str, length: int, device) -> torch.Tensor:
    """``length`` tokens of real text: the corpus' documents in order, tokenized and concatenated."""
    from attn2ssm.data.builtin import is_builtin, load_builtin

    if is_builtin(corpus):
        texts = [d.text for d in load_builtin(corpus)]
    else:
        texts = [Path(corpus).read_text(encoding="utf-8")]
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= length:
            break
    while len(ids) < length:  # a short corpus is repeated
        ids.extend(ids[: length - len(ids)])
    return torch.tensor([ids[:length]], device=device)


def parse_format(name: str) -> tuple[str, str | None]:
    """A benchmark weight format → (dtype, quantize): float32, bfloat16, int8 (float32
    activations), bfloat16+int8 (decode/quantize.py format_name's inverse)."""
    dtype, _, quantize = name.partition("+")
    if dtype == "int8":
        dtype, quantize = "float32", "int8"
    return dtype, quantize or None


def build_models(teacher, names, device, formats: tuple[str, ...] = ("float32",)) -> dict:
    """name → model: the teacher itself and untrained students converted from it, in each weight
    format (``apply_weight_format``): float32 rows keep their plain names, others are NAME@FORMAT
    (``teacher@bfloat16`` is the reference of ``mamba2@bfloat16``). ``.weight_format`` on each
    model says what it holds (format, bytes a step reads)."""
    from attn2ssm.decode.quantize import apply_weight_format, step_weight_bytes
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    n = teacher.config.num_hidden_layers
    base = {}
    for name in names:
        if name == "teacher":
            base[name] = teacher
            continue
        if name not in STUDENTS:
            raise ValueError(f"unknown benchmark model {name!r}; choose from teacher, {', '.join(STUDENTS)}")
        kind, ratio, options = STUDENTS[name]
        base[name] = (
            convert(teacher, make_plan(n, kind, attention_ratio=ratio), {kind: options}).to(device).eval()
        )
    models = {}
    for fmt in formats:
        for name, model in base.items():
            if fmt == "float32":
                model.__dict__["weight_format"] = {
                    "format": "float32",
                    "weight_bytes": step_weight_bytes(model),
                }
                models[name] = model
                continue
            copy_ = copy.deepcopy(model)
            copy_.__dict__["weight_format"] = apply_weight_format(copy_, *parse_format(fmt))
            models[f"{name}@{fmt}"] = copy_
    return models


def run_generate_bench(settings: BenchSettings, progress: bool = True) -> dict:
    from attn2ssm.eval.report import environment
    from attn2ssm.teachers import load_teacher

    if settings.backend == "llama.cpp":
        return _run_llama_cpp_bench(settings, progress)
    if settings.spec:
        return run_spec_bench(settings, progress)
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    teacher, tokenizer, _ = load_teacher(settings.teacher, device=device)
    models = build_models(teacher, settings.models, device, settings.formats)
    layout = settings.cpu_layout and device.type == "cpu"
    if layout:
        from attn2ssm.decode.layout import cpu_decode_layout

        for model in [teacher, *models.values()]:
            cpu_decode_layout(model, compile=settings.compile_students and model is not teacher)
    compiled = {}
    if layout and settings.compile_students:  # compile now (a minute each), not inside a timed decode
        warm = _prompt_ids(tokenizer, settings.corpus, 16, device)
        for name, model in models.items():
            if model is teacher:
                compiled[name] = "not compiled: HF's forward with its KV cache"
                continue
            compiled[name] = model.compiled_step_reason or "compiled"
            if compiled[name] == "compiled":
                with torch.no_grad():
                    _greedy(model, warm, _new_cache(model), 3, _Clock())
                step = model.__dict__["_decode_plan"].compiled
                compiled[name] = "compiled" if step.failed is None else step.failed
    prompt = _prompt_ids(tokenizer, settings.corpus, max(settings.contexts), device)
    stream = stream_rate(device)
    decode = _decode_by_context(models, settings, prompt, progress)
    weights = {name: model.__dict__.get("weight_format", {}) for name, model in models.items()}
    _bandwidth_bound(decode, weights, stream)
    result = {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "backend": "torch",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "compiled_decode_step": compiled,  # student → "compiled" or why it decodes eagerly
        "environment": environment(),
        "stream_rate": stream,  # GB/s this machine streams: the bandwidth bound's denominator
        "weight_formats": weights,
        "decode": decode,
    }
    return result


def _bandwidth_bound(decode: dict, weights: dict, stream: dict) -> None:
    """Each row's token time against its bandwidth bound: weight bytes a step reads / the measured
    stream rate (sum); ``fraction_of_bandwidth_bound`` = bound / measured time (1 = at the bound).
    The ``_with_cache`` pair also counts reading the cache once (the KV of attention layers)."""
    rate = stream.get("sum_gb_per_s")
    for name, rows in decode.items():
        size = weights.get(name, {}).get("weight_bytes")
        if not rate or not size:
            continue
        for row in rows:
            if "skipped" in row:
                continue
            row["weight_mb_per_token"] = size / 2**20
            row["bandwidth_bound_ms"] = 1000 * size / (rate * 1e9)
            row["fraction_of_bandwidth_bound"] = row["bandwidth_bound_ms"] / row["decode_ms_per_token"]
            row["bandwidth_bound_with_cache_ms"] = 1000 * (size + row["cache_mb"] * 2**20) / (rate * 1e9)
            row["fraction_of_bandwidth_bound_with_cache"] = (
                row["bandwidth_bound_with_cache_ms"] / row["decode_ms_per_token"]
            )


def _decode_by_context(models: dict, settings: BenchSettings, prompt: torch.Tensor, progress: bool) -> dict:
    """name → one row per context (``measure_decode_interleaved``; skipped past ``max_context`` or
    after an out-of-memory prefill), with each model's speed relative to its teacher row."""
    from tqdm.auto import tqdm

    limits = settings.max_context or {}
    out_of_memory: dict[str, int] = {}  # model → the context whose prefill did not fit
    decode: dict[str, list] = {m: [] for m in models}
    bar = tqdm(settings.contexts, desc="decode", disable=not progress, file=sys.stderr)
    for length in bar:
        bar.set_postfix_str(f"context {length}")
        limit = {m: limits.get(m.partition("@")[0], math.inf) for m in models}
        running = {m: models[m] for m in models if length <= limit[m] and m not in out_of_memory}
        check = settings.plain_check == "all" or (
            settings.plain_check == "shortest" and length == min(settings.contexts)
        )
        rows = (
            measure_decode_interleaved(
                running, prompt[:, :length], settings.new_tokens, settings.rounds, plain_check=check
            )
            if running
            else {}
        )
        for name in models:
            if name in out_of_memory:
                row = {
                    "context": length,
                    "skipped": f"the prefill ran out of memory at context {out_of_memory[name]}",
                }
            else:
                row = rows.get(name) or {
                    "context": length,
                    "skipped": f"longer than --max-context {limit[name]} for {name}",
                }
                if "out of memory" in row.get("skipped", ""):
                    out_of_memory[name] = length  # longer contexts would not fit either
            decode[name].append(row)
    for (
        name,
        rows,
    ) in decode.items():  # how many times faster than the teacher, from the medians, where both ran
        ref = reference_name(name)
        if name != ref and ref in decode:
            for row, base in zip(rows, decode[ref]):
                if "skipped" not in row and "skipped" not in base:
                    row["speedup_vs_teacher"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
        model, sep, _ = name.partition(
            "@"
        )  # the same model in float32 (torch formats; llama.cpp rows have none)
        if sep and model in decode:
            for row, base in zip(rows, decode[model]):
                if "skipped" not in row and "skipped" not in base:
                    row["speedup_vs_float32"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
    return decode


def _run_llama_cpp_bench(settings: BenchSettings, progress: bool) -> dict:
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
        prompt = _prompt_ids(tokenizer, settings.corpus, max(settings.contexts), "cpu")
        decode = _decode_by_context(models, settings, prompt, progress)
    return {
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.__dict__.items()},
        "backend": "llama.cpp",
        "device": "cpu",
        "threads": threads,
        "environment": {**environment(), "llama_cpp": llama_cpp_environment()},
        "gguf": files,
        "decode": decode,
    }


def plot_generate_bench(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("decode_tokens_per_second", "decode tokens/s (1 / median token time)", True),
        ("speedup_vs_teacher", "decode speed / teacher's", False),
        ("prefill_seconds", "prefill seconds", True),
        ("cache_mb", "cache MB after decode", True),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2))
    for ax, (key, label, log) in zip(axes, panels):
        for i, (name, rows) in enumerate(result["decode"].items()):
            pts = [
                (r["context"], r[key])
                for r in rows
                if "skipped" not in r and r.get(key) is not None and r[key] > 0
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=name)
            if key == "decode_tokens_per_second":  # interquartile range of the token times
                band = [
                    (r["context"], 1000 / r["decode_ms_per_token_p75"], 1000 / r["decode_ms_per_token_p25"])
                    for r in rows
                    if "decode_ms_per_token_p25" in r
                ]
                if band:
                    ax.fill_between(*zip(*band), color=f"C{i}", alpha=0.15, linewidth=0)
        if key == "speedup_vs_teacher":
            ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    compiled = sorted(
        name for name, how in result.get("compiled_decode_step", {}).items() if how == "compiled"
    )
    note = f"; compiled decode step: {', '.join(compiled)}" if compiled else ""
    where = f"{result['device']} ({result['environment'].get('cuda') or result['environment'].get('processor')}, {result['threads']} threads)"
    if result.get("backend") == "llama.cpp":
        version = result["environment"].get("llama_cpp", {}).get("llama_cpp_python")
        fig.suptitle(
            f"llama.cpp (llama-cpp-python {version}) on {where}, GGUF {' / '.join(result['settings']['quants'])}: teacher and students at the same type",
            fontsize=10,
        )
    else:
        formats = " / ".join(result["settings"].get("formats") or ["float32"])
        fig.suptitle(f"generation on {where}, weights {formats}{note}", fontsize=10)
    return _save_figure(fig, path)


def format_generate_bench(result: dict) -> str:
    """The table ``bench generate`` prints: per model, tokens/s | prefill s | cache MB at each context."""
    engine = "llama.cpp, " if result.get("backend") == "llama.cpp" else ""
    lines = [
        f"decode ({engine}{result['device']}, {result['threads']} threads): tokens/s | prefill s | cache MB, by context"
    ]
    for name, rows in result["decode"].items():
        cells = []
        for r in rows:
            if "skipped" in r:
                cells.append(f"{r['context']}: skipped")
            else:
                speedup = f" ({r['speedup_vs_teacher']:.2f}x teacher)" if "speedup_vs_teacher" in r else ""
                if "benchmark_vs_plain_generate" in r:  # a user's plain generate beside the rounds
                    speedup += f" [plain generate {r['plain_generate_tokens_per_second']:.2f}]"
                if "fraction_of_bandwidth_bound" in r:
                    speedup += f" [{r['fraction_of_bandwidth_bound']:.0%} of bound]"
                cells.append(
                    f"{r['context']}: {r['decode_tokens_per_second']:.2f}{speedup} | {r['prefill_seconds']:.1f} | {r['cache_mb']:.1f}"
                )
        lines.append(f"  {name:<{max(9, *map(len, result['decode']))}} " + "; ".join(cells))
    return "\n".join(lines)
