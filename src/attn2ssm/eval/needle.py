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
"""

from __future__ import annotations

import random
import re

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
        return encode(INSTRUCTION + FILLER * before + needle_text(key) + FILLER * (n_filler - before) + QUESTION)

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
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)  # fmt: skip
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    found = re.match(r"\s*(\d+)", answer)
    return {"prompt_tokens": ids.shape[1], "answer": answer, "correct": bool(found and found.group(1) == key),
            "recalled": key_recalled(model, tokenizer, ids[0].tolist(), key)}  # fmt: skip


@torch.no_grad()
def key_recalled(model, tokenizer, prompt_ids: list[int], key: str) -> bool:
    """Teacher-forced recall: with " KEY" appended to the prompt, is every answer token that
    carries a digit the model's argmax at its position? (Only those positions' logits are made.)"""
    answer = tokenizer(" " + key, add_special_tokens=False)["input_ids"]
    checked = [i for i, t in enumerate(answer) if any(c.isdigit() for c in tokenizer.decode([t]))]
    if not checked:
        raise ValueError(f"the tokenizer encodes the key {key!r} without digits; passkey recall needs a tokenizer that keeps digits")
    ids = torch.tensor([prompt_ids + answer], device=_device(model))
    logits = model(input_ids=ids, logits_to_keep=len(answer) + 1).logits[0, :-1]  # predictions of answer[0..n-1]
    pred = logits.argmax(-1).tolist()
    return all(pred[i] == answer[i] for i in checked)


def passkey_grid(model, tokenizer, lengths, depths, trials: int = 3, seed: int = 0, progress: bool = True, desc: str = "passkey") -> dict:
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
    return {"lengths": list(lengths), "depths": list(depths), "trials": trials, "seed": seed, "accuracy": acc,
            "mean_accuracy": sum(map(sum, acc)) / cells, "recall": recall, "mean_recall": sum(map(sum, recall)) / cells,
            "examples": examples}  # fmt: skip


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
