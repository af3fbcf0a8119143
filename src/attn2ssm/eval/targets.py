"""Targets: thresholds a suite run is checked against (``eval --suite standard --targets FILE``).

A targets file is YAML with one key, ``targets``, a list of entries, each a ``name``, a ``kind`` and
the kind's thresholds. Row patterns are ``fnmatch`` patterns on the suite's row ids:
``ppl/CORPUS/WINDOW``, ``task/TASK/SHOTS``, ``niah/FORM/LENGTH`` (greedy match) and
``niah/FORM/LENGTH/recall``. The kinds:

- ``max_ratio`` (``rows``, ``max``): every matched perplexity row's student / teacher ratio ≤ max;
- ``min_student`` (``rows``, ``min``): every matched row's student score ≥ min (accuracies are
  fractions: 0.80 is 80 %);
- ``min_vs_teacher`` (``rows``, ``margin``): every matched row's student ≥ its teacher − margin;
- ``max_ratio_rise`` (``from_window``, ``to_window``, ``max_rise``, ``corpora`` = ``*``): on every
  corpus matching ``corpora``, the ratio at ``to_window`` ≤ the ratio at ``from_window`` + max_rise;
- ``elsewhere`` (``by``): a target the suite does not measure (e.g. decode speed, which
  ``bench generate`` measures): always "not measured", saying where it is measured.

Each target checked gives ``status`` "met", "missed" or "not measured": a target whose rows the run
did not score (``--rows``, ``--windows``, ``--needle-lengths``, a length past a model's positions) is
not measured, never met; a missed row decides "missed" even when others are not scored yet. Plain
Python (no torch): the CLI loads and checks a file before any model loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from attn2ssm.config import _yaml_problem
from attn2ssm.errors import ConfigError
from attn2ssm.eval.suite_settings import SuiteSettings

TOLERANCE = 1e-9  # a score equal to its threshold meets it, whatever the last bit of a float says
KINDS = {  # kind: (its required fields, its optional fields with their defaults)
    "max_ratio": (("rows", "max"), {}),
    "min_student": (("rows", "min"), {}),
    "min_vs_teacher": (("rows", "margin"), {}),
    "max_ratio_rise": (("from_window", "to_window", "max_rise"), {"corpora": "*"}),
    "elsewhere": (("by",), {}),
}
ROW_HEADS = {"max_ratio": ("ppl",), "min_student": ("task", "niah"), "min_vs_teacher": ("task", "niah")}
ROW_SHAPES = "ppl/CORPUS/WINDOW, task/TASK/SHOTS, niah/FORM/LENGTH[/recall]"
HINTS = {  # the flags that leave a group's rows out of a run
    "ppl": "--rows, --corpora, --windows or a model's positions",
    "task": "--rows",
    "niah": "--rows, --needle-lengths or a model's positions",
}


@dataclass(frozen=True)
class Target:
    """One checked target: its name, kind and the kind's fields (thresholds, patterns)."""

    name: str
    kind: str
    fields: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ loading
def load_targets(path: str | Path) -> list[Target]:
    """The targets of a YAML file, each checked; one line (ConfigError) for anything malformed."""
    import yaml

    path = Path(path)
    fix = "see benchmarks/targets/quickstart.yaml for the layout (docs/evaluation.md, Targets)"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--targets {path} cannot be read ({exc.strerror or exc})", fix) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problem = f"not UTF-8: {exc.reason}" if isinstance(exc, UnicodeDecodeError) else _yaml_problem(exc)
        raise ConfigError(f"--targets {path} is not valid YAML ({problem})", fix) from None
    return parse_targets(data, str(path))


def parse_targets(data, where: str = "targets") -> list[Target]:
    """``data`` (a targets file's YAML) as checked targets: ``{"targets": [entry, ...]}``."""
    fix = "write a mapping with one key, targets: a list of {name, kind, ...} (docs/evaluation.md, Targets)"
    if not isinstance(data, dict) or set(data) != {"targets"}:
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{where} must hold one key, 'targets' (it has {keys})", fix)
    entries = data["targets"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: 'targets' must be a non-empty list", fix)
    targets = [_parse_entry(entry, f"{where}: target {i + 1}") for i, entry in enumerate(entries)]
    names = [t.name for t in targets]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{where}: target names {twice} appear more than once", "give each its own name")
    return targets


def _parse_entry(entry, where: str) -> Target:
    """One entry: a name, a known kind, exactly its fields, each of the right type."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is not a mapping", "write name: ..., kind: ..., and its thresholds")
    name, kind = entry.get("name"), entry.get("kind")
    if not isinstance(name, str) or not name.strip() or "\n" in name.strip():
        raise ConfigError(f"{where} has no name", "add name: a short text on one line saying what it holds")
    where = f"{where} ({name})"
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r}", f"use one of: {', '.join(KINDS)}")
    required, optional = KINDS[kind]
    given = {k: v for k, v in entry.items() if k not in ("name", "kind")}
    missing = [k for k in required if k not in given]
    unknown = sorted(map(str, set(given) - set(required) - set(optional)))
    if missing or unknown:
        problem = f"misses {missing}" if missing else f"has unknown keys {unknown}"
        raise ConfigError(f"{where}: a {kind} target {problem}", f"give it {', '.join(required)}")
    fields = {**optional, **given}
    for key, value in fields.items():
        _check_field(where, kind, key, value)
    return Target(name.strip(), kind, fields)


def _check_field(where: str, kind: str, key: str, value) -> None:
    if key in ("rows", "corpora", "by"):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: {key} {value!r} is not a text", f"write e.g. {key}: {_example(key)}")
        if key == "rows":
            check_row_pattern(value, kind, where)
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} {value!r} is not a number", f"write e.g. {key}: {_example(key)}")
    if key.endswith("_window") and (not isinstance(value, int) or value < 16):
        raise ConfigError(f"{where}: {key} {value!r} is not a window in tokens", f"write e.g. {key}: 2048")
    if key in ("margin", "max_rise") and value < 0:
        raise ConfigError(f"{where}: {key} {value!r} is negative", f"write e.g. {key}: {_example(key)}")


def _example(key: str) -> str:
    return {"rows": "ppl/*/2048", "corpora": "'*'", "by": "bench generate", "margin": "0.10"}.get(
        key, "1.18" if key == "max" else "0.05" if key == "max_rise" else "0.80"
    )


def check_row_pattern(pattern: str, kind: str, where: str = "target") -> None:
    """Refuse a ``rows`` pattern no row of ``kind``'s groups could match: its first segment must be
    one of the kind's groups (literally), and its wildcard-free segments must fit the ids' shape."""
    parts = pattern.split("/")
    heads = ROW_HEADS[kind]
    if parts[0] not in heads or not _fits(parts):
        raise ConfigError(
            f"{where}: rows {pattern!r} can match no row",
            f"row ids are {ROW_SHAPES}; a {kind} target reads {' or '.join(h + '/...' for h in heads)} rows",
        )


def _fits(parts: list[str]) -> bool:
    """Whether a pattern split at '/' fits its group's ids: a literal last segment fits the id's end
    (a number, or a needle's ``recall``), a pattern without wildcards has the id's count of segments,
    and a needle's literal segments before the first wildcard fit their places (form, length, recall).
    A wildcard may span slashes (``fnmatch``), so nothing after one is placed."""
    head, last = parts[0], parts[-1]
    wild = [any(c in p for c in "*?[") for p in parts]
    if not (wild[-1] or last.isdigit() or (head == "niah" and last == "recall")):
        return False
    if (
        not any(wild)
        and not {"ppl": len(parts) >= 3, "task": len(parts) == 3, "niah": len(parts) in (3, 4)}[head]
    ):
        return False
    if head == "niah":
        fixed = parts[1 : wild.index(True) if any(wild) else len(parts)]
        places = (SuiteSettings().niah_forms.__contains__, str.isdigit, "recall".__eq__)
        return len(fixed) <= len(places) and all(fits(p) for fits, p in zip(places, fixed, strict=False))
    return len(parts) >= 2


# ------------------------------------------------------------------------------------------------ checking
def check_targets(targets: list[Target], rows: list[dict], planned=()) -> list[dict]:
    """Each target against a suite's ``rows`` (suite.json's): its entry for suite.json's ``targets``
    (name, kind, thresholds, ``measured`` by row id, ``status``, one-line ``reason``). ``planned``:
    the row ids the run is to score (a row planned but not in ``rows`` yet is not measured)."""
    by_id = {r["id"]: r for r in rows}
    ids = list(dict.fromkeys([*planned, *by_id]))
    out = []
    for t in targets:
        if t.kind == "elsewhere":
            measured, status, reason = (
                {},
                "not measured",
                f"not measured: by {t.fields['by']}, not by the suite",
            )
        elif t.kind == "max_ratio_rise":
            measured, status, reason = _check_rise(t, by_id, ids)
        else:
            measured, status, reason = _check_rows(t, by_id, ids)
        out.append(
            {
                "name": t.name,
                "kind": t.kind,
                **t.fields,
                "measured": measured,
                "status": status,
                "reason": reason,
            }
        )
    return out


def _row_value(kind: str, row: dict | None):
    """What a row-kind target reads of a row (None where the row lacks it)."""
    if row is None:
        return None
    if kind == "max_ratio":
        return row.get("ratio")
    if kind == "min_student":
        return row.get("student")
    if row.get("teacher") is None or row.get("student") is None:
        return None
    return {"teacher": row["teacher"], "student": row["student"]}


def _slack(t: Target, value) -> tuple[float, str]:
    """How far a value is inside its threshold (< 0: outside) and the comparison, in words."""
    f = t.fields
    if t.kind == "max_ratio":
        ok = value <= f["max"] + TOLERANCE
        return f["max"] - value, f"ratio {value:.3f} {'≤' if ok else '>'} {f['max']}"
    if t.kind == "min_student":
        ok = value >= f["min"] - TOLERANCE
        return value - f["min"], f"student {_num(value)} {'≥' if ok else '<'} {_num(f['min'])}"
    s, floor = value["student"], value["teacher"] - f["margin"]
    ok = s >= floor - TOLERANCE
    return (
        s - floor,
        f"student {_num(s)} {'≥' if ok else '<'} teacher {_num(value['teacher'])} − {_num(f['margin'])}",
    )


def _check_rows(t: Target, by_id: dict, ids: list[str]) -> tuple[dict, str, str]:
    """max_ratio, min_student, min_vs_teacher: every row the pattern matches."""
    pattern = t.fields["rows"]
    matched = [rid for rid in ids if fnmatchcase(rid, pattern)]
    if not matched:
        hint = HINTS[pattern.split("/")[0]]
        return {}, "not measured", f"not measured: no row {pattern} in this run ({hint})"
    measured = {rid: v for rid in matched if (v := _row_value(t.kind, by_id.get(rid))) is not None}
    checks = [(rid, *_slack(t, v)) for rid, v in measured.items()]
    missing = [f"{rid} not scored" for rid in matched if rid not in measured]
    return measured, *_verdict(checks, missing, f"rows {pattern}")


def _check_rise(t: Target, by_id: dict, ids: list[str]) -> tuple[dict, str, str]:
    """max_ratio_rise: per corpus, the ratio at to_window against the ratio at from_window."""
    f = t.fields
    a, b = f["from_window"], f["to_window"]
    corpora = [
        c for c in dict.fromkeys(_ppl_corpus(rid) for rid in ids) if c and fnmatchcase(c, f["corpora"])
    ]
    pairs = {c: (f"ppl/{c}/{a}", f"ppl/{c}/{b}") for c in corpora}
    pairs = {c: p for c, p in pairs.items() if p[0] in ids or p[1] in ids}
    if not pairs:
        where = f"ppl/{f['corpora']}/{a} or ppl/{f['corpora']}/{b}"
        return {}, "not measured", f"not measured: no row {where} in this run ({HINTS['ppl']})"
    measured = {
        rid: r
        for p in pairs.values()
        for rid in p
        if (r := _row_value("max_ratio", by_id.get(rid))) is not None
    }
    checks, missing = [], []
    for c, (ra, rb) in pairs.items():
        if ra not in measured or rb not in measured:
            missing += [
                f"{rid} not scored" if rid in ids else f"no row {rid} in this run ({HINTS['ppl']})"
                for rid in (ra, rb)
                if rid not in measured
            ]
            continue
        rise = measured[rb] - measured[ra]
        sign = "≤" if rise <= f["max_rise"] + TOLERANCE else ">"
        words = f"ratio {measured[rb]:.3f} at {b} {sign} {measured[ra]:.3f} at {a} + {f['max_rise']}"
        checks.append((c, f["max_rise"] - rise, words))
    return measured, *_verdict(checks, missing, "corpora")


def _ppl_corpus(rid: str) -> str | None:
    """The corpus of a perplexity row id (``ppl/CORPUS/WINDOW``; a corpus may hold slashes)."""
    if not rid.startswith("ppl/"):
        return None
    corpus, _, window = rid[4:].rpartition("/")
    return corpus if corpus and window.isdigit() else None


def _verdict(checks: list[tuple[str, float, str]], missing: list[str], what: str) -> tuple[str, str]:
    """(status, reason) from (row or corpus, slack, words) checks and what was not measured (in words):
    missed where any check is outside, else not measured where anything is missing, else met."""
    failed = sorted((c for c in checks if c[1] < -TOLERANCE), key=lambda c: c[1])
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return "missed", f"{failed[0][0]} {failed[0][2]}{more}"
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return "not measured", f"not measured: {missing[0]}{more}"
    worst = min(checks, key=lambda c: c[1])
    return "met", f"all {len(checks)} {what} hold; closest {worst[0]}: {worst[2]}"


def _num(v: float) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_targets(entries: list[dict] | None) -> list[str]:
    """suite.md's Targets section: one line per target (status, name, reason)."""
    if not entries:
        return []
    counts = {s: sum(e["status"] == s for e in entries) for s in ("met", "missed", "not measured")}
    head = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [f"Targets ({head}):", ""]
    lines += [f"- **{e['status']}** — {e['name']}: {e['reason']}" for e in entries]
    return [*lines, ""]
