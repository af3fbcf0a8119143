"""Passkey retrieval (needle in a haystack) over context length × needle depth.

The classic passkey prompt (Mohtashami & Jaggi 2023, used by Mamba in the Llama for length
extrapolation): an instruction, filler sentences, "The pass key is 71432. Remember it. 71432 is
the pass key." at a chosen depth, more filler, then "What is the pass key? The pass key is". A
trial passes when the greedy continuation starts with the key's digits. Each (length, depth)
cell averages ``trials`` random keys; lengths are in tokens of the model's tokenizer, so a
student and its teacher see identical prompts.

Each trial also records **recall**, which separates memory from answer format: the answer
" KEY" is teacher-forced after the prompt, and the trial recalls the key when every answer token
that carries a digit is the model's argmax there. A model that retrieved the key but prefers to
answer "a secret code ..." fails the greedy test and passes recall (with SmolLM2's tokenizer the
answer's first token is a bare space, the format choice, and the five digits are checked).

**RULER's single-needle forms** (Hsieh et al. 2024, ``niah_single_1..3``; lm-eval's ``ruler`` task
needs hub data, so the prompts are built here the way its ``prepare_niah.py`` builds them):
"A special magic number is hidden within the following text. …", a haystack with one needle
"One of the special magic numbers for {key} is: {value}." at a chosen depth, the question "What
is the special magic number for {key} mentioned in the provided text?" and the answer prefix
"The special magic number for {key} mentioned in the provided text is". Keys are adjective-noun
words; values 7-digit numbers (``niah_single_1``: in the repeated filler "The grass is green. …",
one per line; ``niah_single_2``: in essay-like prose, sentence by sentence) or UUIDs
(``niah_single_3``: "magic uuid", in the prose). A trial is greedy: RULER's ``string_match_all``
(the value appears in the continuation, case-insensitive) on a continuation only a few tokens longer
than the value, so it is an exact match in all but name; recall is teacher-forced as for the passkey.
"""

from __future__ import annotations

import random
import re
import time
import uuid

import torch
from tqdm.auto import tqdm

INSTRUCTION = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def needle_text(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def build_prompt(tokenizer, length: int, depth: float, key: str) -> list[int]:
    """Token ids of a passkey prompt of (about) ``length`` tokens with the needle at ``depth`` ∈ [0, 1]
    of the filler. The filler is cut at a sentence boundary, so the total can be a few tokens short."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is outside [0, 1]")

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(n_filler: int) -> list[int]:
        before = round(n_filler * depth)
        return encode(
            INSTRUCTION + FILLER * before + needle_text(key) + FILLER * (n_filler - before) + QUESTION
        )

    # filler sentences tokenize differently when concatenated: estimate, then correct on the
    # real encoding until the prompt is the longest one that fits in ``length``
    per_filler = len(encode(FILLER * 8)) / 8
    n = max(0, int((length - len(prompt(0))) / per_filler))
    ids = prompt(n)
    for _ in range(64):
        step = int((length - len(ids)) / per_filler)
        if len(ids) > length:
            step = min(step, -1)
        elif step == 0:
            break
        n = max(0, n + step)
        ids = prompt(n)
        if n == 0:
            break
    return ids


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def passkey_trial(model, tokenizer, length: int, depth: float, key: str, max_new_tokens: int = 8) -> dict:
    ids = torch.tensor([build_prompt(tokenizer, length, depth, key)], device=_device(model))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    found = re.match(r"\s*(\d+)", answer)
    return {
        "prompt_tokens": ids.shape[1],
        "answer": answer,
        "correct": bool(found and found.group(1) == key),
        "recalled": key_recalled(model, tokenizer, ids[0].tolist(), key),
    }


@torch.no_grad()
def key_recalled(model, tokenizer, prompt_ids: list[int], key: str) -> bool:
    """Teacher-forced recall: with " KEY" appended to the prompt, is every answer token that
    carries a letter or digit of the key the model's argmax at its position? (Only those positions'
    logits are made; a bare-space token, the answer's form, is not checked.)"""
    answer = tokenizer(" " + key, add_special_tokens=False)["input_ids"]
    checked = [i for i, t in enumerate(answer) if any(c.isalnum() for c in tokenizer.decode([t]))]
    if not checked:
        raise ValueError(
            f"the tokenizer encodes the key {key!r} without letters or digits; recall needs a tokenizer that keeps them"
        )
    ids = torch.tensor([prompt_ids + answer], device=_device(model))
    # predictions of answer[0..n-1]
    logits = model(input_ids=ids, logits_to_keep=len(answer) + 1).logits[0, :-1]
    pred = logits.argmax(-1).tolist()
    return all(pred[i] == answer[i] for i in checked)


def passkey_grid(
    model,
    tokenizer,
    lengths,
    depths,
    trials: int = 3,
    seed: int = 0,
    progress: bool = True,
    desc: str = "passkey",
) -> dict:
    """Accuracy for every (length, depth) cell; keys are 5-digit numbers drawn from ``seed`` (the
    same keys for every model evaluated with the same seed)."""
    rng = random.Random(seed)
    keys = {(L, d, t): str(rng.randint(10000, 99999)) for L in lengths for d in depths for t in range(trials)}
    acc, recall = [], []
    bar = tqdm(total=len(keys), desc=desc, disable=not progress, leave=False)
    examples = []
    for L in lengths:
        row, recall_row = [], []
        for d in depths:
            hits = recalled = 0
            for t in range(trials):
                r = passkey_trial(model, tokenizer, L, d, keys[(L, d, t)])
                hits += r["correct"]
                recalled += r["recalled"]
                if t == 0:
                    examples.append({"length": L, "depth": d, "key": keys[(L, d, t)], **r})
                bar.update(1)
            row.append(hits / trials)
            recall_row.append(recalled / trials)
        acc.append(row)
        recall.append(recall_row)
    bar.close()
    cells = len(lengths) * len(depths)
    return {
        "lengths": list(lengths),
        "depths": list(depths),
        "trials": trials,
        "seed": seed,
        "accuracy": acc,
        "mean_accuracy": sum(map(sum, acc)) / cells,
        "recall": recall,
        "mean_recall": sum(map(sum, recall)) / cells,
        "examples": examples,
    }


# ------------------------------------------------------------------------------ RULER niah_single
NIAH_FORMS = ("niah_single_1", "niah_single_2", "niah_single_3")
NIAH_TEMPLATE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n"
    "{context}\nWhat is the special magic {kind} for {key} mentioned in the provided text?"
)
NIAH_NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
NIAH_ANSWER_PREFIX = "The special magic {kind} for {key} mentioned in the provided text is"
NIAH_EXTRA_TOKENS = 4  # greedy tokens beyond the value's own
NIAH_REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# RULER draws keys from wonderwords' adjective-noun pairs; a fixed list keeps the prompts reproducible offline
_ADJECTIVES = (
    "ancient",
    "bitter",
    "calm",
    "curious",
    "dusty",
    "eager",
    "fancy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "lazy",
    "mighty",
    "nervous",
    "odd",
    "quiet",
    "rapid",
    "shiny",
    "tame",
    "upbeat",
    "vivid",
    "wary",
    "young",
    "zesty",
)
_NOUNS = (
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pebble",
    "quarry",
    "river",
    "saddle",
    "teapot",
    "umbrella",
    "violin",
    "walnut",
    "yacht",
)


def niah_form(form: str) -> tuple[str, str]:
    """(haystack kind, value kind) of a RULER single-needle form."""
    forms = {
        "niah_single_1": ("repeat", "number"),
        "niah_single_2": ("essay", "number"),
        "niah_single_3": ("essay", "uuid"),
    }
    if form not in forms:
        raise ValueError(f"unknown needle form {form!r}; choose from {', '.join(forms)}")
    return forms[form]


def niah_key_value(form: str, rng: random.Random) -> tuple[str, str]:
    """A RULER key (adjective-noun) and value (7-digit number, or a version-4 UUID) drawn from ``rng``."""
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = (
        str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if niah_form(form)[1] == "uuid"
        else str(rng.randint(10**6, 10**7 - 1))
    )
    return key, value


def essay_sentences(text: str) -> list[str]:
    """Prose cut into sentences (after . ! or ? and white space), white space runs made single spaces."""
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


def niah_text(form: str, key: str, value: str, n: int, depth: float, essay: list[str] | None = None) -> str:
    """The prompt of ``n`` haystack units (filler repeats, or essay sentences) with the needle after
    ``round(n * depth)`` of them, ending in RULER's answer prefix."""
    haystack, kind = niah_form(form)
    needle = NIAH_NEEDLE.format(kind=kind, key=key, value=value)
    if haystack == "repeat":
        units = [NIAH_REPEAT] * n
    else:
        if not essay:
            raise ValueError(f"{form} needs essay sentences for its haystack")
        units = [essay[i % len(essay)] for i in range(n)]
    at = round(n * depth)
    context = ("\n" if haystack == "repeat" else " ").join([*units[:at], needle, *units[at:]])
    question = NIAH_TEMPLATE.format(kind=kind, context=context, key=key)
    return question + " " + NIAH_ANSWER_PREFIX.format(kind=kind, key=key)


def niah_prompt(
    tokenizer, form: str, length: int, depth: float, key: str, value: str, essay: list[str] | None = None
) -> list[int]:
    """Token ids of the longest prompt of ``form`` that fits in ``length`` tokens (its haystack grown
    unit by unit: a bisection over the number of units), the needle at ``depth`` ∈ [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is outside [0, 1]")

    def encode(n: int) -> list[int]:
        return tokenizer(niah_text(form, key, value, n, depth, essay), add_special_tokens=False)["input_ids"]

    lo, hi = 0, 1
    if len(encode(0)) > length:
        raise ValueError(
            f"a {form} prompt needs more than {length} tokens without any haystack; use a longer length"
        )
    while len(encode(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # encode(lo) fits, encode(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(encode(mid)) <= length else (lo, mid)
    return encode(lo)


@torch.no_grad()
def niah_trial(
    model, tokenizer, prompt_ids: list[int], value: str, extra_tokens: int = NIAH_EXTRA_TOKENS
) -> dict:
    """Greedy continuation of ``extra_tokens`` more tokens than " VALUE" has; correct when the value
    appears in it (RULER's string match); recall teacher-forced (skipped, as true, when the greedy
    tokens begin with the answer's: the argmax already was the answer at every position)."""
    answer = tokenizer(" " + value, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids], device=_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=len(answer) + extra_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    new = out[0, ids.shape[1] :].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    recalled = new[: len(answer)] == answer or key_recalled(model, tokenizer, prompt_ids, value)
    return {
        "prompt_tokens": len(prompt_ids),
        "answer": text,
        "correct": value.lower() in text.lower(),
        "recalled": bool(recalled),
    }


def niah_depths(trials: int) -> list[float]:
    """Needle depths of a length's trials, evenly spread over [0, 1] (RULER samples them from 40 even steps)."""
    return [0.5] if trials == 1 else [t / (trials - 1) for t in range(trials)]


def niah_grid(
    model,
    tokenizer,
    form: str,
    lengths,
    trials: int = 20,
    seed: int = 0,
    essay: list[str] | None = None,
    progress: bool = True,
    desc: str = "niah",
) -> dict:
    """Greedy accuracy and recall of ``form`` at each length over ``trials`` keys (depths evenly
    spread); keys, values and depths depend only on (form, length, seed), so every model evaluated
    with the same seed sees the same prompts; prompt + answer fit in the length. Per length also n
    and the CPU seconds it cost."""
    niah_form(form)
    if trials < 1:
        raise ValueError(f"trials {trials} must be at least 1")
    out = {
        "form": form,
        "lengths": list(lengths),
        "trials": trials,
        "seed": seed,
        "accuracy": {},
        "recall": {},
        "n": {},
        "cpu_seconds": {},
        "examples": [],
    }
    bar = tqdm(total=len(lengths) * trials, desc=desc, disable=not progress, leave=False)
    for length in lengths:
        rng = random.Random(f"{form}/{length}/{seed}")
        cpu, hits, recalled = time.process_time(), 0, 0
        for t, depth in enumerate(niah_depths(trials)):
            key, value = niah_key_value(form, rng)
            # prompt + answer fit in length
            room = len(tokenizer(" " + value, add_special_tokens=False)["input_ids"]) + NIAH_EXTRA_TOKENS
            ids = niah_prompt(tokenizer, form, length - room, depth, key, value, essay)
            r = niah_trial(model, tokenizer, ids, value, NIAH_EXTRA_TOKENS)
            hits += r["correct"]
            recalled += r["recalled"]
            if t == 0:
                out["examples"].append({"length": length, "depth": depth, "key": key, "value": value, **r})
            bar.update(1)
        out["accuracy"][str(length)] = hits / trials
        out["recall"][str(length)] = recalled / trials
        out["n"][str(length)] = trials
        out["cpu_seconds"][str(length)] = time.process_time() - cpu
    bar.close()
    return out


def plot_passkey(results: dict[str, dict], path, title: str = "") -> None:
    """One heat-map per model (rows: context length, columns: needle depth)."""
    import matplotlib  # heavy: matplotlib, and the Agg backend is chosen only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: as above, once the backend is set

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        im = ax.imshow(r["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(r["depths"])), [f"{d:.0%}" for d in r["depths"]])
        ax.set_yticks(range(len(r["lengths"])), [str(L) for L in r["lengths"]])
        for i, row in enumerate(r["accuracy"]):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context (tokens)")
        ax.set_title(f"{name}: mean {r['mean_accuracy']:.0%}", fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="passkey accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
