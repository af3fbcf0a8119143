"""``attn2ssm bench train``: training throughput of each stage kind against its teacher-side bound.

Each measured stage is the real trainer's (``distill.trainer``'s ``setup_stage`` / ``train_step``:
the same data path, loss, backward, clipping and optimizer step a run takes), on one block length and a
fixed number of tokens per step, in fp32 or under bf16 autocast (``mixed_precision: bf16``, or
``auto``: bf16 where it is fast — attn2ssm/precision.py; rows record what ran). Two teacher-side references run on the same batches:

* the teacher's forward alone (logits, no gradient): the bound a distillation step cannot beat,
  since every stage runs at least that much of the teacher (layer-local stages stop before the
  LM head, so they can come close; KD stages add the student's forward and backward);
* the teacher's own forward + backward (next-token CE, every parameter): what training the
  teacher itself would cost, the reference for a student's training speed on a GPU.

One extra step of each stage runs under ``torch.profiler``; its most expensive operators (self
time) are recorded, to say where the time goes. Results: JSON + PNG (tokens/s per stage kind
and length, with the bound) under benchmarks/results/; the JSON is rewritten (atomically) after
each row, so a run killed part-way keeps every row it measured (``"complete": false`` until the end).

Cases: the stage kinds on a Hedgehog linear-attention and a Mamba-2 student, and ``kd_gdn`` — the
``gdn_hybrid25`` recipe's student (25 % attention, Gated DeltaNet mixers) in its KD stage.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch

from attn2ssm.distill.recipe import (
    DataConfig,
    LogitCacheConfig,
    LoRAConfig,
    OptimConfig,
    Recipe,
    StageConfig,
    StudentConfig,
)

_LINEAR = StudentConfig(
    mixer="linear_attention",
    mixer_options={"feature_map": "hedgehog", "feature_map_options": {"activation": "softmax"}, "window": 64},
)
_MAMBA2 = StudentConfig(mixer="mamba2")
# gdn_hybrid25's student (tests/bench/test_bench_train_rows.py holds it equal to the recipe's):
# gated delta mixers without biases, 25 % softmax attention kept where conversion hurts most
_GDN = StudentConfig(
    mixer="gated_delta",
    mixer_options={"norm_eps": "auto", "gate_bias": False, "beta_bias": False, "conv_bias": False},
    attention_ratio=0.25,
    keep_attention="auto",
    auto_calibration_blocks=2,
)

# name → (student, stage): the stage kinds the benchmark runs, each as a recipe would set it up
CASES: dict[str, tuple[StudentConfig, StageConfig]] = {
    "attention_transfer": (
        _LINEAR,
        StageConfig(
            name="attention_transfer",
            kind="attention_transfer",
            trainable=["feature_maps"],
            losses={"attention": 0.0, "output_mse": 1.0},
        ),
    ),
    "hidden_alignment": (
        _MAMBA2,
        StageConfig(
            name="hidden_alignment", kind="hidden_alignment", trainable=["mixers"], losses={"distance": "mse"}
        ),
    ),
    "kd_lora": (
        _LINEAR,
        StageConfig(name="kd_lora", kind="kd", trainable=["lora"], lora=LoRAConfig(r=8, alpha=16)),
    ),
    # the same stage reading the teacher's top-64 from a logit cache filled beforehand (every timed step a hit)
    "kd_lora_cached": (
        _LINEAR,
        StageConfig(
            name="kd_lora_cached",
            kind="kd",
            trainable=["lora"],
            lora=LoRAConfig(r=8, alpha=16),
            logit_cache=LogitCacheConfig(top_k=64),
        ),
    ),
    "kd_ce_mixers": (_MAMBA2, StageConfig(name="kd_ce_mixers", kind="kd_ce", trainable=["mixers"])),
    # gdn_hybrid25's finetune stage: KD on the teacher's logits, the mixers trained
    "kd_gdn": (_GDN, StageConfig(name="kd_gdn", kind="kd", trainable=["mixers"])),
}


@dataclass
class TrainBenchSettings:
    teacher: str | None = None
    cases: tuple[str, ...] = tuple(CASES)
    lengths: tuple[int, ...] = (1024,)
    step_tokens: int = 2048  # tokens per optimizer step (batch = step_tokens // length, at least 1)
    precisions: tuple[str, ...] = ("no", "bf16")
    kernels: tuple[str, ...] = ("auto",)  # ops/kernels.py: each point runs under each
    steps: int = 3  # timed steps per point (after one warm-up step)
    threads: int | None = None
    profile: bool = True
    # teacher-side rates measured beside each point
    references: tuple[str, ...] = ("teacher_forward", "teacher_fwd_bwd")
    corpus: str = "sotu"
    extra: dict = field(default_factory=dict)


def _recipe(
    settings: TrainBenchSettings, case: str, length: int, precision: str, kernels: str = "auto"
) -> Recipe:
    student, stage = CASES[case]
    batch = max(1, settings.step_tokens // length)
    steps = settings.steps + 1 + int(settings.profile)
    stage = replace(
        stage,
        tokens=steps * batch * length,
        batch_size=batch,
        save_every=0,
        eval_every=0,
        optim=OptimConfig(lr=1e-4),
    )
    # (no final evaluation runs: the bench never finishes the run)
    return Recipe(
        name=f"bench-{case}",
        teacher=settings.teacher or "smollm2-135m",
        device="cpu" if not torch.cuda.is_available() else "auto",
        mixed_precision=precision,
        kernels=kernels,
        data=DataConfig(corpus=settings.corpus, block_len=length, max_heldout_tokens=2 * length),
        student=student,
        stages=[stage],
    )


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _top_ops(prof, n: int = 8) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [
        {
            "op": e.key,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
            "calls": e.count,
        }
        for e in rows[:n]
    ]


def _teacher_rates(distiller, batches, names) -> dict:
    """Tokens/s of the teacher's forward (logits, no grad) and its own forward + backward (CE)."""
    teacher = distiller.teacher
    device = distiller.acc.device
    out = {}
    for name in names:
        grad = name == "teacher_fwd_bwd"
        teacher.requires_grad_(grad)
        times = []
        for i, ids in enumerate(batches):
            _sync(device)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(grad), distiller.acc.autocast():
                logits = teacher(input_ids=ids, use_cache=False).logits
                if grad:
                    loss = torch.nn.functional.cross_entropy(
                        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
                    )
            if grad:
                loss.backward()
                teacher.zero_grad(set_to_none=True)
            _sync(device)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        out[name] = batches[0].numel() / statistics.median(times)
    teacher.requires_grad_(False)
    return out


def _fill_cache(distiller, run) -> dict:
    """Fill a cached case's logit cache for every step the point will take (so each timed step is a
    hit); the fill's rate (teacher forward + top-k + write, per token) and the bytes per token."""
    from attn2ssm.distill.batches import micro_batches

    cache, blocks = run.logit_cache, 0
    _sync(distiller.acc.device)
    t0 = time.perf_counter()
    for step in range(run.steps):
        for batch in micro_batches(run, step, distiller.blocks, distiller.recipe.seed, distiller.acc)[1]:
            with distiller.acc.autocast():
                cache.targets(distiller.teacher, batch["input_ids"])
            blocks += len(batch["input_ids"])
    _sync(distiller.acc.device)
    seconds = time.perf_counter() - t0
    files = list(cache.dir.rglob("*.safetensors"))
    tokens = blocks * run.seq_len
    cache.stats.hits = cache.stats.misses = 0
    return {
        "top_k": cache.top_k,
        "fill_tokens_per_s": tokens / seconds,
        "bytes_per_token": sum(f.stat().st_size for f in files) / (len(files) * run.seq_len),
    }


def _timed_steps(distiller, run, steps: int, progress) -> tuple[list[float], int]:
    """Run ``steps`` + 1 training steps (the first a warm-up); the seconds of each but the first and
    the tokens of the last step."""
    from attn2ssm.distill.trainer import train_step  # heavy: transformers

    times, tokens = [], 0
    for step in range(steps + 1):
        _sync(distiller.acc.device)
        t0 = time.perf_counter()
        tokens, *_ = train_step(distiller, run, step)
        _sync(distiller.acc.device)
        if step:
            times.append(time.perf_counter() - t0)
        progress()
    return times, tokens


def _profiled_ops(distiller, run, step: int) -> list[dict]:
    """The top ops (``_top_ops``) of one more training step under the CPU profiler."""
    from torch.profiler import ProfilerActivity, profile

    from attn2ssm.distill.trainer import train_step

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(distiller, run, step)
    return _top_ops(prof)


def _open_point(recipe: Recipe, tmp: str, teacher, tokenizer):
    """The point's trainer, loaded (teacher, data, student) and its one stage set up: (distiller, run)."""
    from attn2ssm.distill.trainer import Distiller, load_for_steps, setup_stage  # heavy: transformers

    # a private cache: the point measures hits, and leaves nothing behind
    if recipe.stages[0].logit_cache is not None:
        recipe.stages[0].logit_cache = replace(recipe.stages[0].logit_cache, dir=f"{tmp}/logit_cache")
    distiller = Distiller(recipe, f"{tmp}/run", progress=False, teacher=teacher, tokenizer=tokenizer)
    load_for_steps(distiller)
    run = setup_stage(distiller, 0)
    if len(distiller.blocks) < run.steps * recipe.stages[0].batch_size:
        raise ValueError(f"corpus too small for {run.steps} steps of {recipe.data.block_len}-token blocks")
    return distiller, run


def _measure(settings: TrainBenchSettings, distiller, run, progress) -> dict:
    """The point's numbers: the stage's step times, its profile, the teacher's rates on the same
    batches and (a cached case) the logit cache's fill and hits."""
    cache = _fill_cache(distiller, run) if run.logit_cache is not None else None
    times, tokens = _timed_steps(distiller, run, settings.steps, progress)
    ops = _profiled_ops(distiller, run, settings.steps + 1) if settings.profile else []
    batch = run.cfg.batch_size
    batches = [
        distiller.blocks[i * batch : (i + 1) * batch].to(distiller.acc.device)
        for i in range(settings.steps + 1)
    ]
    if cache is not None:
        cache["hits"], cache["misses"] = run.logit_cache.stats.hits, run.logit_cache.stats.misses
    return {
        "batch": batch,
        "tokens_per_s": tokens / statistics.median(times),
        "step_seconds": [round(t, 4) for t in times],
        "trainable_params": sum(p.numel() for p in run.params),
        **_teacher_rates(distiller, batches, settings.references),
        "top_ops": ops,
        **({"logit_cache": cache} if cache is not None else {}),
    }


def measure_point(
    settings: TrainBenchSettings,
    case: str,
    length: int,
    precision: str,
    kernels: str,
    teacher,
    tokenizer,
    progress,
) -> dict:
    """One point of ``bench train``: ``case`` at ``length`` tokens under ``precision`` and
    ``kernels``, timed through the real trainer's step beside the teacher's rates (``progress()``
    after each timed step)."""
    recipe = _recipe(settings, case, length, precision, kernels)
    with tempfile.TemporaryDirectory(prefix="attn2ssm-bench-train-") as tmp:
        distiller, run = _open_point(recipe, tmp, teacher, tokenizer)
        # auto resolved for this machine
        used, kernels_used = distiller.precision.used, distiller.kernels.used
        numbers = _measure(settings, distiller, run, progress)
        del run, distiller
    row = {
        "case": case,
        "kind": CASES[case][1].kind,
        "mixer": CASES[case][0].mixer,
        "length": length,
        "precision": used,
        "precision_requested": precision,
        "kernels": kernels_used,
        "kernels_requested": kernels,
        **numbers,
    }
    for name, key in (
        ("teacher_forward", "fraction_of_forward_bound"),
        ("teacher_fwd_bwd", "vs_teacher_fwd_bwd"),
    ):
        if name in row:
            row[key] = row["tokens_per_s"] / row[name]
    return row


def run_train_bench(settings: TrainBenchSettings, progress: bool = True, on_row=None) -> dict:
    """Every point of ``settings``; ``on_row(result)`` after each row is measured, with the result
    so far (``"complete": False`` until the last row: the command rewrites its JSON there)."""
    from tqdm.auto import tqdm

    from attn2ssm.eval.report import environment
    from attn2ssm.teachers import load_teacher

    if settings.threads:
        torch.set_num_threads(settings.threads)
    unknown = [c for c in settings.cases if c not in CASES]
    if unknown:
        from attn2ssm.errors import ConfigError

        raise ConfigError(f"unknown stage case(s) {unknown}", f"choose from {', '.join(CASES)}")
    teacher, tokenizer, source = load_teacher(settings.teacher)
    points = [
        (c, n, p, k)
        for c in settings.cases
        for n in settings.lengths
        for p in settings.precisions
        for k in settings.kernels
    ]
    bar = tqdm(total=len(points) * (settings.steps + 1), desc="bench train", disable=not progress)
    result = {
        "environment": environment(),
        "threads": torch.get_num_threads(),
        "teacher": source.describe(),
        "step_tokens": settings.step_tokens,
        "timed_steps": settings.steps,
        "complete": False,
        "rows": [],
    }
    for i, (case, length, precision, kernels) in enumerate(points):
        bar.set_postfix(case=case, length=length, precision=precision, kernels=kernels)
        result["rows"].append(
            measure_point(
                settings, case, length, precision, kernels, teacher, tokenizer, lambda: bar.update(1)
            )
        )
        result["complete"] = i == len(points) - 1
        if on_row is not None:
            on_row(result)
    bar.close()
    result["complete"] = True
    return result


def format_train_bench(result: dict) -> str:
    lines = [
        f"training tokens/s ({result['threads']} threads; bound = teacher forward on the same batch)",
        f"{'case':<20} {'len':>5} {'prec/kern':>11} {'tok/s':>8} {'bound':>8} {'of bound':>9} {'teacher f+b':>12}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['case']:<20} {r['length']:>5} {r['precision'] + '/' + r.get('kernels', 'torch'):>11} {r['tokens_per_s']:>8.0f} {r['teacher_forward']:>8.0f} "
            f"{r['fraction_of_forward_bound']:>8.0%} {r['teacher_fwd_bwd']:>12.0f}"
        )
    return "\n".join(lines)


def plot_train_bench(result: dict, path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['case']}\n{r['length']} {r['precision']} {r.get('kernels', 'torch')}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], width=0.4, label="stage step")
    ax.bar(
        [i + 0.2 for i in x],
        [r["teacher_forward"] for r in rows],
        width=0.4,
        label="teacher forward (bound)",
        alpha=0.6,
    )
    for i, r in zip(x, rows):
        ax.text(
            i - 0.2,
            r["tokens_per_s"],
            f"{r['fraction_of_forward_bound']:.0%}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title(
        f"training throughput vs the teacher's forward ({result['threads']} threads, {result['environment']['processor']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


__all__ = ["CASES", "TrainBenchSettings", "format_train_bench", "plot_train_bench", "run_train_bench"]
