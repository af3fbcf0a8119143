"""What the evaluation suite scores: its tasks (``TaskSpec``), its settings (``SuiteSettings``: the
standard suite and its quick form), and the ``eval --suite`` flags that choose rows, corpora, windows
and needles. Plain dataclasses (no torch): the CLI checks a flag here before anything heavy loads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from attn2ssm.errors import ConfigError

DOMAINS = {
    "emails": "email (mailing lists, 2002)",
    "kjv": "archaic English (KJV Bible)",
    "pydoc": "technical prose (Python reference)",
    "sotu": "in-domain: SOTU addresses 2000-2021",
    "moby-dick": "in-domain: Moby Dick, last chapters",
}
IN_DOMAIN = ("sotu", "moby-dick")  # the training corpora's held-out text: the in-domain reference


@dataclass(frozen=True)
class TaskSpec:
    """An lm-eval task (or group) of the offline pack, its metric, shots and items scored."""

    task: str
    metric: str = "acc"
    shots: int = 0
    items: int | None = (
        None  # a seeded random subset of this many documents (per subtask of a group); None: all
    )
    label: str = ""  # its column in the anchors table

    @property
    def name(self) -> str:
        return f"{self.task} {self.shots}-shot" if self.shots else self.task


CORE = (
    ("arc_easy", "acc", "ARC-e"),
    ("arc_challenge", "acc_norm", "ARC-c"),
    ("hellaswag", "acc_norm", "HS"),
    ("piqa", "acc", "PIQA"),
    ("winogrande", "acc", "WG"),
    ("boolq", "acc", "BoolQ"),
    ("lambada_openai", "acc", "LAMBADA"),
    ("openbookqa", "acc_norm", "OBQA"),
)


LONG_WINDOWS = (1024, 2048, 4096, 8192)  # the standard suite's perplexity windows and needle lengths
CURVE_WINDOWS = (512, 1024, 2048, 4096, 8192)  # the length curve's, clipped to a model's positions


@dataclass
class SuiteSettings:
    name: str = "standard"
    corpora: tuple[str, ...] = ("emails", "kjv", "pydoc", "sotu", "moby-dick")
    windows: tuple[int, ...] = (1024, 2048)
    # the length curve (student / teacher perplexity against the window): its windows are perplexity
    # units too (their rows join the table); () draws it over ``windows``' units alone
    curve_windows: tuple[int, ...] = ()
    max_tokens: int = 16384  # held-out tokens per corpus, at most
    tasks: tuple[TaskSpec, ...] = ()
    generation: TaskSpec | None = None
    max_gen_toks: int = 32  # a generated answer's length cap (lm-eval's default is 256)
    niah_forms: tuple[str, ...] = ("niah_single_1", "niah_single_2", "niah_single_3")
    niah_lengths: tuple[int, ...] = (1024, 2048, 4096)
    niah_trials: int = 20
    niah_essay: str = "sotu"  # whose held-out prose is the essay haystack
    seed: int = 1234
    batch_size: int = 8
    # the length flags the user set (--windows, --needle-lengths, --curve-windows): a length of theirs
    # past a model's positions is refused, one of the suite's own is dropped with a note
    chosen: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @property
    def perplexity_windows(self) -> tuple[int, ...]:
        """Every window a perplexity unit is scored at: the rows' and the length curve's."""
        return tuple(sorted({*self.windows, *self.curve_windows})) if self.corpora else ()


def standard_tasks(items: int, mmlu_per_subject: int) -> tuple[TaskSpec, ...]:
    core = tuple(TaskSpec(task, metric, 0, items, label) for task, metric, label in CORE)
    return core + (
        TaskSpec("mmlu", "acc", 0, mmlu_per_subject, "MMLU 0-shot"),
        TaskSpec("mmlu", "acc", 5, mmlu_per_subject, "MMLU 5-shot"),
    )


def suite_settings(name: str = "standard", quick: bool = False) -> SuiteSettings:
    """The standard suite, or its quick form (fewer items, trials and tokens; larger standard errors).

    standard: 400 documents per core task (SE <= 2.5 points), MMLU 7 per subject (399; SE <= 2.5),
    TriviaQA 400, needles 20 trials per form and length at 1k-8k, 16,384 held-out tokens per corpus,
    perplexity at windows 1k-8k and the length curve from 512 to 8k.
    quick: 100 per task (SE <= 5 points), MMLU 2 per subject (114; SE <= 4.7), TriviaQA 100,
    5 trials (SE <= 22 points) at 1k-4k, 4,096 tokens per corpus, perplexity rows at 1k and 2k and
    the length curve from 512 to 4k (its tokens hold no longer window; docs/evaluation.md has the costs).
    """
    if name != "standard":
        raise ConfigError(f"unknown suite {name!r}", "use --suite standard (with --quick for its cheap form)")
    if quick:
        return SuiteSettings(
            name="standard --quick",
            max_tokens=4096,
            curve_windows=(512, 1024, 2048, 4096),
            tasks=standard_tasks(100, 2),
            generation=TaskSpec("triviaqa", "exact_match", 5, 100, "TriviaQA EM 5-shot"),
            niah_trials=5,
        )
    return SuiteSettings(
        windows=LONG_WINDOWS,
        curve_windows=CURVE_WINDOWS,
        niah_lengths=LONG_WINDOWS,
        tasks=standard_tasks(400, 7),
        generation=TaskSpec("triviaqa", "exact_match", 5, 400, "TriviaQA EM 5-shot"),
    )


ROW_GROUPS = ("perplexity", "tasks", "mmlu", "generation", "needles")


def select_rows(settings: SuiteSettings, groups: str | None) -> SuiteSettings:
    """``settings`` keeping only the row groups named in ``groups`` (comma-separated, of
    ``ROW_GROUPS``: perplexity, tasks — the 0-shot core tasks —, mmlu, generation, needles);
    None keeps every row. Row ids, cache keys and item choices are unchanged, so a partial run's
    rows equal the same rows of a full one, and the teacher's cached units are reused."""
    if groups is None:
        return settings
    chosen = [g.strip() for g in groups.split(",") if g.strip()]
    unknown = [g for g in chosen if g not in ROW_GROUPS]
    if unknown or not chosen:
        raise ConfigError(
            f"--rows {groups!r} names no row group or unknown ones {unknown}",
            f"choose from {', '.join(ROW_GROUPS)}, e.g. --rows perplexity,needles",
        )
    keep = set(chosen)
    return replace(
        settings,
        corpora=settings.corpora if "perplexity" in keep else (),
        tasks=tuple(t for t in settings.tasks if ("mmlu" if t.task == "mmlu" else "tasks") in keep),
        generation=settings.generation if "generation" in keep else None,
        niah_forms=settings.niah_forms if "needles" in keep else (),
    )


def select_perplexity(
    settings: SuiteSettings,
    corpora: tuple[str, ...] | None = None,
    windows: tuple[int, ...] | None = None,
    curve: tuple[int, ...] | None = None,
) -> SuiteSettings:
    """``settings`` with the perplexity rows on other ``corpora`` (any corpus spec of docs/data.md:
    a built-in, a local file or folder, a mixture) and/or at other ``windows`` (tokens), and the
    length curve at other ``curve`` windows; None keeps the suite's. A (corpus, window) row both runs
    share has the same cache key and numbers, so e.g. ``--corpora emails,kjv,pydoc --windows 1024``
    is three rows of the full table at a fifth of its perplexity cost. ``--windows`` alone
    (without ``--curve-windows``) draws the curve over those windows only."""
    if corpora is not None:
        chosen = tuple(dict.fromkeys(c.strip() for c in corpora if c.strip()))
        if not chosen:
            raise ConfigError("--corpora names no corpus", "write e.g. --corpora emails,kjv,pydoc")
        settings = replace(settings, corpora=chosen)
    if windows is not None:
        settings = replace(
            settings,
            windows=check_lengths("--windows", "windows", windows, 16),
            curve_windows=() if curve is None else settings.curve_windows,
            chosen=(*settings.chosen, "--windows"),
        )
    if curve is not None:
        settings = replace(
            settings,
            curve_windows=check_lengths("--curve-windows", "windows", curve, 16),
            chosen=(*settings.chosen, "--curve-windows"),
        )
    return settings


def check_lengths(flag: str, what: str, values: tuple[int, ...], least: int) -> tuple[int, ...]:
    """``values`` (token counts) sorted and deduplicated; one line if any is below ``least``."""
    if not values or any(n < least for n in values):
        raise ConfigError(
            f"{flag} {','.join(map(str, values)) or '(empty)'} needs {what} of at least {least} tokens",
            f"write e.g. {flag} 1024,2048",
        )
    return tuple(sorted(set(values)))


def select_needles(
    settings: SuiteSettings, lengths: tuple[int, ...] | None = None, trials: int | None = None
) -> SuiteSettings:
    """``settings`` with the needles at other ``lengths`` (tokens) and/or ``trials`` per form and
    length; None keeps the suite's. Each unit's cache key names its length and trials, so a length
    both runs share is cached once and gives the same numbers, e.g. the standard 20 trials at 1k and
    2k only (``--needle-lengths 1024,2048``) where 4k's cost is not wanted."""
    if lengths is not None:
        settings = replace(
            settings,
            niah_lengths=check_lengths("--needle-lengths", "lengths", lengths, 256),
            chosen=(*settings.chosen, "--needle-lengths"),
        )
    if trials is not None:
        if trials < 1:
            raise ConfigError(
                f"--needle-trials {trials} is not a count of trials", "write e.g. --needle-trials 20"
            )
        settings = replace(settings, niah_trials=trials)
    return settings


def settings_from_dict(d: dict) -> SuiteSettings:
    d = dict(d)
    d["tasks"] = tuple(TaskSpec(**t) for t in d.get("tasks", ()))
    d["generation"] = TaskSpec(**d["generation"]) if d.get("generation") else None
    for k in ("corpora", "windows", "curve_windows", "niah_forms", "niah_lengths", "chosen"):
        d[k] = tuple(d.get(k, ()))
    return SuiteSettings(**d)


def with_overrides(settings: SuiteSettings, **changes) -> SuiteSettings:
    """``settings`` with some fields replaced (tests and benchmarks shrink a suite this way)."""
    return replace(settings, **changes)


def fit_positions(settings: SuiteSettings, limit: int | None, name: str) -> tuple[SuiteSettings, list[str]]:
    """``settings`` for a model that reads at most ``limit`` positions (None: any): a length of the
    suite's own past it is dropped (returned: one note a dropped group); one the user chose
    (``settings.chosen``) is refused with one line, and so is a group left with no length at all."""
    if limit is None:
        return settings, []
    groups = (  # (flag, field, the lengths its rows read)
        ("--windows", "windows", settings.windows if settings.corpora else ()),
        ("--curve-windows", "curve_windows", settings.curve_windows if settings.corpora else ()),
        ("--needle-lengths", "niah_lengths", settings.niah_lengths if settings.niah_forms else ()),
    )
    refused = [
        flag
        for flag, field_name, values in groups
        if values
        and max(values) > limit
        and (flag in settings.chosen or (field_name != "curve_windows" and min(values) > limit))
    ]
    if refused:
        longest = max(max(v) for f, _, v in groups if f in refused)
        raise ConfigError(
            f"{name} reads at most {limit} positions, and the suite needs {longest}",
            f"lower {' and '.join(refused)} to {limit} or less, e.g. {refused[0]} {limit}",
        )
    notes, changes = [], {}
    for flag, field_name, values in groups:
        dropped = [v for v in values if v > limit]
        if dropped:
            changes[field_name] = tuple(v for v in values if v <= limit)
            notes.append(
                f"note: {name} reads at most {limit} positions: {flag.lstrip('-')} "
                f"{','.join(map(str, dropped))} skipped"
            )
    return replace(settings, **changes), notes
