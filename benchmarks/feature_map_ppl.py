"""Held-out perplexity of linear-attention students of the built-in teacher, equal token budgets.

Hedgehog's claim at our scale: Hedgehog (attention transfer, then finetune) beats T2R and 1+ELU
(finetune only, the same total tokens) and lands far below the untrained conversions. Each
student runs through the real CLI (`attn2ssm distill`) into its own run directory; the
untrained conversions are scored with the same perplexity settings.

    python benchmarks/feature_map_ppl.py [--tokens 32768] [--out benchmarks/results]

Writes feature_map_ppl.json (perplexities, budgets, commands, machine) and feature_map_ppl.png
(bars + held-out loss vs tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import run_info, write_json  # noqa: E402

STUDENTS = {
    # name: (recipe, extra overrides); transfer gets half the budget, finetune the rest
    "hedgehog": ("hedgehog", []),
    "t2r": ("t2r", []),
    "1+elu": ("t2r", ["student.mixer_options.feature_map=elu", "stages.0.trainable=[lora]"]),
}


def budget_overrides(name: str, tokens: int) -> list[str]:
    if name == "hedgehog":
        return [f"stages.0.tokens={tokens // 2}", f"stages.1.tokens={tokens - tokens // 2}"]
    return [f"stages.0.tokens={tokens}"]


def untrained_ppl(feature_map: str, eval_tokens: int, window: int) -> float:
    from attn2ssm.data import prepare_corpus
    from attn2ssm.eval.perplexity import perplexity
    from attn2ssm.student.convert import convert
    from attn2ssm.teachers import load_teacher

    teacher, tokenizer, _ = load_teacher("smollm2-135m")
    corpus = prepare_corpus("sotu", tokenizer, max_heldout_tokens=20000)
    student = convert(
        teacher,
        ["linear_attention"] * teacher.config.num_hidden_layers,
        {"linear_attention": {"feature_map": feature_map}},
    )
    return perplexity(student, corpus.heldout_ids, window=window, max_tokens=eval_tokens)["ppl"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="total training tokens per student")
    p.add_argument("--students", default=",".join(STUDENTS))
    p.add_argument("--runs", default="runs/feature_map_ppl", help="where the run directories go")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    runs, out = Path(args.runs), Path(args.out)
    results: dict = {"students": {}, "untrained": {}}
    for name in args.students.split(","):
        recipe, extra = STUDENTS[name]
        sets = budget_overrides(name, args.tokens) + extra
        cmd = [
            sys.executable,
            "-m",
            "attn2ssm",
            "distill",
            recipe,
            "--out",
            str(runs / name),
            "--resume",
            "--no-progress",
        ]
        for s in sets:
            cmd += ["--set", s]
        print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        res = json.loads((runs / name / "results.json").read_text())
        metrics = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        results["students"][name] = {
            "recipe": recipe,
            "overrides": sets,
            "command": " ".join(["attn2ssm", *cmd[3:]]),
            "student_ppl": res["student_ppl"],
            "teacher_ppl": res["teacher_ppl"],
            "train_tokens": res["train_tokens"],
            "wall_s": time.perf_counter() - t0,
            "curve": [(m["total_tokens"], m["eval_loss"]) for m in metrics if "eval_loss" in m],
        }
        results["heldout"] = res["heldout"]
    for fm in ("hedgehog", "t2r", "elu"):
        results["untrained"][fm] = untrained_ppl(
            fm, results["heldout"]["tokens"] + 1, results["heldout"]["window"]
        )
    results["teacher_ppl"] = next(iter(results["students"].values()))["teacher_ppl"]
    results["tokens_per_student"] = args.tokens
    results.update(run_info("benchmarks/feature_map_ppl.py", argv if argv is not None else sys.argv[1:]))
    write_json(out / "feature_map_ppl.json", results)
    plot(results, out / "feature_map_ppl.png")
    print(
        json.dumps(
            {k: v["student_ppl"] for k, v in results["students"].items()}
            | {"untrained": results["untrained"], "teacher": results["teacher_ppl"]},
            indent=1,
        )
    )
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results["students"])
    trained = [results["students"][n]["student_ppl"] for n in names]
    untrained = [results["untrained"].get({"1+elu": "elu"}.get(n, n)) for n in names]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], untrained, 0.4, label="untrained conversion")
    a.bar([i + 0.2 for i in x], trained, 0.4, label=f"after {results['tokens_per_student']:,} tokens")
    a.axhline(results["teacher_ppl"], color="k", ls="--", label=f"teacher {results['teacher_ppl']:.1f}")
    a.set_yscale("log")
    a.set_xticks(list(x), names)
    a.set_ylabel("held-out perplexity (sotu ≥ 2000)")
    a.legend()
    for n in names:
        curve = results["students"][n]["curve"]
        if curve:
            b.plot([c[0] for c in curve], [c[1] for c in curve], "o-", label=n)
    b.set_xlabel("training tokens")
    b.set_ylabel("held-out CE during training")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
