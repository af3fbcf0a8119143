"""Text sampled from the teacher: chat pseudo-labels for SFT, and plain text as a training corpus.

Mamba in the Llama distils on the teacher's own replies to seed prompts (SeqKD). Offline, the seed
prompts come from a corpus: ``data.source: teacher:<corpus>[:<n>]`` (e.g. ``teacher:sotu:128``)
takes ``n`` passages from the corpus' *training* documents, wraps each in an instruction
("Summarize …", "What is the main argument …", …), lets the teacher answer through its chat
template and writes ``{"messages": [user, assistant]}`` records to a JSONL file in the cache.
The file is keyed by teacher, corpus, count and generation settings, written atomically, and
reused by later runs (and by ``--resume``), so the teacher samples once.

``data.corpus`` / ``data.sources`` may also name ``generated:<n_tokens>[:<prompt corpus>]``
(options in :mod:`.sources`): :func:`generate_corpus` samples ``n_tokens`` tokens of plain text with
the teacher's own ``generate`` (temperature / top-p sampling, ``batch`` samples per call, on the
teacher's device), from BOS or from short windows cut from the prompt corpus' training text. The
sampling is seeded per batch from the recipe's seed (the global RNG is left as it was), so the same
spec, seed, teacher and kind of device give the same tokens; they are cached as token ids
(``cache_dir()/generated/``, the tokenized-corpus format) keyed by teacher, tokenizer, seed and
settings, written atomically. Each sample is a document: samples are joined by EOS like any corpus,
and the held-out split is the hash rule on the sample's id (:mod:`.splits`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attn2ssm.errors import ConfigError, DataError
from attn2ssm.paths import atomic_write_text, cache_dir

from .packing import (
    TokenizedCorpus,
    _Joiner,
    load_tokenized,
    prepare_corpus,
    save_tokenized,
    tokenizer_fingerprint,
)
from .sources import can_stream, corpus_stamp, load_documents, parse_generated_spec
from .splits import is_heldout_id, split_documents

GENERATED_FORMAT = 1
_PROMPT_CORPUS_STREAM_TOKENS = 1 << 20  # a hub prompt corpus is streamed up to this many tokens

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
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    records = []
    try:
        with _sampling(teacher) as device:
            for start in tqdm(range(0, n, batch_size), desc=f"teacher replies ({corpus})", disable=not progress):
                chunk = prompts[start : start + batch_size]
                texts = [render(p) for p in chunk]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = teacher.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=_pad_id(tokenizer))
                for prompt, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                    reply = tokenizer.decode(row, skip_special_tokens=True).strip()
                    if reply:
                        records.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]})
    finally:
        tokenizer.padding_side = side
    if not records:
        raise ConfigError(f"the teacher gave no non-empty reply to {n} prompts from {corpus!r}", "check the teacher's chat template, or give a chat dataset")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------ shared sampling helpers


@contextlib.contextmanager
def _sampling(teacher):
    """The teacher in eval mode without gradients for the block; yields its device."""
    was_training = teacher.training
    teacher.eval()
    try:
        with torch.no_grad():
            yield next(teacher.parameters()).device
    finally:
        teacher.train(was_training)


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _cuda_index(device: torch.device) -> list[int]:
    """The CUDA device whose random state sampling must leave as it was (none on CPU)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _stream_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (SHA-256, so neighbouring batches get unrelated streams)."""
    digest = hashlib.sha256(":".join(map(str, ("attn2ssm-generated", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ------------------------------------------------------------------------ generated corpora


def generate_corpus(spec: str, teacher, tokenizer, *, seed: int = 0, progress: bool = True) -> TokenizedCorpus:
    """The ``generated:`` corpus ``spec`` names (see :mod:`.sources`): sampled once, then read from the cache.

    ``train_ids`` and ``heldout_ids`` hold ``n_tokens`` tokens together; ``meta["from_cache"]`` tells
    whether the cache answered. Raises :class:`DataError` for a bad spec or a tokenizer without EOS.
    """
    g = parse_generated_spec(spec)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no EOS token to end generated samples", "set tokenizer.eos_token before sampling")
    start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    prompt_len = g.prompt_len if g.prompts else 1
    context = getattr(teacher.config, "max_position_embeddings", None) or 4096
    length = min(g.length, context - prompt_len)
    if length < 1:
        raise DataError(f"{spec!r}: prompts of {prompt_len} tokens leave no room in the teacher's {context} positions", "lower prompt_len")
    fingerprint = tokenizer_fingerprint(tokenizer)
    key_fields = {
        "format": GENERATED_FORMAT, "teacher": _teacher_key(teacher, tokenizer), "tokenizer": fingerprint, "seed": seed,
        "n_tokens": g.n_tokens, "prompts": g.prompts, "prompts_stamp": corpus_stamp(g.prompts) if g.prompts else None,
        "field": g.field, "prompt_len": prompt_len, "start": start_id, "length": length, "temperature": g.temperature,
        "top_p": g.top_p, "batch": g.batch,
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / "generated" / f"{key}.pt"
    if path.is_file():
        try:
            corpus = load_tokenized(path, tokenizer)
        except DataError:
            pass  # unreadable: sample again
        else:
            corpus.meta.update(from_cache=True, cache_path=str(path))
            return corpus

    prompt_ids = _prompt_source(g, tokenizer) if g.prompts else None
    train, held = _Joiner(eos, None, "train"), _Joiner(eos, None, "held-out")
    n_samples = 0
    with _sampling(teacher) as device, torch.random.fork_rng(devices=_cuda_index(device)), \
            tqdm(total=g.n_tokens, desc=f"sampling {spec}", unit="tok", disable=not progress) as bar:  # fmt: skip
        batch_i = 0
        while train.total + held.total < g.n_tokens:
            if prompt_ids is None:
                inputs = torch.full((g.batch, 1), start_id, dtype=torch.long)
            else:
                gen = torch.Generator().manual_seed(_stream_seed(seed, "prompts", batch_i))
                offsets = torch.randint(0, prompt_ids.numel() - prompt_len + 1, (g.batch,), generator=gen)
                inputs = torch.stack([prompt_ids[o : o + prompt_len] for o in offsets.tolist()])
            torch.manual_seed(_stream_seed(seed, "sample", batch_i))
            out = teacher.generate(input_ids=inputs.to(device), attention_mask=torch.ones_like(inputs, device=device), do_sample=True,
                                   temperature=g.temperature, top_p=g.top_p, top_k=0, max_new_tokens=length, min_new_tokens=1,
                                   eos_token_id=eos, pad_token_id=_pad_id(tokenizer)).cpu()  # fmt: skip
            for row in out:
                if train.total + held.total >= g.n_tokens:
                    break
                new = row[prompt_len if prompt_ids is not None else 1 :]
                ends = (new == eos).nonzero()
                new = new[: int(ends[0])] if len(ends) else new  # a sample ends at the teacher's EOS (padding after it)
                sample = new if prompt_ids is None else torch.cat([row[:prompt_len], new])  # BOS is not text; a prompt is
                side = held if is_heldout_id(f"generated:{n_samples}") else train
                room = g.n_tokens - train.total - held.total - bool(side.pieces)  # the EOS joining it to its side counts
                side.add(sample[:room].tolist())
                n_samples += 1
                bar.update(train.total + held.total - bar.n)
            batch_i += 1
    meta = {"spec": spec, "generated": True, "n_samples": n_samples, "n_train_docs": train.docs, "n_heldout_docs": held.docs,
            "n_train_tokens": train.total, "n_heldout_tokens": held.total, "settings": key_fields}  # fmt: skip
    corpus = TokenizedCorpus(train.ids(), held.ids(), fingerprint, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tokenized(corpus, path)
    corpus.meta.update(from_cache=False, cache_path=str(path))
    return corpus


def _prompt_source(g, tokenizer) -> torch.Tensor:
    """The prompt corpus' training tokens (never its held-out text), tokenized through the corpus cache."""
    limit = _PROMPT_CORPUS_STREAM_TOKENS if can_stream(g.prompts) else None
    ids = prepare_corpus(g.prompts, tokenizer, max_train_tokens=limit, max_heldout_tokens=0, text_field=g.field).train_ids
    if ids.numel() < g.prompt_len:
        raise DataError(f"prompt corpus {g.prompts!r} has {ids.numel()} training tokens, fewer than prompt_len={g.prompt_len}", "lower prompt_len or use a larger corpus")
    return ids
