"""How ``bench generate`` times a model: a backend (``DecodeBackend``: the torch one wraps an HF
model or a student, llama.cpp's a GGUF) answers ``prefill`` and ``decode_round``; every model
prefills once, then decodes from copies of its prefilled state, the models taking turns within a
round (``measure_decode_interleaved``); rows by context (``decode_by_context``) with rates from the
median per-token time, memory growth and cache size."""

from __future__ import annotations

import copy
import ctypes
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from attn2ssm.bench.generate.models import BenchSettings
from attn2ssm.hf_compat import CACHE_KWARG


def _status_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Memory:
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


class DecodeBackend:
    """One model as the benchmark times it: ``prefill`` a prompt once, then ``decode_round`` from
    that state as often as asked (each round from the state as the prefill left it). The torch
    backend (``TorchBackend``) wraps an HF model or a student; llama.cpp's runs a GGUF
    (``llama_cpp.LlamaCppBench``)."""

    def prefill(self, prompt: torch.Tensor) -> dict:
        """Prefill ``prompt`` (1, L) and take its first new token: ``seconds``, ``peak_growth_mb``,
        ``ids`` (the prompt extended by that token) and the state the rounds start from."""
        raise NotImplementedError

    def decode_round(self, prefilled: dict, new_tokens: int) -> dict:
        """Greedy ``new_tokens`` from the prefilled state: per-token ``seconds`` (the first token's
        time left out), ``peak_growth_mb``, ``cache_mb`` and the ``tokens``."""
        raise NotImplementedError

    def plain_generate(self, prompt: torch.Tensor, new_tokens: int) -> dict | None:
        """A user's plain generate over ``prompt``, the rounds' reference (``plain_generate``); None
        where the backend has none."""
        return None

    def release(self, prefilled: dict) -> None:
        """Free what a prefill holds outside the dict's tensors (nothing, unless the backend says)."""


class TorchBackend(DecodeBackend):
    """An HF model or a student decoding through ``generate`` (HF's own loop, KV cache for the
    teacher, our cache for students), its times stamped by a streamer."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> dict:
        """Prefill through ``generate`` (one new token); the state is the cache holding L tokens."""
        memory = Memory(prompt.device)
        memory.start()
        clock, cache = _Clock(), _new_cache(self.model)
        start = time.perf_counter()
        out = _greedy(self.model, prompt, cache, 1, clock)
        return {
            "seconds": clock.times[1] - start,
            "peak_growth_mb": memory.peak_growth_mb(),
            "cache": cache,
            "ids": out,
        }

    @torch.no_grad()
    def decode_round(self, prefilled: dict, new_tokens: int) -> dict:
        """From a copy of the prefilled cache (the first token's time, which includes generate's
        set-up, is left out)."""
        cache = copy.deepcopy(prefilled["cache"])
        memory = Memory(prefilled["ids"].device)
        memory.start()
        clock = _Clock()
        out = _greedy(self.model, prefilled["ids"], cache, new_tokens, clock)
        t = clock.times  # t[0]: prompt handed over, t[i]: i-th new token
        return {
            "seconds": [b - a for a, b in zip(t[1:], t[2:])],
            "peak_growth_mb": memory.peak_growth_mb(),
            "cache_mb": cache_bytes(cache) / 2**20,
            "tokens": out[0, prefilled["ids"].shape[1] :].tolist(),
        }

    def plain_generate(self, prompt: torch.Tensor, new_tokens: int) -> dict:
        return plain_generate(self.model, prompt, new_tokens)


def backend(model) -> DecodeBackend:
    """``model`` itself when it is a backend (a GGUF's ``LlamaCppBench``), else the torch backend of it."""
    return model if isinstance(model, DecodeBackend) else TorchBackend(model)


def prefill(model, prompt: torch.Tensor) -> dict:
    """Prefill ``prompt`` (1, L) through ``model``'s backend (``DecodeBackend.prefill``)."""
    return backend(model).prefill(prompt)


def decode_round(model, prefilled: dict, new_tokens: int) -> dict:
    """Greedy ``new_tokens`` from a prefilled state through ``model``'s backend (``DecodeBackend.decode_round``)."""
    return backend(model).decode_round(prefilled, new_tokens)


@torch.no_grad()
def warm_up(model, prompt: torch.Tensor, new_tokens: int = 3) -> None:
    """Greedy ``new_tokens`` through ``generate`` from a fresh cache, untimed: what compiles a
    student's decode step before any timing."""
    _greedy(model, prompt, _new_cache(model), new_tokens, _Clock())


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
        "sum_gb_per_s": quantile(sums, 0.5),
        "copy_gb_per_s": quantile(copies, 0.5),
        "sum_all": [round(v, 2) for v in sums],
        "copy_all": [round(v, 2) for v in copies],
        "tensor_mb": megabytes,
        "threads": torch.get_num_threads(),
    }


def quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def decode_row(length: int, pre: dict, rounds: list[dict], plain: list[dict] | None = None) -> dict:
    """One model at one context: rates from the median per-token time over every round; with
    ``plain`` (``plain_generate`` runs taking turns with the rounds) the same for a user's plain
    ``generate``, the benchmark's rate over it, and whether both chose the same tokens."""
    times = [s for r in rounds for s in r["seconds"]]
    median = quantile(times, 0.5)
    check = {}
    if plain:
        plain_times = [s for r in plain for s in r["seconds"]]
        plain_median = quantile(plain_times, 0.5)
        # a round decodes after the prefill's token; plain's tokens start with it
        n = len(rounds[0]["tokens"])
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
        "decode_ms_per_token_p25": 1000 * quantile(times, 0.25),
        "decode_ms_per_token_p75": 1000 * quantile(times, 0.75),
        "decode_ms_per_token_mean": 1000 * sum(times) / len(times),
        "timed_tokens": len(times),
        "rounds": len(rounds),
        "same_tokens_every_round": all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
        "cache_mb": rounds[0]["cache_mb"],
        "prefill_peak_growth_mb": pre["peak_growth_mb"],
        "decode_peak_growth_mb": max(
            (r["peak_growth_mb"] for r in rounds if r["peak_growth_mb"] is not None), default=None
        ),
        # recorded, not hidden
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
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
        # e.g. a teacher's one-forward prefill of a long prompt on a GPU
        except torch.OutOfMemoryError as exc:
            skipped[name] = {
                "context": prompt.shape[1],
                "skipped": f"out of memory on {prompt.device} in the prefill: {str(exc).splitlines()[0][:160]}",
            }
            if prompt.device.type == "cuda":
                torch.cuda.empty_cache()
    backends = {name: backend(models[name]) for name in pres}
    done: dict[str, list] = {name: [] for name in pres}
    plain: dict[str, list] = {name: [] for name in pres}
    for _ in range(rounds):
        for name in pres:
            done[name].append(decode_round(backends[name], pres[name], new_tokens))
            reference = backends[name].plain_generate(prompt, new_tokens) if plain_check else None
            if reference is not None:
                plain[name].append(reference)
    rows = {name: decode_row(prompt.shape[1], pres[name], done[name], plain[name]) for name in pres}
    for name, pre in pres.items():
        backends[name].release(pre)
    pres.clear()  # the caches (a long KV cache is GBs) go before the next context
    return {name: rows.get(name) or skipped[name] for name in models}


def decode_by_context(models: dict, settings: BenchSettings, prompt: torch.Tensor, progress: bool) -> dict:
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
    # how many times faster than the teacher, from the medians, where both ran
    for (
        name,
        rows,
    ) in decode.items():
        ref = reference_name(name)
        if name != ref and ref in decode:
            for row, base in zip(rows, decode[ref]):
                if "skipped" not in row and "skipped" not in base:
                    row["speedup_vs_teacher"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
        # the same model in float32 (torch formats; llama.cpp rows have none)
        model, sep, _ = name.partition("@")
        if sep and model in decode:
            for row, base in zip(rows, decode[model]):
                if "skipped" not in row and "skipped" not in base:
                    row["speedup_vs_float32"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
    return decode


def reference_name(name: str) -> str:
    """The teacher row a model is compared with: ``teacher``, or ``teacher@q8_0`` for ``mamba2@q8_0``."""
    _, sep, quant = name.partition("@")
    return "teacher" + sep + quant
