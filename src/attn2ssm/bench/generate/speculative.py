"""``bench generate --spec``: speculative decoding with the student as the target (acceptance,
tokens per target forward, speedup over the target's own plain greedy decode) for each drafter and
K, on the corpus' own text and on a passage the prompt asks to repeat."""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import torch

from attn2ssm.bench.generate.models import BenchSettings, build_models, prompt_ids
from attn2ssm.bench.generate.timing import quantile
from attn2ssm.bench.results import save_figure
from attn2ssm.generation.drafters import Runner
from attn2ssm.generation.speculative import speculative_generate


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
    plain = quantile(plain_times, 0.5)
    by_drafter = {
        name: [_spec_row(k, runs[name, k], prompt.shape[1], plain, reference, new_tokens) for k in ks]
        for name in drafts
    }
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


def _spec_row(k, runs: list, prompt_len: int, plain: float, reference: list[int], new_tokens: int) -> dict:
    """One drafter at one K: the median of its ``runs`` ((seconds, output) a round), its speedup
    over the plain decode's median ``plain`` seconds, and whether every run decoded ``reference``."""
    seconds = quantile([t for t, _ in runs], 0.5)
    out = runs[0][1]
    tokens = out.sequences[0, prompt_len:].tolist()
    return {
        "k": k,
        "seconds": seconds,
        "seconds_all": [round(t, 4) for t, _ in runs],
        "tokens_per_second": len(tokens) / seconds,
        "speedup": plain / seconds * len(tokens) / new_tokens,
        "tokens_per_target_forward": out.stats.tokens_per_round,
        "identical_to_plain_greedy": all(
            r.sequences[0, prompt_len:].tolist() == reference[: len(tokens)] for _, r in runs
        ),
        **out.stats.as_dict(),
    }


COPY_INSTRUCTION = "\n\nRepeat the passage above word for word.\n\n"

COPY_PASSAGE, COPY_PRIMER = 256, 8

COPY_PASSAGE, COPY_PRIMER = 256, 8


def copy_prompt(tokenizer, corpus: str, length: int, device) -> tuple[torch.Tensor, list[int]]:
    """A prompt where prompt lookup should shine: ``length`` tokens ending in a passage of the
    corpus, an instruction to repeat it and the passage's first ``COPY_PRIMER`` tokens; returns
    it and the passage's rest (what a faithful copy continues with)."""
    instruction = tokenizer(COPY_INSTRUCTION, add_special_tokens=False)["input_ids"]
    filler = length - COPY_PASSAGE - len(instruction) - COPY_PRIMER
    if filler < 0:
        raise ValueError(f"a copy prompt needs at least {length - filler} tokens, not {length}")
    ids = prompt_ids(tokenizer, corpus, filler + COPY_PASSAGE, device)[0].tolist()
    passage = ids[filler:]
    prompt = ids[:filler] + passage + instruction + passage[:COPY_PRIMER]
    return torch.tensor([prompt], device=device), passage[COPY_PRIMER:]


def _spec_targets(teacher, names: tuple[str, ...], device) -> dict:
    """name → target: ``NAME=DIR`` loads a trained student, a bare name converts an untrained
    one (``build_models``)."""
    return build_models(teacher, names, device)


def run_spec_bench(settings: BenchSettings, progress: bool = True) -> dict:
    """``bench generate --spec``: each target (a pure Mamba-2 and a 25 % hybrid student) with each
    drafter (prompt lookup, and ``--draft`` models), at each context, on two tasks: the corpus'
    own text (``continue``) and a passage to repeat (``copy``), where lookup should shine."""
    from tqdm.auto import tqdm

    from attn2ssm.teachers import load_teacher

    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    teacher, tokenizer, _ = load_teacher(settings.teacher, device=device)
    targets = _spec_targets(teacher, settings.spec_targets, device)
    drafts = _spec_drafters(settings, device)
    if settings.cpu_layout and device.type == "cpu":
        from attn2ssm.decode.layout import cpu_decode_layout

        for model in [*targets.values(), *(d for d in drafts.values() if not isinstance(d, str))]:
            cpu_decode_layout(model)
    longest = max(settings.spec_contexts)
    text = prompt_ids(tokenizer, settings.corpus, longest, device)
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
    return _spec_result(settings, device, drafts, rows)


def _spec_drafters(settings: BenchSettings, device) -> dict:
    """name → drafter: each of ``spec_drafters`` by its name (prompt lookup, no model), and each
    ``--draft`` model as ``model:<its folder>``."""
    from attn2ssm.student.loading import load_model_and_tokenizer

    drafts: dict = {name: name for name in settings.spec_drafters}
    for path in settings.draft or ():
        model, _ = load_model_and_tokenizer(path)
        drafts[f"model:{Path(path).name if Path(path).name != 'student' else Path(path).parent.name}"] = (
            model.to(device).eval()
        )
    return drafts


def _spec_result(settings: BenchSettings, device, drafts: dict, rows: list[dict]) -> dict:
    """The JSON of ``bench generate --spec``: settings, machine, what each target and drafter is, the rows."""
    from attn2ssm.eval.report import environment

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
                # "auto" drawn right of the fixed K
                ks = [r["k"] if r["k"] != "auto" else max(fixed, default=0) + 2 for r in rows]
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
    return save_figure(fig, path)


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
