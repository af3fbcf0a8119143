"""Choose the KV groups a head-level hybrid keeps: a synthetic retrieval probe on the teacher.

"Retrieval-Aware Distillation" (Bick, Xing, Gu, ICML 2026) keeps the few attention heads that
retrieval depends on, found by a synthetic key-value probe of the teacher (its code:
``KVRetrieval``, word → number pairs). Here the probe is one teacher forward per example, no
training:

* an example is a ledger of ``pairs`` lines "{city} -> {4-digit number}", then ``queries`` of the
  cities again, each followed by its number (teacher-forced). Cities and 4-digit numbers share no
  item with the suite's needles (adjective-noun keys, 5- and 7-digit numbers and UUIDs,
  eval/needle.py) nor with the ``recall:`` training passages (data/recall.py; a test holds the
  word lists disjoint), and the draws come from this module's own stream;
* a head's **copy score** is the attention mass it puts, at the position that predicts an answer
  token, on that token's occurrence in the ledger — the token it is about to copy — averaged over
  every answer token with a letter or digit, over all examples. It is the teacher's own eager
  softmax (adapters' ``attention_probs`` on the captured layer inputs);
* a **KV group**'s score is the largest of its query heads' scores (keeping the group keeps every
  query head that reads it, so its best head is what it buys).

``kv_group_budget`` turns a fraction of the teacher's KV cache into a number of groups (every
group of a global layer holds the same cache, so the fraction is a count); ``choose_kept_heads``
takes the best groups under it. The scores travel with the student (``PROBE_KEY`` in its config:
saved and reloaded with it, remote code included).
"""

from __future__ import annotations

import math
import random

import torch

from attn2ssm.adapters.capture import capture_attention_io
from attn2ssm.adapters.registry import get_adapter
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.kept_heads import head_level_plan, list_kept, parse_kept_heads

PROBE_KEY = "retrieval_probe"  # the student config attribute that keeps the probe's scores
FORMAT = 1  # bump when an example's text changes

# Keys: cities, none of them a word of the needles' or the recall passages' lists.
CITIES = (
    "Oslo", "Lima", "Cairo", "Quito", "Dakar", "Perth", "Osaka", "Porto", "Riga", "Sofia",
    "Tunis", "Hanoi", "Kyoto", "Bern", "Dublin", "Minsk", "Nairobi", "Lagos", "Seoul", "Vienna",
    "Athens", "Madrid", "Lisbon", "Prague", "Warsaw", "Havana", "Manila", "Denver", "Austin", "Boston",
    "Miami", "Tokyo", "Delhi", "Paris", "Rome", "Berlin", "Zurich", "Geneva", "Milan", "Naples",
)  # fmt: skip
HEADER = "Ticket counter ledger.\n"
RECALL = "Again:\n"


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def probe_example(tokenizer, rng: random.Random, pairs: int = 16, queries: int = 4):
    """(ids, [(query position, source position)]): one ledger of ``pairs`` lines then ``queries``
    teacher-forced lookups; each answer token (with a letter or digit) is predicted at the query
    position and copied from the source position."""
    if not 1 <= queries <= pairs <= len(CITIES):
        raise ConfigError(
            f"probe pairs={pairs}, queries={queries} are out of range",
            f"use 1 <= queries <= pairs <= {len(CITIES)}",
        )
    cities = rng.sample(CITIES, pairs)
    values = [str(rng.randrange(1000, 10000)) for _ in cities]
    ids, value_at = _encode(tokenizer, HEADER), {}
    arrow, newline = _encode(tokenizer, " ->"), _encode(tokenizer, "\n")
    for city, value in zip(cities, values):
        ids += _encode(tokenizer, city) + arrow
        value_at[city] = len(ids)
        ids += _encode(tokenizer, f" {value}") + newline
    ids += _encode(tokenizer, RECALL)
    copies = []
    for j in rng.sample(range(pairs), queries):
        ids += _encode(tokenizer, cities[j]) + arrow
        answer = _encode(tokenizer, f" {values[j]}")
        for n, token in enumerate(answer):
            if any(c.isalnum() for c in tokenizer.decode([token])):
                copies.append((len(ids) + n - 1, value_at[cities[j]] + n))
        ids += answer + newline
    return ids, copies


@torch.no_grad()
def copy_scores(teacher, examples) -> list[list[float]]:
    """Per layer, per query head: the mean attention mass on the copied token (module docstring).
    ``examples``: (ids, copies) pairs as ``probe_example`` makes them."""
    adapter = get_adapter(teacher)
    layers = list(range(len(adapter.attention_module_paths(teacher))))
    device = next(teacher.parameters()).device
    limit = getattr(teacher.config, "max_position_embeddings", None)
    total, count = None, 0
    for ids, copies in examples:
        if limit is not None and len(ids) > limit:
            raise ConfigError(
                f"a retrieval probe example of {len(ids)} tokens exceeds the teacher's {limit} positions",
                "lower student.keep_heads.probe_pairs",
            )
        if not copies:
            continue
        io = capture_attention_io(teacher, torch.tensor([ids], device=device), layers)
        q = torch.tensor([c[0] for c in copies], device=device)
        s = torch.tensor([c[1] for c in copies], device=device)
        rows = []
        for i in layers:
            probs = layer_probs(adapter, io[i])[0]  # (h, l, l)
            rows.append(probs[:, q, s].sum(-1).float().cpu())  # (h,)
        mass = torch.stack(rows)  # (layers, h)
        total = mass if total is None else total + mass
        count += len(copies)
    if total is None:
        raise ConfigError("the retrieval probe found no answer token to score", "use more probe examples")
    return (total / count).tolist()


def layer_probs(adapter, io) -> torch.Tensor:
    """The teacher's attention probabilities (b, h, l, l) at one captured layer."""
    return adapter.attention_probs(io.module, io.hidden_states, io.position_embeddings)


def group_scores(head_scores: list[list[float]], num_kv_heads: list[int]) -> list[list[float]]:
    """Per layer, per KV group: the best of its query heads' scores."""
    out = []
    for heads, kv in zip(head_scores, num_kv_heads):
        per = len(heads) // kv
        out.append([max(heads[g * per : (g + 1) * per]) for g in range(kv)])
    return out


def kv_group_budget(fraction: float, total_groups: int) -> int:
    """The most KV groups that stay within ``fraction`` of the teacher's KV cache: ⌊fraction · groups⌋
    (5 % of SmolLM2-135M's 90 groups → 4). A ConfigError outside [0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"kv_budget={fraction!r} is not a fraction in [0, 1]", "use e.g. kv_budget: 0.05")
    return math.floor(fraction * total_groups + 1e-9)


def choose_kept_heads(
    scores: list[list[float]], count: int, eligible: list[int] | None = None
) -> dict[int, list[int]]:
    """The ``count`` best groups (ties → lower layer, lower group) among ``eligible`` layers, as
    ``{layer: sorted groups}``."""
    layers = range(len(scores)) if eligible is None else eligible
    ranked = sorted(((-scores[i][g], i, g) for i in layers for g in range(len(scores[i]))))
    kept: dict[int, list[int]] = {}
    for _, i, g in ranked[:count]:
        kept.setdefault(i, []).append(g)
    return {i: sorted(gs) for i, gs in sorted(kept.items())}


def eligible_layers(teacher) -> list[int]:
    """Layers whose attention a kept group can reproduce: global, without soft-capping."""
    adapter = get_adapter(teacher)
    n = len(adapter.attention_module_paths(teacher))
    out = []
    for i in range(n):
        g = adapter.geometry(teacher.config, i)
        if g.sliding_window is None and g.softcap is None:
            out.append(i)
    return out


def run_probe(
    teacher,
    tokenizer,
    kv_budget: float,
    examples: int = 8,
    *,
    pairs: int = 16,
    queries: int = 4,
    seed: int = 0,
    plan: list[str] | None = None,
) -> dict:
    """Score the teacher's KV groups and choose those a ``kv_budget`` allows. Returns the record
    the student keeps (``PROBE_KEY``): scores per layer and group (and per head), the budget, the
    count, the kept groups ``{"layer": [groups]}`` and the probe's settings. ``plan``: only its
    ``linear_attention`` layers may keep groups (default: every eligible layer)."""
    if examples < 1:
        raise ConfigError(f"probe_examples={examples} is not a positive number", "use e.g. probe_examples: 8")
    adapter = get_adapter(teacher)
    kv = [
        adapter.geometry(teacher.config, i).num_kv_heads
        for i in range(len(adapter.attention_module_paths(teacher)))
    ]
    count = kv_group_budget(kv_budget, sum(kv))
    rng = random.Random(f"attn2ssm-retrieval-probe:{FORMAT}:{seed}")
    heads = copy_scores(teacher, [probe_example(tokenizer, rng, pairs, queries) for _ in range(examples)])
    groups = group_scores(heads, kv)
    eligible = eligible_layers(teacher)
    if plan is not None:
        eligible = [i for i in eligible if plan[i] == "linear_attention"]
    kept = choose_kept_heads(groups, count, eligible)
    return {
        "metric": "copy attention mass (max over a group's query heads)",
        "kv_budget": float(kv_budget),
        "kv_groups_total": sum(kv),
        "kv_groups_kept": sum(len(g) for g in kept.values()),
        "kept": {str(i): g for i, g in kept.items()},
        "group_scores": [[round(x, 6) for x in row] for row in groups],
        "head_scores": [[round(x, 6) for x in row] for row in heads],
        "examples": examples,
        "pairs": pairs,
        "queries": queries,
        "seed": seed,
        "format": FORMAT,
    }


def head_level_plan_for(teacher, tokenizer, plan: list[str], options: dict, keep_heads, seed: int = 0):
    """(layer plan, mixer options by kind, probe record) of a head-level hybrid: ``keep_heads``
    (a ``KeepHeadsConfig``) lists its groups or has the probe choose them under its budget among
    ``plan``'s linear_attention layers. The record is what the student keeps (``keep_probe_record``)."""
    if keep_heads.groups is not None:
        kept = parse_kept_heads(keep_heads.groups, len(plan))
        record = {
            "kept": {str(i): g for i, g in kept.items()},
            "kv_groups_kept": sum(map(len, kept.values())),
        }
        record["source"] = "listed (student.keep_heads.groups)"
    else:
        record = run_probe(
            teacher,
            tokenizer,
            keep_heads.kv_budget,
            keep_heads.probe_examples,
            pairs=keep_heads.probe_pairs,
            queries=keep_heads.probe_queries,
            seed=seed,
            plan=plan,
        )
        kept = parse_kept_heads(record["kept"])
    new_plan, by_kind = head_level_plan(plan, options, kept)
    return new_plan, by_kind, record


def keep_probe_record(student, record: dict) -> None:
    """Keep the probe's record in the student's config (saved and reloaded with it)."""
    setattr(student.config, PROBE_KEY, record)


def describe_kept(record: dict) -> str:
    """One line: which groups are kept and how many of the teacher's."""
    kept = list_kept(record["kept"]) or "none"
    total = record.get("kv_groups_total")
    of = f" of {total}" if total else ""
    return f"kept KV groups ({record['kv_groups_kept']}{of}): {kept}"
