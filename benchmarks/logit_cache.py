"""The teacher-logit cache, measured: (a) the top-k + tail KL's error against the full KL, (b) a KD
step with a cache hit against one that runs the teacher, (c) disk bytes per token.

(a) On held-out SOTU blocks of the built-in teacher, for each student and k: the full KL(teacher ‖
student) per token, the top-k + tail KL (``forward_kl`` on ``topk_targets``), their relative
difference, the cosine between the two gradients in the student's logits (over every token and
vocabulary entry, and per token), and the teacher's tail mass. Students: a fresh conversion (the
start of a KD stage, where the KL is largest) and trained scoreboard students if present.
(b) ``attn2ssm bench train``'s measurement (the trainer's own step) of ``kd_lora`` against
``kd_lora_cached`` (its cache filled first, so every timed step is a hit), fp32 and bf16 autocast,
interleaved rep by rep (alternating which goes first); the machine is shared, so the result is
the ratio within each rep, marked contended. (c) The size of a stored block's entry per token.

    python benchmarks/logit_cache.py [--blocks 8] [--reps 2] [--parts error,speed] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_info, write_json  # noqa: E402  (benchmarks/ on sys.path first)

ROOT = Path(__file__).resolve().parents[1]
KS = (8, 16, 32, 64, 128, 256)
TRAINED = {
    "linear_hybrid25 (2^16 tokens)": ROOT / "runs/quality/linear_hybrid25-65536/student",
    "hybrid25 Mamba-2 (2^16 tokens)": ROOT / "runs/quality/hybrid25-65536/student",
}


def _students(teacher):
    from attn2ssm.student.convert import convert
    from attn2ssm.student.modeling import Attn2SSMForCausalLM
    from attn2ssm.student.plans import make_plan

    opts = {"feature_map": "hedgehog", "feature_map_options": {"activation": "softmax"}, "window": 64}
    plan = make_plan(teacher.config.num_hidden_layers, "linear_attention", attention_ratio=0.0)
    yield (
        "untrained LoLCATs conversion (all layers)",
        convert(teacher, plan, {"linear_attention": opts}).eval(),
    )
    for name, path in TRAINED.items():
        if (path / "model.safetensors").exists():
            yield name, Attn2SSMForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _grad(student_logits, targets):
    from attn2ssm.distill.losses import forward_kl

    x = student_logits.clone().requires_grad_(True)
    kl = forward_kl(x, targets)
    kl.backward()
    return kl.item(), x.grad.reshape(-1, x.shape[-1])


def measure_error(teacher, blocks: torch.Tensor) -> dict:
    from attn2ssm.distill.logit_cache import LogitCache
    from attn2ssm.distill.losses import topk_targets

    with torch.no_grad():
        t_logits = [teacher(input_ids=b[None], use_cache=False).logits[0] for b in blocks]
    out = {"tokens": blocks.numel(), "students": []}
    for name, student in _students(teacher):
        print(f"(a) {name}", file=sys.stderr)
        acc = {k: {"dot": 0.0, "nf": 0.0, "ns": 0.0, "kl": 0.0, "tok_cos": 0.0, "tail": 0.0} for k in KS}
        full_kl = 0.0
        for b, t in zip(blocks, t_logits):
            with torch.no_grad():
                s = student(input_ids=b[None], use_cache=False).logits[0]
            kl_f, g_f = _grad(s, t)
            full_kl += kl_f / len(blocks)
            for k in KS:
                targets = topk_targets(t, k)
                kl_k, g_k = _grad(s, targets)
                a = acc[k]
                a["kl"] += kl_k / len(blocks)
                a["dot"] += (g_f * g_k).sum().item()
                a["nf"] += g_f.square().sum().item()
                a["ns"] += g_k.square().sum().item()
                a["tok_cos"] += torch.nn.functional.cosine_similarity(g_f, g_k, dim=-1).mean().item() / len(
                    blocks
                )
                a["tail"] += targets.log_tail.exp().mean().item() / len(blocks)
        rows = [
            {
                "k": k,
                "sparse_kl": a["kl"],
                "relative_error": (full_kl - a["kl"]) / full_kl,
                "grad_cosine": a["dot"] / (a["nf"] * a["ns"]) ** 0.5,
                "grad_cosine_per_token": a["tok_cos"],
                "teacher_tail_mass": a["tail"],
            }
            for k, a in acc.items()
        ]
        out["students"].append({"student": name, "full_kl": full_kl, "rows": rows})
        print(
            f"    full KL {full_kl:.4f}; "
            + ", ".join(f"k={r['k']}: {r['relative_error']:.2%} cos {r['grad_cosine']:.4f}" for r in rows),
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as tmp:  # (c) bytes per token of a stored entry at each k
        sizes = {}
        for k in KS:
            cache = LogitCache(teacher, k, "size-probe", tmp)
            cache.targets(teacher, blocks[:1])
            files = list(cache.dir.rglob("*.safetensors"))
            sizes[k] = files[0].stat().st_size / blocks.shape[1]
    out["bytes_per_token"] = sizes
    return out


def measure_speed(
    teacher, tokenizer, reps: int, step_tokens: int, precisions=("no", "bf16"), keep_rows=(), corpus="sotu"
) -> dict:
    from attn2ssm.bench.train import TrainBenchSettings, measure_point

    settings = TrainBenchSettings(
        lengths=(1024,),
        step_tokens=step_tokens,
        steps=2,
        profile=False,
        references=("teacher_forward",),
        corpus=corpus,
    )
    rows = []
    for rep in range(reps):
        for precision in precisions:
            order = ("kd_lora", "kd_lora_cached") if rep % 2 == 0 else ("kd_lora_cached", "kd_lora")
            pair = {}
            for case in order:
                print(f"(b) rep {rep} {precision} {case}", file=sys.stderr)
                pair[case] = measure_point(
                    settings, case, 1024, precision, "auto", teacher, tokenizer, lambda: None
                )
                r = pair[case]
                print(
                    f"    {r['tokens_per_s']:.0f} tok/s (teacher forward {r['teacher_forward']:.0f})",
                    file=sys.stderr,
                )
            rows.append(
                {
                    "rep": rep,
                    "precision": precision,
                    "threads": torch.get_num_threads(),
                    "order": list(order),
                    "uncached": pair["kd_lora"],
                    "cached": pair["kd_lora_cached"],
                    "speedup": pair["kd_lora_cached"]["tokens_per_s"] / pair["kd_lora"]["tokens_per_s"],
                }
            )
    # an earlier invocation's other precisions
    rows = [r for r in keep_rows if r["precision"] not in precisions] + rows
    summary = {}
    for precision in dict.fromkeys(r["precision"] for r in rows):
        ratios = [r["speedup"] for r in rows if r["precision"] == precision]
        summary[precision] = {
            "speedup_median": statistics.median(ratios),
            "speedups": ratios,
            "uncached_tok_s": statistics.median(
                r["uncached"]["tokens_per_s"] for r in rows if r["precision"] == precision
            ),
            "cached_tok_s": statistics.median(
                r["cached"]["tokens_per_s"] for r in rows if r["precision"] == precision
            ),
            "fill_tok_s": statistics.median(
                r["cached"]["logit_cache"]["fill_tokens_per_s"] for r in rows if r["precision"] == precision
            ),
            "teacher_forward_tok_s": statistics.median(
                r["uncached"]["teacher_forward"] for r in rows if r["precision"] == precision
            ),
        }
    return {
        "contended": True,
        "settings": {"length": 1024, "step_tokens": step_tokens, "timed_steps": 2, "reps": reps},
        "summary": summary,
        "rows": rows,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for s in result["error"]["students"]:
        ks = [r["k"] for r in s["rows"]]
        axes[0].plot(
            ks,
            [100 * r["relative_error"] for r in s["rows"]],
            marker="o",
            label=f"{s['student']} (KL {s['full_kl']:.2f})",
        )
        axes[1].plot(ks, [r["grad_cosine"] for r in s["rows"]], marker="o", label=s["student"])
    for ax, title in zip(axes[:2], ("(full KL − top-k KL) / full KL, %", "gradient cosine (top-k vs full)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    speed = result.get("speed")
    if not speed:
        axes[2].text(0.5, 0.5, "speed (b) not measured", ha="center", va="center")
        axes[2].set_axis_off()
    else:
        # a pair run under unequal loads is marked invalid
        precisions = [p for p, v in speed["summary"].items() if v.get("valid", True)]
        x = range(len(precisions))
        axes[2].bar(
            [i - 0.2 for i in x],
            [speed["summary"][p]["uncached_tok_s"] for p in precisions],
            width=0.4,
            label="KD step, teacher forward",
        )
        axes[2].bar(
            [i + 0.2 for i in x],
            [speed["summary"][p]["cached_tok_s"] for p in precisions],
            width=0.4,
            label="KD step, cache hit (k=64)",
        )
        for i, p in zip(x, precisions):
            axes[2].text(
                i + 0.2,
                speed["summary"][p]["cached_tok_s"],
                f"{speed['summary'][p]['speedup_median']:.2f}x",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        axes[2].set_xticks(list(x))
        axes[2].set_xticklabels(["fp32" if p == "no" else p for p in precisions])
        axes[2].set_ylabel("tokens / s (median of reps)")
        axes[2].set_title("LoRA KD step, 1024-token blocks (shared CPU: contended)", fontsize=9)
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8, help="held-out 1024-token SOTU blocks for (a)")
    ap.add_argument("--reps", type=int, default=2, help="interleaved reps for (b)")
    ap.add_argument(
        "--precisions",
        default="no,bf16",
        help="(b): mixed precision settings; rows of others are kept from --out",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (1 avoids OpenMP stalls on a CPU shared with other jobs)",
    )
    ap.add_argument(
        "--step-tokens", type=int, default=2048, help="(b): tokens per optimizer step (1024-token blocks)"
    )
    ap.add_argument(
        "--parts",
        default="error,speed",
        help="error (a, c) and/or speed (b); a part not run is kept from an existing --out",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/logit_cache.json"))
    args = ap.parse_args(argv)
    from attn2ssm.data.mixture import load_training_data
    from attn2ssm.distill.recipe import DataConfig
    from attn2ssm.teachers import load_teacher

    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tokenizer, source = load_teacher("smollm2-135m")
    teacher.eval().requires_grad_(False)
    data = load_training_data(
        DataConfig(corpus="sotu").source_list(),
        tokenizer,
        1024,
        seed=0,
        max_heldout_tokens=1024 * args.blocks,
        progress=False,
    )
    blocks = data.eval_blocks[: args.blocks]
    result = {
        **run_info("benchmarks/logit_cache.py", sys.argv[1:] if argv is None else argv),
        "threads": torch.get_num_threads(),
        "teacher": source.describe(),
        "heldout": f"{len(blocks)} SOTU held-out blocks of 1024 tokens",
    }
    out = Path(args.out)
    parts = args.parts.split(",")
    if out.exists():  # keep what this invocation does not remeasure, with the command that measured it
        old = json.loads(out.read_text())
        for part in ("error", "speed"):
            if part in old and (part not in parts or part == "speed"):
                result[part] = {**old[part], "command": old[part].get("command", old.get("command"))}
    if "error" in parts:
        result["error"] = {**measure_error(teacher, blocks), "command": result["command"]}
        write_json(out, result)
    if "speed" in parts:
        result["speed"] = {
            **measure_speed(
                teacher,
                tokenizer,
                args.reps,
                args.step_tokens,
                tuple(args.precisions.split(",")),
                result.get("speed", {}).get("rows", []),
            ),
            "command": result["command"],
        }
        write_json(out, result)
    if "error" in result:
        plot(result, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
