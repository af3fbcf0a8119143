"""Attention fidelity: how closely a student's mixing weights follow its teacher's softmax.

Teacher-forced: the teacher runs once, up to the last scored layer, and ``adapters.capture``
records each attention module's input (hidden states and RoPE ``position_embeddings``); for
every layer where the student has a mixer with a materialisable mixing matrix
(``mixer.attention_weights``) both maps are computed from the *same* layer input — so a layer's
numbers measure that layer's approximation alone, not errors accumulated in the layers below it.

Per layer (the measures of Hedgehog, Zhang et al. "The Hedgehog & the Porcupine"):

* ``kl`` — KL(A_t ‖ A_s) = Σ_j a^t_ij log((a^t_ij + ε) / (a^s_ij + ε)), ε = 1e-12, averaged over
  real (non-padded) query rows and heads (nats);
* ``entropy_teacher`` / ``entropy_student`` — mean row entropy −Σ_j a_ij log(a_ij + ε) ("spikiness");
* ``spearman_student`` — monotonicity: Spearman rank correlation, per query row, between the
  teacher's scaled logits q_i·k_j·scaling and the student's weights a^s_ij over the keys the
  teacher lets that query see (causal, the layer's sliding window, no padding); averaged over rows
  with at least 3 such keys. ``spearman_teacher`` is the same for the teacher's own weights —
  the reference (≈ 1: softmax, and soft-capping, are monotone in the logit).

Spearman here is Pearson's correlation of *average* ranks (ties share the mean of the ranks
they span, as ``scipy.stats.spearmanr`` does). A row in which either variable is constant over
its keys (e.g. all-equal weights) has no defined correlation and is left out of the average;
``spearman_rows`` in each layer entry counts the rows that entered it.

All math runs in float32 under ``torch.no_grad()``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from attn2ssm.adapters import capture_attention_io, get_adapter
from attn2ssm.adapters.masking import allowed_keys
from attn2ssm.data import prepare_corpus
from attn2ssm.errors import ConfigError, DataError
from attn2ssm.eval.report import environment

EPS = 1e-12
MIN_KEYS = 3
METRICS = ("kl", "entropy_teacher", "entropy_student", "spearman_student", "spearman_teacher")


# ------------------------------------------------------------------------------------ rank statistics
def average_ranks(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Ranks 0..m-1 of ``x`` along the last dim; tied values get the mean of their ranks.

    ``valid`` (same shape, bool) limits ranking to those entries: invalid entries are sorted
    after every valid one (so valid ranks stay 0..m-1) and their ranks are meaningless.
    Vectorised: one sort, tie groups found between sorted neighbours, no Python loop.
    """
    x = x.float()
    n = x.shape[-1]
    if valid is not None:
        x = x.masked_fill(~valid, math.inf)
    sorted_x, order = torch.sort(x, dim=-1, stable=True)
    idx = torch.arange(n, device=x.device).expand_as(sorted_x)
    same_as_prev = torch.zeros_like(sorted_x, dtype=torch.bool)
    same_as_prev[..., 1:] = sorted_x[..., 1:] == sorted_x[..., :-1]
    # First and last sorted position of each tie group.
    start = torch.where(same_as_prev, torch.zeros_like(idx), idx).cummax(-1).values
    same_as_next = torch.zeros_like(same_as_prev)
    same_as_next[..., :-1] = same_as_prev[..., 1:]
    end_marked = torch.where(same_as_next, torch.full_like(idx, n - 1), idx)
    end = end_marked.flip(-1).cummin(-1).values.flip(-1)
    rank_sorted = (start + end).float() / 2
    return torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)


def spearman(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman ρ of ``x`` and ``y`` along the last dim, over the ``valid`` entries of each row.

    Returns one value per row; NaN where a row has fewer than 2 valid entries or either
    variable is constant over them (no defined correlation).
    """
    if valid is None:
        valid = torch.ones_like(x, dtype=torch.bool)
    valid = valid.expand_as(x)
    rx, ry = average_ranks(x, valid), average_ranks(y, valid)
    w = valid.float()
    n = w.sum(-1, keepdim=True)
    mx = (rx * w).sum(-1, keepdim=True) / n.clamp_min(1)
    my = (ry * w).sum(-1, keepdim=True) / n.clamp_min(1)
    dx, dy = (rx - mx) * w, (ry - my) * w
    cov = (dx * dy).sum(-1)
    var = (dx * dx).sum(-1) * (dy * dy).sum(-1)
    rho = cov / var.clamp_min(1e-30).sqrt()
    undefined = (n.squeeze(-1) < 2) | (var <= 1e-20)
    return rho.masked_fill(undefined, math.nan)


# ------------------------------------------------------------------------------------ teacher vs student maps
def _mixer_layers(student) -> dict[int, nn.Module]:
    """Student layers whose mixer exposes a (b, h, l, l) mixing matrix."""
    return {i: m for i, m in student.mixers().items() if callable(getattr(m, "attention_weights", None))}


def _check_pair(student, teacher) -> None:
    if not _matches(student, teacher):
        raise ValueError(
            f"student ({len(student.config.layer_plan)} layers, hidden {_student_hidden(student)}) does not match the "
            f"teacher ({teacher.config.num_hidden_layers} layers, hidden {teacher.config.hidden_size}): pass the student's own teacher"
        )


def _student_hidden(student) -> int | None:
    geometry = student.config.layer_geometry
    return geometry[0]["hidden_size"] if geometry else None


def _matches(student, teacher) -> bool:
    return (
        len(student.config.layer_plan) == teacher.config.num_hidden_layers
        and _student_hidden(student) == teacher.config.hidden_size
    )


@torch.no_grad()
def _layer_maps(student, teacher, input_ids, attention_mask=None, layers=None):
    """Yields (layer, A_t, A_s, scaled logits, allowed keys (b|1, 1, l, l)) per selected mixer layer."""
    _check_pair(student, teacher)
    adapter = get_adapter(teacher)
    mixers = _mixer_layers(student)
    selected = sorted(mixers) if layers is None else [i for i in layers if i in mixers]
    device = next(teacher.parameters()).device
    input_ids = input_ids.to(device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if attention_mask.dim() == 1:
            attention_mask = attention_mask[None]
        if bool(attention_mask.all()):
            attention_mask = None
    io = capture_attention_io(teacher, input_ids, selected, attention_mask)
    for i in selected:
        attn, hidden, pos = io[i].module, io[i].hidden_states, io[i].position_embeddings
        geometry = adapter.layer_geometry(attn)
        if pos is None and geometry.rotary_dim:
            pos = adapter.rotary_embeddings(teacher, hidden, None, i)
        a_t = adapter.attention_probs(attn, hidden, pos, attention_mask).float()
        q, k = adapter.qk(attn, hidden, pos)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
        logits = (q.float() @ k.float().transpose(-1, -2)) * geometry.scaling
        mixer = mixers[i]
        p = next(mixer.parameters())
        s_pos = None if pos is None else tuple(t.to(device=p.device, dtype=p.dtype) for t in pos)
        s_mask = None if attention_mask is None else attention_mask.to(p.device)
        a_s = (
            mixer.attention_weights(hidden.to(device=p.device, dtype=p.dtype), s_pos, s_mask)
            .float()
            .to(a_t.device)
        )
        allowed = allowed_keys(hidden.shape[1], geometry.sliding_window, attention_mask, device=a_t.device)
        yield i, a_t, a_s, logits, allowed


def _layer_metrics(a_t, a_s, logits, allowed, attention_mask) -> dict:
    b, h, l, _ = a_t.shape
    rows = torch.ones(b, l, dtype=torch.bool, device=a_t.device)
    if attention_mask is not None:
        rows = attention_mask.to(a_t.device).bool()
    rows = rows[:, None, :].expand(b, h, l)  # real query rows
    n_rows = rows.sum().clamp_min(1)

    def row_mean(x):  # (b, h, l) → scalar over real rows
        return float((x * rows).sum() / n_rows)

    kl = (a_t * (torch.log(a_t + EPS) - torch.log(a_s + EPS))).sum(-1)  # (b, h, l)
    ent_t = -(a_t * torch.log(a_t + EPS)).sum(-1)
    ent_s = -(a_s * torch.log(a_s + EPS)).sum(-1)

    valid = allowed.expand(b, h, l, l)
    enough = rows & (valid.sum(-1) >= MIN_KEYS)
    rho_s = spearman(logits, a_s, valid)
    rho_t = spearman(logits, a_t, valid)

    def rho_mean(rho):
        ok = enough & ~torch.isnan(rho)
        return (float(rho[ok].mean()) if ok.any() else math.nan), int(ok.sum())

    spearman_student, n_s = rho_mean(rho_s)
    spearman_teacher, n_t = rho_mean(rho_t)
    kl_head = (kl * rows).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
    return {
        "kl": row_mean(kl),
        "entropy_teacher": row_mean(ent_t),
        "entropy_student": row_mean(ent_s),
        "spearman_student": spearman_student,
        "spearman_teacher": spearman_teacher,
        "kl_per_head": [float(v) for v in kl_head],
        "query_rows": int(rows.sum()),
        "spearman_rows": n_s,
        "spearman_rows_teacher": n_t,
    }


def _nanmean(values) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


@torch.no_grad()
def attention_fidelity(student, teacher, input_ids, attention_mask=None, *, layers=None) -> dict:
    """Per-layer fidelity of ``student``'s mixing weights to ``teacher``'s softmax (teacher-forced).

    ``input_ids`` (b, l) or (l,); ``attention_mask`` an optional (b, l) 0/1 padding mask;
    ``layers`` limits the layers (default: every student layer with a mixer that has
    ``attention_weights``). Returns ``{"layers": [{layer, kl, entropy_teacher, entropy_student,
    spearman_student, spearman_teacher, kl_per_head, query_rows, spearman_rows,
    spearman_rows_teacher}], "mean": {metric: mean over layers}, "tokens": b·l real tokens}``.
    """
    mask = attention_mask
    if mask is not None:  # beside the maps, on the teacher's device
        mask = (mask[None] if mask.dim() == 1 else mask).to(next(teacher.parameters()).device)
    out = []
    for i, a_t, a_s, logits, allowed in _layer_maps(student, teacher, input_ids, mask, layers):
        out.append({"layer": i, **_layer_metrics(a_t, a_s, logits, allowed, mask)})
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    tokens = int(ids.numel() if mask is None else mask.sum())
    return {
        "layers": out,
        "mean": {k: _nanmean([r[k] for r in out]) for k in METRICS},
        "tokens": tokens,
        "eps": EPS,
    }


def format_table(result: dict) -> str:
    """The per-layer table the CLI prints."""
    head = (
        f"{'layer':>5} {'KL(t‖s)':>9} {'H teacher':>10} {'H student':>10} {'ρ student':>10} {'ρ teacher':>10}"
    )
    lines = [head]

    def row(name, r):
        return (
            f"{name:>5} {r['kl']:>9.4f} {r['entropy_teacher']:>10.3f} {r['entropy_student']:>10.3f} "
            f"{r['spearman_student']:>10.3f} {r['spearman_teacher']:>10.3f}"
        )

    lines += [row(str(r["layer"]), r) for r in result["layers"]]
    if result["layers"]:
        lines.append(row("mean", result["mean"]))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ heat-maps
def _pick(values: list[int], k: int = 3) -> list[int]:
    """Up to k evenly spread items (first, middle, last)."""
    if len(values) <= k:
        return list(values)
    return [values[round(j * (len(values) - 1) / (k - 1))] for j in range(k)]


@torch.no_grad()
def plot_attention_maps(
    student,
    teacher,
    tokenizer,
    text: str,
    out_dir,
    layers=None,
    heads=None,
    *,
    max_tokens: int = 128,
    log_scale: bool = True,
    prefix: str = "attention_maps",
) -> list[Path]:
    """Teacher vs student weight heat-maps for ``text`` (teacher-forced), as PNG grids.

    Rows are layers (default: first, middle and last mixer layer), columns teacher | student
    for each head (default: first, middle, last head). Writes ``<prefix>.png`` (linear colour
    scale, one per row of the grid) and, with ``log_scale``, ``<prefix>_log.png`` (log10 scale, floor
    1e-4) which shows how the tail of each row is spread. The text is cut to ``max_tokens``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
    mixer_layers = sorted(_mixer_layers(student))
    layers = _pick(mixer_layers) if layers is None else [i for i in layers if i in mixer_layers]
    if not layers:
        return []
    maps = {
        i: (a_t[0].cpu(), a_s[0].cpu())
        for i, a_t, a_s, _, _ in _layer_maps(student, teacher, ids, None, layers)
    }
    num_heads = next(iter(maps.values()))[0].shape[0]
    heads = _pick(list(range(num_heads))) if heads is None else [h for h in heads if 0 <= h < num_heads]
    paths = []
    for log in (False, True) if log_scale else (False,):  # linear: vmax shared by a row; log: floor 1e-4
        path = out_dir / f"{prefix}{'_log' if log else ''}.png"
        _draw_map_grid(maps, layers, heads, ids.shape[1], log, path)
        paths.append(path)
    return paths


def _draw_map_grid(
    maps: dict, layers: list[int], heads: list[int], length: int, log: bool, path: Path
) -> None:
    """One PNG: a row per layer, teacher | student columns per head, one colour scale per row
    (linear from 0, or log10 with a floor of 1e-4 and the masked upper triangle left blank)."""
    import matplotlib  # heavy: matplotlib, and the Agg backend is chosen only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: as above, once the backend is set
    from matplotlib.colors import LogNorm  # heavy: as above

    nrows, ncols = len(layers), 2 * len(heads)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.3 * ncols, 2.3 * nrows + 0.6), squeeze=False)
    for r, layer in enumerate(layers):
        a_t, a_s = maps[layer]
        # one scale per row (its colour bar)
        vmax = max(max(float(a_t[h].max()), float(a_s[h].max())) for h in heads)
        vmax = max(vmax, 1e-6)
        for c, head in enumerate(heads):
            pair = (a_t[head], a_s[head])
            for j, (who, m) in enumerate(zip(("teacher", "student"), pair)):
                ax = axes[r][2 * c + j]
                if log:
                    shown = m.clamp_min(1e-4).masked_fill(
                        torch.ones_like(m, dtype=torch.bool).triu(1), float("nan")
                    )
                    im = ax.imshow(
                        shown.numpy(), cmap="viridis", norm=LogNorm(vmin=1e-4, vmax=max(vmax, 1e-3))
                    )
                else:
                    im = ax.imshow(m.numpy(), cmap="viridis", vmin=0.0, vmax=vmax)
                ax.set_title(f"L{layer} h{head} {who}", fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
            if c == len(heads) - 1:
                fig.colorbar(im, ax=list(axes[r]), fraction=0.02, pad=0.01)
    scale = "log10 colour scale" if log else "linear colour scale"
    fig.suptitle(
        f"attention weights, teacher vs student ({length} tokens, rows = queries, {scale})", fontsize=9
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------ CLI driver
DEFAULT_TEACHER = "smollm2-135m"


def run_attention_eval(
    model_path: str,
    *,
    against: str | None = None,
    corpus: str = "sotu",
    window: int = 256,
    max_tokens: int | None = 20000,
    blocks: int = 4,
    text: str | None = None,
    out_dir=None,
    json_path=None,
    heatmap_tokens: int = 128,
    device=None,
) -> dict:
    """``attn2ssm eval MODEL --attention``: load the student and its teacher, score, print, write.

    Scores ``blocks`` held-out blocks of ``window`` tokens spread over the corpus' held-out
    stream (the first ``max_tokens`` of it) and/or ``text``; prints a per-layer table per
    input; writes ``attention_fidelity.json`` and heat-maps (from ``text`` if given, else from
    the first held-out block, cut to ``heatmap_tokens``) into ``out_dir`` (default MODEL/eval).
    The teacher is ``against``, else the built-in ``smollm2-135m``.
    """
    if blocks < 0:
        raise ConfigError(
            f"--blocks {blocks} is negative", "use --blocks 0 (only --text) or more, e.g. --blocks 4"
        )
    if blocks == 0 and not text:
        raise ConfigError(
            "--attention with --blocks 0 has nothing to score", 'pass --text "..." or --blocks N'
        )
    teacher_spec = against or DEFAULT_TEACHER
    student, teacher, tokenizer = _load_student_and_teacher(model_path, teacher_spec, device)
    out_dir = Path(out_dir) if out_dir else Path(model_path) / "eval"
    report: dict = {"student": str(model_path), "teacher": teacher_spec, "metrics": list(METRICS), "eps": EPS}
    heatmap_text = text
    if blocks:
        batch = _heldout_blocks(tokenizer, corpus, window, max_tokens, blocks)
        result = attention_fidelity(student, teacher, batch)
        report["heldout"] = {"corpus": corpus, "blocks": len(batch), "window": window, **result}
        print(
            f"attention fidelity, teacher-forced: {len(batch)} held-out block(s) of {window} tokens from {corpus} (teacher {teacher_spec})"
        )
        print(format_table(result))
        if heatmap_text is None:
            heatmap_text = tokenizer.decode(batch[0][:heatmap_tokens])
    if text:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        result = attention_fidelity(student, teacher, ids)
        report["text"] = {"text": text, **result}
        print(f"attention fidelity, teacher-forced: --text ({ids.shape[1]} tokens, teacher {teacher_spec})")
        print(format_table(result))
    paths = plot_attention_maps(student, teacher, tokenizer, heatmap_text, out_dir, max_tokens=heatmap_tokens)
    report["heatmaps"] = [str(p) for p in paths]
    report["environment"] = environment()
    _write_report(report, out_dir, json_path, paths)
    return report


def _load_student_and_teacher(model_path: str, teacher_spec: str, device=None):
    """The student at ``model_path``, its teacher and the student's tokenizer; a model that is not a
    student, a teacher of another shape, or a student without materialisable weights is an error."""
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: transformers

    student, tokenizer = load_model_and_tokenizer(model_path, device)
    if getattr(student.config, "model_type", None) != "attn2ssm":
        raise ConfigError(
            f"{model_path} is not a student: --attention compares a student with its teacher",
            "point at a student directory (from 'attn2ssm convert' or a run's student/)",
        )
    teacher, _ = load_model_and_tokenizer(teacher_spec, device)
    if not _matches(student, teacher):
        raise ConfigError(
            f"teacher {teacher_spec} ({teacher.config.num_hidden_layers} layers, hidden {teacher.config.hidden_size}) does not "
            f"match the student ({len(student.config.layer_plan)} layers, hidden {_student_hidden(student)})",
            "pass the student's own teacher with --against",
        )
    if not _mixer_layers(student):
        raise ConfigError(
            f"{model_path} has no mixer with materialisable weights", "use a linear-attention student"
        )
    return student, teacher, tokenizer


def _heldout_blocks(tokenizer, corpus: str, window: int, max_tokens: int | None, blocks: int) -> torch.Tensor:
    """(n, window): up to ``blocks`` blocks spread evenly over the corpus' held-out stream."""
    ids = prepare_corpus(corpus, tokenizer, max_heldout_tokens=max_tokens, max_train_tokens=0).heldout_ids
    n = min(blocks, ids.numel() // window)
    if n < 1:
        raise DataError(
            f"corpus {corpus!r} has {ids.numel()} held-out tokens, less than one --window {window} block",
            "use a smaller --window, a larger --max-tokens, or --text",
        )
    step = ids.numel() // n  # blocks spread over the held-out stream
    return torch.stack([ids[j * step : j * step + window] for j in range(n)])


def _write_report(report: dict, out_dir: Path, json_path, heatmaps: list[Path]) -> None:
    """``attention_fidelity.json`` in ``out_dir`` (and a copy at ``json_path``), and a line saying so."""
    body = json.dumps(_json_safe(report), indent=1) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_fidelity.json").write_text(body)
    if json_path:
        Path(json_path).write_text(body)
    shown = ", ".join(p.name for p in heatmaps)
    print(f"wrote {out_dir / 'attention_fidelity.json'}" + (f" and heat-maps {shown}" if heatmaps else ""))


def _json_safe(obj):
    """NaN (an undefined Spearman mean) becomes null: json would write NaN, which is not JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
