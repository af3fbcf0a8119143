"""Chat data sampled from the teacher: sequence-level pseudo-labels without a hub dataset.

Paper 004 distils on the teacher's own replies to seed prompts (SeqKD). Offline, the seed
prompts come from a corpus: ``data.source: teacher:<corpus>[:<n>]`` (e.g. ``teacher:sotu:128``)
takes ``n`` passages from the corpus' *training* documents, wraps each in an instruction
("Summarize …", "What is the main argument …", …), lets the teacher answer through its chat
template and writes ``{"messages": [user, assistant]}`` records to a JSONL file in the cache.
The file is keyed by teacher, corpus, count and generation settings, written atomically, and
reused by later runs (and by ``--resume``), so the teacher samples once.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attn2ssm.errors import ConfigError
from attn2ssm.paths import atomic_write_text, cache_dir

from .sources import load_documents
from .splits import split_documents

PREFIX = "teacher:"
DEFAULT_EXAMPLES = 128
INSTRUCTIONS = (
    "Summarize the following passage in two sentences.\n\n{text}",
    "What is the main argument of this passage?\n\n{text}",
    "Continue this speech for a few sentences, in the same style.\n\n{text}",
    "List the key points made in this passage.\n\n{text}",
)


def is_teacher_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_teacher_source(source: str) -> tuple[str, int]:
    """``teacher:<corpus>[:<n>]`` → (corpus, n). The corpus is any corpus spec (built-in name, path)."""
    rest = source[len(PREFIX):]
    corpus, _, n = rest.rpartition(":") if rest.rpartition(":")[2].isdigit() else (rest, "", "")
    if not corpus:
        raise ConfigError(f"data.source {source!r} names no corpus", "use teacher:<corpus>[:<examples>], e.g. teacher:sotu:128")
    count = int(n) if n else DEFAULT_EXAMPLES
    if count < 1:
        raise ConfigError(f"data.source {source!r} asks for {count} examples", "ask for at least one, e.g. teacher:sotu:128")
    return corpus, count


def seed_passages(corpus: str, n: int, *, words: int = 80, seed: int = 0) -> list[str]:
    """``n`` passages of about ``words`` words from the corpus' training documents (never held-out ones)."""
    train, _ = split_documents(load_documents(corpus), corpus)
    paragraphs = [p.strip() for doc in train for p in doc.text.split("\n\n") if len(p.split()) >= 20]
    if not paragraphs:
        raise ConfigError(f"corpus {corpus!r} has no paragraph of 20+ words to prompt with", "use a corpus of prose, e.g. teacher:sotu")
    rng = random.Random(seed)
    picks = [rng.choice(paragraphs) for _ in range(n)]
    return [" ".join(p.split()[:words]) for p in picks]


def _teacher_key(teacher, tokenizer) -> str:
    """Identifies the teacher's weights and template cheaply (name, size and a weight checksum)."""
    params = list(teacher.parameters())
    checksum = float(sum(p.detach().double().sum().item() for p in params[:4]))
    parts = [str(getattr(teacher.config, "_name_or_path", "")), str(sum(p.numel() for p in params)), f"{checksum:.6e}",
             str(getattr(tokenizer, "chat_template", ""))]  # fmt: skip
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def build_teacher_sft_data(source: str, teacher, tokenizer, *, max_new_tokens: int = 96, seed: int = 0, batch_size: int = 8,
                           progress: bool = True) -> Path:  # fmt: skip
    """The JSONL file of teacher replies for ``source`` (generated once, then read from the cache)."""
    corpus, n = parse_teacher_source(source)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the teacher's tokenizer has no chat template to prompt it with", "use a chat/instruct teacher, or give data.source a chat dataset")
    key = hashlib.sha256(f"{_teacher_key(teacher, tokenizer)}|{corpus}|{n}|{max_new_tokens}|{seed}|v1".encode()).hexdigest()[:16]
    path = cache_dir() / "teacher_samples" / f"{Path(corpus).name}-{n}-{key}.jsonl"
    if path.exists():
        return path
    # prompt + reply must fit the teacher's context: replies get at most half of it
    context = getattr(teacher.config, "max_position_embeddings", None) or 4096
    max_new_tokens = min(max_new_tokens, context // 2)
    render = lambda p: tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)  # noqa: E731
    prompts = []
    for i, passage in enumerate(seed_passages(corpus, n, seed=seed)):
        words = passage.split()
        while True:  # shorten the passage until the rendered prompt fits
            prompt = INSTRUCTIONS[i % len(INSTRUCTIONS)].format(text=" ".join(words))
            if len(tokenizer(render(prompt), add_special_tokens=False)["input_ids"]) + max_new_tokens <= context or len(words) <= 4:
                break
            words = words[: len(words) * 3 // 4]
        prompts.append(prompt)
    device = next(teacher.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = teacher.training
    teacher.eval()
    records = []
    try:
        for start in tqdm(range(0, n, batch_size), desc=f"teacher replies ({corpus})", disable=not progress):
            chunk = prompts[start : start + batch_size]
            texts = [render(p) for p in chunk]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = teacher.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
            for prompt, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                reply = tokenizer.decode(row, skip_special_tokens=True).strip()
                if reply:
                    records.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]})
    finally:
        tokenizer.padding_side = side
        teacher.train(was_training)
    if not records:
        raise ConfigError(f"the teacher gave no non-empty reply to {n} prompts from {corpus!r}", "check the teacher's chat template, or give a chat dataset")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path
