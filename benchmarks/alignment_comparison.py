"""Layer-alignment recipes compared at equal token budgets on the built-in teacher (issue 5).

Each variant is a built-in recipe run from the command line (``attn2ssm distill RECIPE --set ...``,
one process per variant, exactly as a user runs it), with every stage's budget multiplied by ``--scale`` (the same factor for all, so budgets stay equal within
each comparison). Scored on the same held-out tokens; the validation perplexity logged during
training (``eval_every``) gives the perplexity-vs-tokens curves. Comparisons (papers' orderings):

- HedgeMamba ("Attention to Mamba"): HedgeMamba < Hedgehog (same two stages, mixer swapped);
- MOHAWK (Tab. 3): MOHAWK 1+2+3 < 2+3 < 3 (discrete Mamba-2; stage budgets moved to KD when dropped);
- CAB: CAB (bridge alignment + KD) < plain KD, beside weight reuse (Mamba in the Llama's attention init).

    python benchmarks/alignment_comparison.py [--scale 0.5] [--only NAME,NAME] [--out-json PATH]
    python benchmarks/alignment_comparison.py --merge a.json b.json   # parts run in parallel

Writes alignment_comparison.json (+ .png: validation perplexity vs training tokens per family,
and final held-out perplexity bars).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import run_info, write_json  # noqa: E402

# name → (family, recipe, extra overrides)
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "Hedgehog": ("000 HedgeMamba vs Hedgehog", "hedgemamba", ["student.mixer=linear_attention"]),
    "HedgeMamba": ("000 HedgeMamba vs Hedgehog", "hedgemamba", []),
    "MOHAWK 1+2+3": ("001 MOHAWK stages", "mohawk", []),
    "MOHAWK 2+3": ("001 MOHAWK stages", "mohawk_2_3", []),
    "MOHAWK 3": ("001 MOHAWK stages", "mohawk_3", []),
    "CAB": ("003 CAB vs KD", "cab", []),
    "plain KD": ("003 CAB vs KD", "cab_kd", []),
    "weight reuse + KD": ("003 CAB vs KD", "cab_reuse", []),
}
ORDERINGS = [
    ("HedgeMamba < Hedgehog (HedgeMamba paper)", ["HedgeMamba", "Hedgehog"]),
    ("MOHAWK 1+2+3 < 2+3 < 3 (MOHAWK Tab. 3)", ["MOHAWK 1+2+3", "MOHAWK 2+3", "MOHAWK 3"]),
    ("CAB < plain KD (CAB paper)", ["CAB", "plain KD"]),
]


def scaled_overrides(recipe, scale: float, eval_points: int) -> list[str]:
    """Multiply every stage's tokens by ``scale`` (whole batches) and log validation perplexity
    about ``eval_points`` times per stage."""
    block = recipe.data.block_len
    out = []
    for i, st in enumerate(recipe.stages):
        per_step = st.batch_size * block * getattr(st, "grad_accum", 1)
        steps = max(1, round(st.tokens * scale / per_step))
        out += [
            f"stages.{i}.tokens={steps * per_step}",
            f"stages.{i}.eval_every={max(1, steps // eval_points)}",
            f"stages.{i}.save_every={10**6}",
            f"stages.{i}.keep_checkpoints=1",
        ]
    return out


def curve(run: Path) -> list[tuple[int, float]]:
    points = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval_ppl" in rec:
            points.append((rec["total_tokens"], rec["eval_ppl"]))
    return points


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({v["family"] for v in data["variants"].values()})
    fig, axes = plt.subplots(1, len(families) + 1, figsize=(4.8 * (len(families) + 1), 4.2), squeeze=False)
    axes = axes[0]
    teacher = data["teacher_ppl"]
    for ax, fam in zip(axes, families):
        for i, (name, v) in enumerate((n, v) for n, v in data["variants"].items() if v["family"] == fam):
            if v["curve"]:
                xs, ys = zip(*v["curve"])
                ax.plot(
                    xs, ys, marker="o", markersize=3, color=f"C{i}", label=f"{name} ({v['student_ppl']:.1f})"
                )
        ax.axhline(teacher, color="gray", linestyle="--", linewidth=1, label=f"teacher {teacher:.1f}")
        ax.set_yscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("validation perplexity (log)")
        ax.set_title(fam, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    names = list(data["variants"])
    vals = [data["variants"][n]["student_ppl"] for n in names]
    ax.bar(range(len(names)), vals, color=[f"C{i % 10}" for i in range(len(names))])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(teacher, color="gray", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
    ax.set_title("final held-out perplexity", fontsize=9)
    fig.suptitle(
        f"layer-alignment recipes on {data['settings']['teacher']}, budgets x{data['settings']['scale']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(data: dict) -> dict:
    v = data["variants"]
    holds = {}
    for label, names in ORDERINGS:
        vals = [v[n]["student_ppl"] if n in v else None for n in names]
        holds[label] = {
            "values": vals,
            "holds": None if None in vals else all(a < b for a, b in zip(vals, vals[1:])),
        }
    data["orderings"] = holds
    return data


def run_variants(args) -> dict:
    import torch

    from attn2ssm.data import prepare_corpus
    from attn2ssm.distill.recipe import load_recipe
    from attn2ssm.eval.attention import attention_fidelity
    from attn2ssm.eval.perplexity import perplexity
    from attn2ssm.student.modeling import Attn2SSMForCausalLM
    from attn2ssm.teachers import load_teacher

    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer, _ = load_teacher(args.teacher)
    corpus = prepare_corpus(args.corpus, tokenizer, max_heldout_tokens=args.eval_tokens)
    heldout = corpus.heldout_ids[: args.eval_tokens]
    teacher_ppl = perplexity(teacher, heldout, window=256)["ppl"]
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    results = {}
    for name in names:
        family, recipe_name, extra = VARIANTS[name]
        common = [
            f"teacher={args.teacher}",
            f"data.corpus={args.corpus}",
            f"data.max_heldout_tokens={args.eval_tokens}",
            f"eval.max_tokens={args.eval_tokens}",
            *extra,
        ]
        overrides = common + scaled_overrides(load_recipe(recipe_name, common), args.scale, args.eval_points)
        recipe = load_recipe(recipe_name, overrides)
        run = Path(args.runs) / name.replace(" ", "_").replace("+", "")
        shutil.rmtree(run, ignore_errors=True)
        command = [
            sys.executable,
            "-m",
            "attn2ssm",
            "distill",
            recipe_name,
            "--out",
            str(run),
            "--no-progress",
        ]
        for o in overrides:
            command += ["--set", o]
        start = time.time()
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        # loadable, as saved
        student = Attn2SSMForCausalLM.from_pretrained(run / "student", dtype=torch.float32).eval()
        ppl = perplexity(student, heldout, window=256)["ppl"]
        fid = None
        if (
            any(callable(getattr(m, "attention_weights", None)) for m in student.mixers().values())
            and len(student.config.layer_plan) == teacher.config.num_hidden_layers
        ):
            fid = attention_fidelity(student, teacher, heldout[: 2 * 256].view(2, 256))["mean"]
        results[name] = {
            "family": family,
            "recipe": recipe_name,
            "command": shlex.join(["attn2ssm", *command[3:]]),
            "student_ppl": ppl,
            "ratio_to_teacher": ppl / teacher_ppl,
            "train_tokens": sum(s.tokens for s in recipe.stages),
            "stages": [{"name": s.name, "kind": s.kind, "tokens": s.tokens} for s in recipe.stages],
            "curve": curve(run),
            "attention_fidelity": fid,
            "layers": len(student.config.layer_plan),
            "seconds": time.time() - start,
        }
        print(
            f"{name}: ppl {ppl:.2f} ({results[name]['train_tokens']} tokens, {time.time() - start:.0f}s)",
            flush=True,
        )
        del student
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return {
        "benchmark": "alignment_comparison",
        "description": __doc__.split("\n\n")[0],
        "settings": {
            "teacher": args.teacher,
            "corpus": args.corpus,
            "scale": args.scale,
            "eval_tokens": args.eval_tokens,
            "window": 256,
        },
        "teacher_ppl": teacher_ppl,
        "variants": results,
        **run_info("benchmarks/alignment_comparison.py", sys.argv[1:]),
    }


def merge(paths: list[str]) -> dict:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    data = dict(parts[0])
    data["variants"] = {k: v for part in parts for k, v in part["variants"].items()}
    data["commands"] = [p["command"] for p in parts]
    data["teacher_ppl"] = parts[0]["teacher_ppl"]
    assert all(math.isclose(p["teacher_ppl"], data["teacher_ppl"], rel_tol=1e-6) for p in parts), (
        "parts scored different held-out tokens"
    )
    order = {n: i for i, n in enumerate(VARIANTS)}
    data["variants"] = dict(sorted(data["variants"].items(), key=lambda kv: order.get(kv[0], 99)))
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiply every stage's token budget")
    p.add_argument("--only", help="comma-separated variant names (default: all)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--eval-points", type=int, default=3, help="validation evaluations per stage")
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--corpus", default="sotu")
    p.add_argument("--runs", default="runs/alignment_comparison")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument(
        "--out-json", default=str(Path(__file__).resolve().parent / "results" / "alignment_comparison.json")
    )
    p.add_argument("--merge", nargs="+", help="merge part JSONs (from --only runs) into --out-json")
    args = p.parse_args(argv)
    data = merge(args.merge) if args.merge else run_variants(args)
    data = summarize(data)
    out = Path(args.out_json)
    write_json(out, data)
    plot(data, out.with_suffix(".png"))
    for label, h in data["orderings"].items():
        state = "n/a" if h["holds"] is None else ("holds" if h["holds"] else "DOES NOT hold")
        print(f"  {state}: {label} {h['values']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
