"""``attn2ssm convert | distill | eval | generate | bench (generate | quality | train) | export | recipes | upgrade``.

Every user-facing failure is an ``Attn2SSMError``: printed as one line, no traceback
(``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from attn2ssm.errors import Attn2SSMError, CheckpointError, ConfigError, DataError, Interrupted
from attn2ssm.paths import check_writable, remove_stale_staging
from attn2ssm.precision import PRECISIONS

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --------------------------------------------------------------------------------------------- convert
def _held_model(out: Path) -> str:
    """What in ``out`` a convert would overwrite: a saved model or a distillation run ("" if neither)."""
    if (out / "config.json").is_file():
        return "a saved model (config.json)"
    if (out / "checkpoints").exists() or (out / "student").exists():
        return "a distillation run (checkpoints/ or student/)"
    return ""


def _write_student(student, tokenizer, out: Path, replace: bool) -> None:
    """Save into a staging directory beside ``out``, then move it into place: a failed write
    leaves what ``out`` held untouched (and no staging), and one for want of space or permission
    ends with one line naming ``out``. ``replace`` (--force over a model): the staged directory
    replaces ``out`` whole; otherwise ``out`` is new or empty, or its other files stay beside the student's."""
    from attn2ssm.paths import replace_dir, staging_beside, writing

    with writing(out, "the student", "run the command again (what --out held is unchanged)"), staging_beside(out, "convert") as staging:
        student.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if replace or not out.exists() or not any(out.iterdir()):
            replace_dir(staging, out)
        else:
            for path in staging.iterdir():
                os.replace(path, out / path.name)


def cmd_convert(args) -> int:
    from attn2ssm.config import parse_value
    from attn2ssm.teachers import load_teacher, resolve_teacher

    # Cheap checks first, so a typo fails in a fraction of a second, not after loading the teacher.
    try:
        keep = [int(i) for i in args.keep.split(",") if i.strip()] if args.keep not in (None, "auto") else None
    except ValueError:
        raise ConfigError(f"--keep {args.keep!r} is not a comma-separated list of layer indices", "write e.g. --keep 0,6,12") from None
    options = {}
    for item in args.option or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {item!r} is not key=value", "write e.g. --option feature_map=elu")
        options[key.strip()] = parse_value(value)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file", "give a directory for the student")
    held = _held_model(out)
    if held and not args.force:  # as distill never overwrites a run: a trained student is not replaced silently
        raise ConfigError(f"--out {out} already holds {held}", "pass --force to replace it, or choose another --out")
    resolve_teacher(args.teacher)  # a missing path fails here, before torch/transformers load
    check_writable(out, beside=True)  # and so does an --out that cannot be written
    remove_stale_staging(out.parent)  # what a killed convert / export left beside it

    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    teacher, tokenizer, source = load_teacher(args.teacher, check_supported=True)
    if args.keep == "auto":
        from attn2ssm.data import block_indices, pack_blocks, prepare_corpus
        from attn2ssm.distill.layer_selection import auto_plan

        blocks = pack_blocks(prepare_corpus("sotu" if args.calibration is None else args.calibration, tokenizer, max_train_tokens=8 * 256 + 1, max_heldout_tokens=256).train_ids, 256)
        plan, scores = auto_plan(teacher, blocks[block_indices(len(blocks), 0, 0, min(8, len(blocks)))], args.mixer, options, args.attention_ratio, batch_size=2)
        print("layer damage (mean KL when converted alone): " + ", ".join(f"{i}:{s:.6g}" for i, s in enumerate(scores)))
    else:
        plan = make_plan(teacher.config.num_hidden_layers, args.mixer, attention_ratio=args.attention_ratio, keep_attention=keep, align="last")
    student = convert(teacher, plan, {args.mixer: options}, teacher_info={"source": source.describe()}, init=args.init)
    _write_student(student, tokenizer, out, replace=bool(held))
    kept = [i for i, k in enumerate(plan) if k == "attention"]
    print(f"wrote {out}: {len(plan) - len(kept)}/{len(plan)} layers → {args.mixer}, attention kept at {kept or 'none'}")
    return 0


# --------------------------------------------------------------------------------------------- distill
def cmd_distill(args) -> int:
    from attn2ssm.distill.recipe import load_recipe
    from attn2ssm.teachers import resolve_teacher

    recipe = load_recipe(args.recipe, args.set)  # recipe errors fail before the trainer's heavy imports
    if args.teacher:
        recipe.teacher = args.teacher
    # A resume continues the recipe saved in the run directory (when there is one): --set and --teacher
    # are checked against it there, and may change only what distill.recipe.RESUMABLE lists.
    overrides = [*(args.set or []), *([f"teacher={args.teacher}"] if args.teacher else [])] if args.resume else None
    if not args.resume and recipe.images is None:  # (a resumed run reads its teacher from the run directory)
        resolve_teacher(recipe.teacher)

    from attn2ssm.distill.trainer import distill

    out = Path(args.out or f"runs/{recipe.name}")
    results = distill(recipe, out, resume=args.resume, overrides=overrides, progress=not args.no_progress)
    if results and "student_top1" in results:  # an image recipe
        print(f"\n{'model':<10} {'top-1':>8}   ({results['test_images']} test images)")
        print(f"{'teacher':<10} {results['teacher_top1']:>8.4f}\n{'student':<10} {results['student_top1']:>8.4f}")
        print(f"\nstudent:    {out / 'student'} (AutoModelForImageClassification)\nreport:     {out / 'report.md'}\nmetrics:    {out / 'metrics.jsonl'}")
    elif results:
        print()
        print(f"{'model':<10} {'held-out ppl':>14}")
        print(f"{'teacher':<10} {results['teacher_ppl']:>14.2f}")
        print(f"{'student':<10} {results['student_ppl']:>14.2f}")
        print(f"\nstudent:    {out / 'student'}")
        print(f"report:     {out / 'report.md'} (loss curve {out / 'loss.png'})")
        print(f"metrics:    {out / 'metrics.jsonl'}")
    return 0


# --------------------------------------------------------------------------------------------- eval
def cmd_eval(args) -> int:
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: torch + transformers

    from attn2ssm.data import prepare_corpus
    from attn2ssm.eval.perplexity import perplexity

    modes = [flag for flag, on in (("--tasks", args.tasks), ("--attention", args.attention), ("--report", args.report)) if on]
    if len(modes) > 1 and not (set(modes) == {"--tasks", "--report"}):
        raise ConfigError(f"{' and '.join(modes)} are different evaluations", "run them one at a time (--report takes --tasks to include lm-eval tasks)")
    if args.report:
        return cmd_eval_report(args)
    if args.tasks:
        from attn2ssm.eval.harness import cmd_eval_tasks

        return cmd_eval_tasks(args)

    if args.window < 2:
        raise ConfigError(f"--window {args.window} is too short", "use a window of at least 2 tokens, e.g. --window 256")
    if args.stride is not None and not 0 < args.stride <= args.window:
        raise ConfigError(f"--stride {args.stride} is outside 1..{args.window} (the window)", "use a stride between 1 and --window")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ConfigError(f"--max-tokens {args.max_tokens} leaves nothing to score", "use at least 2, e.g. --max-tokens 20000")
    if args.attention:  # fidelity of a student's mixing weights to its teacher's softmax, not perplexity
        from attn2ssm.eval.attention import run_attention_eval

        run_attention_eval(args.model, against=args.against, corpus=args.corpus, window=args.window, max_tokens=args.max_tokens,
                           blocks=args.blocks, text=args.text, out_dir=args.out_dir, json_path=args.json)  # fmt: skip
        return 0
    from attn2ssm.decode.quantize import apply_weight_format, check_weight_format

    check_weight_format(args.dtype, args.quantize)
    model, tokenizer = load_model_and_tokenizer(args.model)
    apply_weight_format(model, args.dtype, args.quantize)  # the forms generate --dtype / --quantize decode in
    teacher = load_model_and_tokenizer(args.against)[0] if args.against else None  # before any scoring: a bad --against fails now
    from attn2ssm.student.loading import position_limit

    for name, m in ((args.model, model), (args.against, teacher)):
        limit = position_limit(m.config) if m is not None else None
        if limit is not None and args.window > limit:
            raise ConfigError(f"--window {args.window} is longer than {name} reads positions for (at most {limit})", f"use --window {limit} or less")
    corpus = prepare_corpus(args.corpus, tokenizer, max_heldout_tokens=args.max_tokens, max_train_tokens=0)
    if corpus.heldout_ids.numel() < 2:
        raise DataError(
            f"corpus {args.corpus!r} has no held-out text to score ({corpus.heldout_ids.numel()} tokens)",
            "use a corpus with several documents or paragraphs (the last ~5% of a single document is held out)",
        )
    rows = [("model", args.model, perplexity(model, corpus.heldout_ids, window=args.window, stride=args.stride, max_tokens=args.max_tokens, progress=True))]
    if teacher is not None:
        rows.append(("teacher", args.against, perplexity(teacher, corpus.heldout_ids, window=args.window, stride=args.stride, max_tokens=args.max_tokens, progress=True)))
    print(f"held-out perplexity on {args.corpus} ({rows[0][2]['tokens']} tokens, window {args.window})")
    for role, name, r in rows:
        print(f"  {role:<8} {r['ppl']:>10.2f}   {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({role: {"path": name, **r} for role, name, r in rows}, indent=1))
    return 0


def cmd_eval_report(args) -> int:
    from attn2ssm.eval.compare import ReportSettings, compare_report

    def floats(flag, text):
        try:
            return tuple(float(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"{flag} {text!r} is not a comma-separated list of numbers", f"write e.g. {flag} 0,0.5,1") from None

    lengths = _int_list("--needle-lengths", args.needle_lengths) if args.needle_lengths else ()
    depths = floats("--needle-depths", args.needle_depths)
    if any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"--needle-depths {args.needle_depths!r} has depths outside 0..1", "write fractions, e.g. --needle-depths 0,0.5,1")
    tasks = ()
    if args.tasks:
        from attn2ssm.eval.harness import resolve_tasks

        tasks = tuple(resolve_tasks(args.tasks))
    settings = ReportSettings(
        corpora=tuple(c.strip() for c in args.corpus.split(",") if c.strip()), window=args.window, max_tokens=args.max_tokens,
        tasks=tasks, limit=args.limit, needle_lengths=lengths, needle_depths=depths, needle_trials=args.needle_trials,
        agreement_prompts=args.agreement_prompts, fidelity_blocks=args.blocks,
    )  # fmt: skip
    out = Path(args.out_dir) if args.out_dir else Path(args.model) / "eval" / "report"
    report = compare_report(args.model, args.against, out, settings)
    from attn2ssm.eval.compare import format_markdown

    print(format_markdown(report))
    print(f"wrote {out / 'report.md'}, report.json and report.png")
    return 0


# --------------------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: torch + transformers

    from attn2ssm.generation.sampling import check_sampling

    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} generates nothing", "ask for at least 1 token, e.g. --max-new-tokens 64")
    check_sampling(args.temperature, args.top_k, args.top_p, cli=True)  # 0 = greedy; a negative one is not
    num_draft_tokens = _draft_tokens("--num-draft-tokens", args.num_draft_tokens)
    import torch
    from transformers import TextStreamer

    from attn2ssm.decode.layout import cpu_decode_layout
    from attn2ssm.decode.quantize import apply_weight_format, check_weight_format

    check_weight_format(args.dtype, args.quantize)  # a bad --dtype / --quantize: one line, before anything loads
    model, tokenizer = load_model_and_tokenizer(args.model)
    apply_weight_format(model, args.dtype, args.quantize)  # before the layout: it fuses what is still a plain linear
    cpu_decode_layout(model, compile=args.compile)  # faster one-token steps on CPU (a no-op elsewhere)
    if args.compile and getattr(model, "compiled_step_reason", ""):
        print(f"--compile: decoding eagerly: {model.compiled_step_reason}", file=sys.stderr)
    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", verbose=False)  # (a prompt past the model's positions is refused below, in one line)
    if inputs["input_ids"].shape[1] == 0:  # an empty prompt, with a tokenizer that adds no BOS
        if tokenizer.bos_token_id is None:
            raise ConfigError(
                f"--prompt {args.prompt!r} gives no tokens and the tokenizer of {args.model} has no BOS token to start from",
                "give a prompt of at least one token, e.g. --prompt 'The'",
            )
        ids = torch.tensor([[tokenizer.bos_token_id]])  # start where a document starts
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    _check_positions(model, args.model, inputs["input_ids"].shape[1], args.max_new_tokens)
    sample = args.temperature > 0
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=not args.echo, skip_special_tokens=True)
    if args.draft is None:
        model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=sample,
            temperature=args.temperature if sample else None,
            top_p=args.top_p if sample else None,
            top_k=args.top_k if sample else None,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id,
        )
        return 0
    from attn2ssm.generation.speculative import speculative_generate

    if args.draft.startswith("ngram"):
        draft = args.draft  # prompt lookup: no model
    else:
        draft, _ = load_model_and_tokenizer(args.draft)
        _check_positions(draft, f"--draft {args.draft}", inputs["input_ids"].shape[1], args.max_new_tokens)
        cpu_decode_layout(draft)
    out = speculative_generate(
        model,
        draft,
        inputs["input_ids"],
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        do_sample=sample,
        temperature=args.temperature if sample else 1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator().manual_seed(args.seed),
        streamer=streamer,
    )
    s = out.stats
    print(
        f"[speculative] {s.generated} tokens in {s.rounds} target forwards ({s.tokens_per_round:.2f} per forward); "
        f"draft acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted}); "
        f"draft {s.draft_seconds:.1f}s, verify {s.verify_seconds:.1f}s",
        file=sys.stderr,
    )
    return 0


def _check_positions(model, name: str, prompt: int, new: int) -> None:
    """Refuse a prompt + new tokens longer than ``model`` reads positions for (an attention model's
    output past them is garbage; a student with no positions at all has no limit)."""
    from attn2ssm.student.loading import position_limit

    limit = position_limit(model.config)
    if limit is not None and prompt + new > limit:
        fix = (f"lower --max-new-tokens to {limit - prompt} or less, or shorten the prompt" if prompt < limit else
               f"shorten the prompt to fewer than {limit} tokens")  # fmt: skip
        raise ConfigError(f"the prompt ({prompt} tokens) and --max-new-tokens {new} need {prompt + new} positions; {name} reads at most {limit}", fix)


# --------------------------------------------------------------------------------------------- bench
def _draft_tokens(flag: str, text: str) -> int | str:
    """A number of draft tokens per round (>= 1) or ``auto`` (chosen each round)."""
    text = str(text).strip()
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{flag} {text} is not a positive number of draft tokens or 'auto'", f"write e.g. {flag} 4, or {flag} auto")
    return int(text)


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text!r} is not a comma-separated list of positive integers", f"write e.g. {flag} 1024,4096")
    return values



def _write_bench(result: dict, out: str, plot, fmt) -> int:
    """A benchmark's JSON (atomically) and its PNG beside it, then its table."""
    from attn2ssm.paths import atomic_write_text

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    png = plot(result, out.with_suffix(".png"))
    print(fmt(result))
    print(f"wrote {out} and {png}")
    return 0

def _llama_cpp_bench_args(args, models: tuple[str, ...]) -> tuple[str, ...]:
    """The llama.cpp backend's flags checked (before anything loads); returns the GGUF types."""
    from attn2ssm.bench.generate import LLAMA_CPP_STUDENTS
    from attn2ssm.export.llamacpp import OUTTYPES, converter_dir, load_runtime

    if args.backend != "llama.cpp":
        if args.quant is not None or args.gguf_dir is not None or args.no_flash_attn:
            raise ConfigError("--quant, --gguf-dir and --no-flash-attn are for --backend llama.cpp", "add --backend llama.cpp, or drop them")
        return ()
    other = [m for m in models if m != "teacher" and m not in LLAMA_CPP_STUDENTS]
    if other:
        raise ConfigError(f"--backend llama.cpp cannot run {other}: only Mamba-2 students export to GGUF", f"choose from teacher, {', '.join(LLAMA_CPP_STUDENTS)}")
    for flag, value in (("--spec", args.spec), ("--draft", args.draft), ("--compile", args.compile), ("--device", args.device not in (None, "cpu"))):
        if value:
            raise ConfigError(f"{flag} is for the torch backend", f"drop {flag} with --backend llama.cpp (it decodes on the CPU)")
    quants = tuple(q.strip() for q in (args.quant or "q8_0,f16").split(",") if q.strip())
    bad = [q for q in quants if q not in OUTTYPES]
    if bad or not quants:
        raise ConfigError(f"--quant {args.quant!r} names GGUF types llama.cpp has not here: {bad}", f"choose from {', '.join(OUTTYPES)}, e.g. --quant q8_0,f16")
    converter_dir()  # missing converter or runtime: one line naming make llama-cpp
    load_runtime()
    return quants


def _spec_bench_args(args) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--spec's targets (NAME or NAME=DIR) and drafters checked before anything loads."""
    from attn2ssm.bench.generate import STUDENTS, BenchSettings

    if not args.spec:
        if args.draft or args.spec_targets or args.spec_drafters:
            raise ConfigError("--draft, --spec-targets and --spec-drafters are for the speculative benchmark", "add --spec")
        return BenchSettings.spec_targets, BenchSettings.spec_drafters
    targets = tuple(t.strip() for t in (args.spec_targets or "mamba2,hybrid25").split(",") if t.strip())
    for item in targets:
        name, sep, path = item.partition("=")
        if sep and not (Path(path) / "config.json").exists():
            raise CheckpointError(f"--spec-targets {item}: {path} has no config.json", "point NAME=DIR at a student directory (e.g. runs/quality/hybrid25-65536/student)")
        if not sep and name not in STUDENTS:
            raise ConfigError(f"--spec-targets names an unknown student {name!r}", f"use NAME=DIR for a trained student, or one of {', '.join(STUDENTS)}")
    drafters = tuple(d.strip() for d in (args.spec_drafters if args.spec_drafters is not None else "ngram").split(",") if d.strip())
    bad = [d for d in drafters if d.partition(":")[0] != "ngram" or not (d.partition(":")[2] or "3").isdigit()]
    if bad:
        raise ConfigError(f"--spec-drafters {bad}", "use ngram or ngram:N (prompt lookup of the last N..1 tokens); model drafts go in --draft DIR")
    for path in args.draft or ():
        if not (Path(path) / "config.json").exists():
            raise CheckpointError(f"--draft {path} has no config.json", "point it at a student directory (e.g. runs/draft_shallow/student)")
    if not drafters and not args.draft:
        raise ConfigError("--spec with no drafter", "keep --spec-drafters ngram or add --draft DIR")
    return targets, drafters


def _weight_formats(args) -> tuple[str, ...]:
    """``bench generate --dtype D1,D2 --quantize none,int8``: every dtype x quantize pair, checked
    (one-line errors), named as the benchmark rows name them (float32, bfloat16, int8, bfloat16+int8)."""
    from attn2ssm.decode.quantize import check_weight_format, format_name

    dtypes = [d.strip() for d in (args.dtype or "float32").split(",") if d.strip()] or ["float32"]
    quants = [q.strip() for q in (args.quantize or "none").split(",") if q.strip()] or ["none"]
    if args.backend == "llama.cpp" and (dtypes != ["float32"] or quants != ["none"]):
        raise ConfigError("--dtype and --quantize are for the torch backend", "use --quant (GGUF types) with --backend llama.cpp")
    formats = []
    for d in dtypes:
        for q in quants:
            check_weight_format(d, q)
            formats.append(format_name(d, q))
    return tuple(dict.fromkeys(formats))


def cmd_bench_generate(args) -> int:
    from attn2ssm.bench.generate import LLAMA_CPP_STUDENTS, STUDENTS, BenchSettings

    if args.models is None:
        args.models = "teacher," + ",".join(LLAMA_CPP_STUDENTS) if args.backend == "llama.cpp" else "teacher,linear,mamba,mamba2,hybrid25"
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = [m for m in models if m != "teacher" and m not in STUDENTS]
    if unknown or not models:
        raise ConfigError(f"--models {args.models!r} names unknown models {unknown}", f"choose from teacher, {', '.join(STUDENTS)}")
    quants = _llama_cpp_bench_args(args, models)
    spec_targets, spec_drafters = _spec_bench_args(args)
    limits = {}
    for item in args.max_context or []:
        name, sep, value = item.partition("=")
        if not sep or name not in models or not value.isdigit():
            raise ConfigError(f"--max-context {item!r} is not MODEL=TOKENS for a benchmarked model", "write e.g. --max-context teacher=16384")
        limits[name] = int(value)
    if args.new_tokens < 3 or args.spec_new_tokens < 1:
        raise ConfigError("--new-tokens must be at least 3 (one prefill token, two to time decode)", "use e.g. --new-tokens 16")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds} must be at least 1", "use e.g. --rounds 3")
    settings = BenchSettings(
        teacher=args.teacher, contexts=_int_list("--contexts", args.contexts), models=models, new_tokens=args.new_tokens,
        max_context=limits, spec=args.spec, spec_targets=spec_targets, spec_drafters=spec_drafters, draft=tuple(args.draft or ()) or None,
        spec_contexts=_int_list("--spec-contexts", args.spec_contexts),
        spec_ks=tuple(_draft_tokens("--spec-k", v) for v in args.spec_k.split(",")), spec_new_tokens=args.spec_new_tokens, corpus=args.corpus,
        device=args.device, threads=args.threads, rounds=args.rounds, cpu_layout=not args.no_cpu_layout,
        compile_students=args.compile, backend=args.backend, quants=quants or BenchSettings.quants, flash_attn=not args.no_flash_attn,
        gguf_dir=args.gguf_dir,
    )  # fmt: skip
    if args.compile and args.no_cpu_layout:
        raise ConfigError("--compile needs the CPU decode layout", "drop --no-cpu-layout (or --compile)")
    settings.formats = _weight_formats(args)
    if args.plain_check not in ("shortest", "all", "none"):
        raise ConfigError(f"--plain-check {args.plain_check!r}", "use shortest, all or none")
    settings.plain_check = args.plain_check
    import shlex

    from attn2ssm.bench.generate import plot_generate_bench, plot_spec_bench, run_generate_bench

    result = run_generate_bench(settings, progress=not args.no_progress)
    result["command"] = shlex.join(["attn2ssm", *sys.argv[1:]]) if sys.argv[0].endswith(("attn2ssm", "__main__.py")) else "attn2ssm bench generate"
    if args.spec:
        return _write_bench(result, args.out or "benchmarks/results/speculative.json", plot_spec_bench, format_spec_bench)
    return _write_bench(result, args.out or "benchmarks/results/generate_speed.json", plot_generate_bench, format_generate_bench)


def cmd_bench_quality(args) -> int:
    import shlex

    from attn2ssm.bench.quality import DEFAULT_TEACHER, EvalSettings, GridSettings, format_markdown, parse_family_table, select_cells

    table = parse_family_table(args.family)
    cells = select_cells(table, args.families, args.budgets, args.only)
    corpora = tuple(c.strip() for c in args.corpora.split(",") if c.strip())
    if not corpora:
        raise ConfigError(f"--corpora {args.corpora!r} names no corpus", "write e.g. --corpora sotu,moby-dick")
    windows = _int_list("--windows", args.windows)
    if min(windows) < 2:
        raise ConfigError(f"--windows {args.windows!r} has a window shorter than 2 tokens", "write e.g. --windows 1024,2048")
    if args.eval_tokens < max(windows) // 2 + 2:
        raise ConfigError(f"--eval-tokens {args.eval_tokens} is too few for windows up to {max(windows)}", f"use at least {max(windows)}, e.g. --eval-tokens 16384")
    if args.agreement_prompts < 0 or args.passkey_trials < 1:
        raise ConfigError("--agreement-prompts must be >= 0 and --passkey-trials >= 1", "e.g. --agreement-prompts 16 --passkey-trials 2")
    try:
        depths = tuple(float(v) for v in args.passkey_depths.split(",") if v.strip())
    except ValueError:
        depths = (-1.0,)
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"--passkey-depths {args.passkey_depths!r} is not a list of fractions in 0..1", "write e.g. --passkey-depths 0,0.5,1")
    lengths = () if args.passkey_lengths in ("", "0", "none") else _int_list("--passkey-lengths", args.passkey_lengths)
    settings = GridSettings(
        teacher=args.teacher or DEFAULT_TEACHER, families=table, cells=cells, sets=list(args.set or []), grid_dir=Path(args.out_dir),
        json_path=Path(args.json),
        eval=EvalSettings(corpora=corpora, windows=windows, eval_tokens=args.eval_tokens, agreement_prompts=args.agreement_prompts,
                          passkey_lengths=lengths, passkey_depths=depths, passkey_trials=args.passkey_trials),
    )  # fmt: skip
    from attn2ssm.bench.quality import format_plan, plan_cells, run_grid
    from attn2ssm.teachers import resolve_teacher

    planned = plan_cells(settings)  # a missing recipe, an unscalable stage, a budget too small: before anything loads
    if args.plan:
        print(format_plan(planned, settings.eval))
        return 0
    resolve_teacher(settings.teacher)  # a missing path fails before any cell starts
    command = shlex.join(["attn2ssm", *args.argv])
    result = run_grid(settings, command=command, progress=not args.no_progress, cells=planned)
    print()
    print(format_markdown(result))
    out = Path(args.json)
    print(f"\nwrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.md')} ({len(result['cells'])} cells of {settings.grid_dir})")
    return 0


def cmd_bench_train(args) -> int:
    import shlex

    from attn2ssm.bench.train import CASES, TrainBenchSettings

    cases = tuple(c.strip() for c in args.cases.split(",") if c.strip())
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ConfigError(f"--cases {args.cases!r} names unknown stage cases {unknown}", f"choose from {', '.join(CASES)}")
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ConfigError(f"--precisions {args.precisions!r} is not a list of {' / '.join(PRECISIONS)}", "write e.g. --precisions no,auto")
    if args.steps < 1 or args.step_tokens < 1:
        raise ConfigError("--steps and --step-tokens must be positive", "use e.g. --steps 3 --step-tokens 2048")
    settings = TrainBenchSettings(teacher=args.teacher, cases=cases, lengths=_int_list("--lengths", args.lengths), step_tokens=args.step_tokens,
                                  precisions=precisions, steps=args.steps, threads=args.threads, profile=not args.no_profile, corpus=args.corpus)  # fmt: skip
    from attn2ssm.bench.train import format_train_bench, plot_train_bench, run_train_bench

    result = run_train_bench(settings, progress=not args.no_progress)
    result["command"] = shlex.join(["attn2ssm", *args.argv])
    return _write_bench(result, args.out, plot_train_bench, format_train_bench)


def format_generate_bench(result: dict) -> str:
    engine = "llama.cpp, " if result.get("backend") == "llama.cpp" else ""
    lines = [f"decode ({engine}{result['device']}, {result['threads']} threads): tokens/s | prefill s | cache MB, by context"]
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
                cells.append(f"{r['context']}: {r['decode_tokens_per_second']:.2f}{speedup} | {r['prefill_seconds']:.1f} | {r['cache_mb']:.1f}")
        lines.append(f"  {name:<{max(9, *map(len, result['decode']))}} " + "; ".join(cells))
    return "\n".join(lines)


def format_spec_bench(result: dict) -> str:
    lines = [f"speculative decoding ({result['device']}, {result['threads']} threads), the student as target; speedup over its plain greedy decode"]
    for row in result["speculative"]:
        lines.append(f"{row['target']} @ {row['context']} {row['task']} (plain {row['plain_tokens_per_second']:.2f} tok/s):")
        for name, rows in row["by_drafter"].items():
            for r in rows:
                lines.append(f"  {name} K={r['k']}: {r['tokens_per_second']:.2f} tok/s ({r['speedup']:.2f}x), acceptance {r['acceptance_rate']:.1%}, "
                             f"{r['tokens_per_target_forward']:.2f} tokens/forward, identical {r['identical_to_plain_greedy']}")  # fmt: skip
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- recipes
def cmd_recipes(args) -> int:
    from attn2ssm.distill.recipe import builtin_recipes, load_recipe

    recipes = builtin_recipes()
    if args.name:
        if args.name not in recipes:
            raise CheckpointError(f"no built-in recipe '{args.name}'", f"choose one of: {', '.join(recipes)}")
        print(load_recipe(args.name).to_yaml())
        return 0
    for name in recipes:
        r = load_recipe(name)
        tokens = sum(s.tokens for s in r.stages)
        stages = " → ".join(f"{s.name}({s.kind})" for s in r.stages)
        print(f"{name:<14} {stages}; {tokens:,} tokens. {r.description}")
    return 0


# --------------------------------------------------------------------------------------------- upgrade
def cmd_upgrade(args) -> int:
    from attn2ssm.hf_compat import TESTED_TRANSFORMERS
    from attn2ssm.export.upgrade import upgrade_remote_code

    for directory in args.dirs:
        written = upgrade_remote_code(directory)
        low, high = TESTED_TRANSFORMERS
        print(f"refreshed {len(written)} modeling files in {directory} (code tested with transformers >={low},<{high}); weights untouched")
    return 0


# --------------------------------------------------------------------------------------------- export
def cmd_export(args) -> int:
    if args.format == "gguf":
        return _export_gguf(args)
    if args.outtype is not None:
        raise ConfigError("--outtype is for --format gguf", "drop --outtype (a native export keeps the student's dtype)")
    from attn2ssm.export.native import export_native

    result = export_native(args.student, args.out, force=args.force)
    n_attn = result.layer_types.count("attention")
    print(f"wrote {result.out}: {result.cls}, {len(result.layer_types) - n_attn} Mamba-2 + {n_attn} attention layers; "
          f"logits equal the student's to {result.max_abs_diff:.1e} on a probe; loads without trust_remote_code")  # fmt: skip
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _export_gguf(args) -> int:
    from attn2ssm.export.gguf import export_gguf, llama_cpp_tolerance

    result = export_gguf(args.student, args.out, outtype=args.outtype or "f16", force=args.force, threads=args.threads)
    n_attn = result.layer_types.count("attention")
    if result.llama_cpp_max_abs_diff is None:
        checked = "not run in llama.cpp (llama_cpp not importable)"
    else:
        within = " (within tolerance)" if result.llama_cpp_max_abs_diff <= llama_cpp_tolerance(result.logit_scale) else ""
        checked = f"llama.cpp's logits differ from the student's by {result.llama_cpp_max_abs_diff:.1e}{within} on a probe (largest logit {result.logit_scale:.1f})"
    identity = f" (+ {len(result.identity_layers)} identity layer llama.cpp needs)" if result.identity_layers else ""
    print(f"wrote {result.out} ({result.outtype}, {result.bytes / 2**20:.1f} MiB): llama.cpp granitehybrid, {len(result.layer_types) - n_attn} Mamba-2 + {n_attn} "
          f"attention layers{identity}; {checked}")  # fmt: skip
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attn2ssm", description="Distil a Hugging Face Transformer into a linear-attention / SSM / hybrid student.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="build an untrained student from a teacher (weights reused)")
    c.add_argument("--teacher", default=None, help="built-in name, HF directory, .gguf file or hub id (default smollm2-135m)")
    c.add_argument("--mixer", default="linear_attention")
    c.add_argument("--attention-ratio", type=float, default=0.0, help="fraction of layers keeping softmax attention (interleaved, last of each group)")
    c.add_argument("--keep", default=None, help="comma-separated layer indices that keep attention (overrides the ratio), or 'auto': "
                   "keep the ratio's worth of layers whose conversion alone hurts the teacher most")
    c.add_argument("--calibration", default=None, help="corpus for --keep auto (default: sotu)")
    c.add_argument("--init", choices=("attention", "random"), default="attention", help="mixers from the teacher's q/k/v/o, or random (ablation)")
    c.add_argument("--option", action="append", help="mixer option key=value (repeatable), e.g. feature_map=elu")
    c.add_argument("--out", required=True)
    c.add_argument("--force", action="store_true", help="replace a model or run already in --out (written beside it first, so a failure keeps the old one)")
    c.set_defaults(func=cmd_convert)

    d = sub.add_parser("distill", help="run a distillation recipe (default: quickstart)")
    d.add_argument("recipe", nargs="?", default=None, help="built-in recipe name or YAML path")
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field, e.g. stages.0.tokens=20000")
    d.add_argument("--out", default=None, help="run directory (default runs/<recipe>)")
    d.add_argument("--teacher", default=None, help="override the recipe's teacher")
    d.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint, with the recipe saved there; "
                   "--set may then change only what leaves the steps already taken as they were: eval.*, stages.N.save_every, "
                   "stages.N.keep_checkpoints, stages.N.eval_every, stages.N.eval_batches, device and mixed_precision (the last two for the "
                   "remaining steps); any other changed key is refused, naming it. SIGTERM / Ctrl-C stop a run after the current step with "
                   "a checkpoint and print this command to resume")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_distill)

    e = sub.add_parser("eval", help="held-out perplexity of a student or teacher")
    e.add_argument("model", help="student directory or teacher spec")
    e.add_argument("--against", default=None, help="teacher to evaluate beside it")
    e.add_argument("--corpus", default="sotu")
    e.add_argument("--window", type=int, default=256)
    e.add_argument("--stride", type=int, default=None)
    e.add_argument("--max-tokens", type=int, default=20000)
    e.add_argument("--quantize", default=None, help="int8: score MODEL with int8 weight-only linears (as generate --quantize int8; --dtype sets the rest)")
    e.add_argument("--json", default=None, help="also write results to this JSON file")
    e.add_argument("--attention", action="store_true", help="instead of perplexity: per-layer attention fidelity of a student to its teacher (KL, entropy, monotonicity) and heat-maps")
    e.add_argument("--text", default=None, help="with --attention: also score this text, and draw the heat-maps from it")
    e.add_argument("--blocks", type=int, default=4, help="with --attention: held-out blocks of --window tokens to score (0 = only --text)")
    e.add_argument("--out-dir", default=None, help="with --attention: where attention_fidelity.json and the PNGs go (default MODEL/eval); "
                   "with --report: where the report goes (default MODEL/eval/report)")
    e.add_argument("--report", action="store_true", help="teacher-vs-student report against --against (default: the built-in teacher): perplexity on "
                   "each --corpus (comma-separated), generation agreement, passkey retrieval (--needle-lengths), attention fidelity, --tasks")
    e.add_argument("--needle-lengths", default=None, help="with --report: passkey context lengths in tokens, e.g. 256,512,1024")
    e.add_argument("--needle-depths", default="0,0.25,0.5,0.75,1", help="with --report: needle depths (fractions of the filler)")
    e.add_argument("--needle-trials", type=int, default=3)
    e.add_argument("--agreement-prompts", type=int, default=16, help="with --report: held-out prompts for generation agreement (0 = skip)")
    from attn2ssm.eval.harness import add_eval_task_args

    add_eval_task_args(e)
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="generate text with a student or teacher")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--echo", action="store_true", help="print the prompt too")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--draft", default=None, help="speculative decoding: 'ngram' (prompt lookup, no model) or a draft model (student dir or teacher "
                   "spec, same tokenizer) proposes tokens that MODEL verifies")
    g.add_argument("--num-draft-tokens", default="auto", help="with --draft: tokens proposed per verifier forward, or auto (default: "
                   "chosen each round from the acceptance and round times measured so far, 0 where drafting does not pay)")
    g.add_argument("--compile", action="store_true", help="CPU, pure students: run the decode step as one torch.compile'd function (~1.5x faster a token; the first step compiles, about a minute on 2 cores)")
    g.add_argument("--dtype", default="float32", help="weights and activations: float32 or bfloat16 (SSM decay, skip and dt bias stay float32)")
    g.add_argument("--quantize", default=None, help="int8: linear weights int8 with per-channel scales (weight-only; activations in --dtype)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks (generate: decode speed / memory vs context, speculative decoding; quality: the family × budget scoreboard)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bg = bsub.add_parser("generate", help="decode tokens/s, prefill time and memory vs context for the teacher and students (PyTorch or llama.cpp); "
                         "speculative decoding with the student as target with --spec")
    bg.add_argument("--teacher", default=None, help="teacher spec (default: the built-in smollm2-135m)")
    bg.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"), help="torch: the HF models in PyTorch; llama.cpp: GGUFs of the teacher "
                    "and its students (exported with export --format gguf) in llama-cpp-python, on the CPU ('make llama-cpp' installs it)")
    bg.add_argument("--models", default=None, help="teacher and/or untrained students: linear, mamba, mamba2, hybrid25 (default: all; llama.cpp: teacher,mamba2,hybrid25)")
    bg.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768", help="context lengths (prompt tokens)")
    bg.add_argument("--max-context", action="append", metavar="MODEL=TOKENS", help="skip longer contexts for a model (repeatable), e.g. teacher=16384")
    bg.add_argument("--new-tokens", type=int, default=16, help="greedy tokens decoded per point")
    bg.add_argument("--spec", action="store_true", help="speculative decoding with the student as the target (Mamba in the Llama §4): "
                    "speedup over the target's plain greedy decode, acceptance, tokens per target forward (writes benchmarks/results/speculative.json)")
    bg.add_argument("--spec-targets", default=None, help="with --spec: targets, NAME (an untrained conversion: mamba2, hybrid25, ...) or NAME=DIR "
                    "(a trained student), comma-separated (default mamba2,hybrid25)")
    bg.add_argument("--spec-drafters", default=None, help="with --spec: model-free drafters, ngram or ngram:N (prompt lookup; default ngram; '' for none)")
    bg.add_argument("--draft", action="append", default=None, metavar="DIR", help="with --spec: a draft model (student directory or teacher spec "
                    "sharing the tokenizer, e.g. a shallow student from recipes/draft_shallow.yaml); repeatable")
    bg.add_argument("--spec-contexts", default="1024,8192")
    bg.add_argument("--spec-k", default="2,4,6,auto", help="with --spec: draft tokens per target forward (auto: chosen each round)")
    bg.add_argument("--spec-new-tokens", type=int, default=64)
    bg.add_argument("--corpus", default="sotu", help="text the prompts are cut from")
    bg.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    bg.add_argument("--threads", type=int, default=None)
    bg.add_argument("--rounds", type=int, default=3, help="decode rounds per point (models take turns; rates from the median token time)")
    bg.add_argument("--no-cpu-layout", action="store_true", help="keep HF's weight layout on CPU (default: cpu_decode_layout for every model, teacher included)")
    bg.add_argument("--compile", action="store_true", help="CPU: pure students decode through a torch.compile'd step (compiled before timing; the teacher runs HF's forward)")
    bg.add_argument("--dtype", default="float32", help="torch: comma-separated weight dtypes, float32 and/or bfloat16 (rows NAME@bfloat16)")
    bg.add_argument("--quantize", default="none", help="torch: comma-separated none and/or int8 (int8 weight-only linears; rows NAME@int8, NAME@bfloat16+int8)")
    bg.add_argument("--plain-check", default="shortest", help="also time each model's plain generate (a user's call) beside the rounds at the "
                    "shortest context (default), all contexts, or none; JSON: plain_generate_tokens_per_second, benchmark_vs_plain_generate")
    bg.add_argument("--quant", default=None, help="llama.cpp: GGUF types, teacher and students alike (default q8_0,f16)")
    bg.add_argument("--gguf-dir", default=None, help="llama.cpp: keep the GGUF files here and reuse those already there (default: a temporary folder)")
    bg.add_argument("--no-flash-attn", action="store_true", help="llama.cpp: without flash attention (default on, as llama.cpp's CLI picks on CPU)")
    bg.add_argument("--out", default=None, help="JSON (the PNG goes beside it); default benchmarks/results/generate_speed.json, "
                    "speculative.json with --spec; e.g. benchmarks/results/generate_speed_llama_cpp.json for llama.cpp")
    bg.add_argument("--no-progress", action="store_true")
    bg.set_defaults(func=cmd_bench_generate)

    bq = bsub.add_parser("quality", help="quality scoreboard: student families × token budgets distilled from one teacher, "
                         "each cell scored against it (perplexity ratio, top-1 and greedy agreement, passkey)")
    bq.add_argument("--teacher", default=None, help="teacher spec for every cell (default: the built-in smollm2-135m)")
    bq.add_argument("--families", default=None, help="comma-separated families (default: every family in the table)")
    bq.add_argument("--budgets", default=None, help="training tokens per cell, comma-separated (default 65536,262144,1048576; 2^16 works too)")
    bq.add_argument("--only", default=None, metavar="FAMILY@TOKENS,...", help="run just these cells (instead of --families × --budgets)")
    bq.add_argument("--family", action="append", metavar="NAME=RECIPE", help="add a family (or remap one) to a recipe name or YAML path (repeatable)")
    bq.add_argument("--set", action="append", metavar="[FAMILY:]KEY=VALUE", help="recipe override for every cell, or with FAMILY: for that family's cells "
                    "(variants of one recipe: --family w32=lolcats --set w32:student.mixer_options.window=32); applied before the budget's stage tokens")
    bq.add_argument("--out-dir", default="runs/quality", help="grid directory: one run directory per cell, the teacher's cached references")
    bq.add_argument("--json", default="benchmarks/results/quality.json", help="grid JSON (the PNG and markdown table go beside it)")
    bq.add_argument("--corpora", default="sotu,moby-dick", help="held-out corpora to score (the first also gives the agreement prompts)")
    bq.add_argument("--windows", default="1024,2048", help="perplexity windows (stride = window / 2)")
    bq.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored per corpus")
    bq.add_argument("--agreement-prompts", type=int, default=16, help="held-out prompts for greedy 32-token continuation agreement (0 = skip)")
    bq.add_argument("--passkey-lengths", default="1024,2048", help="passkey context lengths in tokens ('none' = skip)")
    bq.add_argument("--passkey-depths", default="0,0.5,1")
    bq.add_argument("--passkey-trials", type=int, default=2, help="keys per length and depth")
    bq.add_argument("--plan", action="store_true", help="list the cells, their status (done / trained / partial / todo) and commands; run nothing")
    bq.add_argument("--no-progress", action="store_true")
    bq.set_defaults(func=cmd_bench_quality)

    bt = bsub.add_parser("train", help="training tokens/s of each stage kind (the trainer's own step) against the teacher's forward "
                         "(the bound) and the teacher's own forward + backward, fp32 and bf16")
    bt.add_argument("--teacher", default=None, help="teacher spec (default: the built-in smollm2-135m)")
    bt.add_argument("--cases", default="attention_transfer,hidden_alignment,kd_lora,kd_ce_mixers", help="stage cases (see attn2ssm.bench.train.CASES)")
    bt.add_argument("--lengths", default="1024", help="block lengths in tokens, comma-separated (e.g. 1024,4096,16384)")
    bt.add_argument("--step-tokens", type=int, default=2048, help="tokens per optimizer step (batch = step-tokens // length, at least 1)")
    bt.add_argument("--precisions", default="no,auto", help="mixed precision settings: no (fp32), auto (bf16 where it is fast), bf16 (autocast), fp16")
    bt.add_argument("--steps", type=int, default=3, help="timed steps per point, after one warm-up")
    bt.add_argument("--threads", type=int, default=None)
    bt.add_argument("--corpus", default="sotu", help="text the blocks are cut from")
    bt.add_argument("--no-profile", action="store_true", help="skip the profiled step (top operators by self time)")
    bt.add_argument("--out", default="benchmarks/results/train_speed.json")
    bt.add_argument("--no-progress", action="store_true")
    bt.set_defaults(func=cmd_bench_train)

    u = sub.add_parser("upgrade", help="refresh saved students' modeling code (trust_remote_code files) with this attn2ssm's; weights untouched")
    u.add_argument("dirs", nargs="+", metavar="DIR", help="student directories (with config.json)")
    u.set_defaults(func=cmd_upgrade)

    x = sub.add_parser("export", help="write a student as a checkpoint of a native transformers class (no remote code), or as a llama.cpp GGUF, where the map is exact")
    x.add_argument("student", help="student directory (a run's student/ folder or a convert --out)")
    x.add_argument("--format", required=True, choices=("native", "gguf"), help="native: GraniteMoeHybridForCausalLM (Mamba-2 students with norm: true "
                   "of Llama / Mistral / Qwen2 teachers, pure or hybrid with global attention layers); gguf: that model through llama.cpp's own "
                   "converter (also needs gate_bias: false and no q/k/v biases; 'make llama-cpp' installs the converter)")
    x.add_argument("--out", required=True, help="directory for the exported model (native), or the .gguf file (gguf)")
    from attn2ssm.export.llamacpp import OUTTYPES

    x.add_argument("--outtype", default=None, choices=OUTTYPES, help="gguf: the weights' type (default f16); f32/f16/bf16/q8_0 from llama.cpp's converter, "
                   "the others quantised from its f32 output with llama_model_quantize")
    x.add_argument("--threads", type=int, default=None, help="gguf: threads for quantising")
    x.add_argument("--force", action="store_true", help="replace a model already in --out")
    x.set_defaults(func=cmd_export)

    r = sub.add_parser("recipes", help="list built-in recipes, or print one")
    r.add_argument("name", nargs="?")
    r.set_defaults(func=cmd_recipes)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was typed (benchmarks record it)
    try:
        return args.func(args)
    except Attn2SSMError as exc:
        if args.debug:
            raise
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # always one line
        if isinstance(exc, Interrupted):  # a run stopped on a signal, its work saved: not an error
            print(message, file=sys.stderr)
            return exc.exit_code
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
