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
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attn2ssm.errors import ConfigError, DataError
from attn2ssm.paths import atomic_write_text, cache_dir

from .packing import load_tokenized, prepare_corpus, save_tokenized
from .sources import corpus_stamp, load_documents
from .specs import can_stream, parse_generated_spec
from .splits import is_heldout_id, split_documents
from .tokenize import Joiner, TokenizedCorpus, tokenizer_fingerprint

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


# The chat corpus' instructions (``chat:<corpus>[:<n>]``): varied tasks over a training passage, none
# of them an evaluation task's prompt (no multiple choice, no trivia, no needle).
CHAT_INSTRUCTIONS = (
    "Summarize the following passage in two sentences.\n\n{text}",
    "What is the main argument of this passage?\n\n{text}",
    "List the key points made in this passage.\n\n{text}",
    "Explain this passage to a twelve-year-old.\n\n{text}",
    "Rewrite this passage in plain, modern English.\n\n{text}",
    "Give this passage a short title and explain your choice.\n\n{text}",
    "Write three questions a reader might ask after reading this passage, and answer one of them.\n\n{text}",
    "What is the tone of this passage? Quote one phrase that shows it.\n\n{text}",
    "Write a short reply to the author of this passage.\n\n{text}",
    "Which words in this passage would a student need to look up? Define two of them.\n\n{text}",
)


def is_teacher_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_teacher_source(source: str) -> tuple[str, int]:
    """``teacher:<corpus>[:<n>]`` → (corpus, n). The corpus is any corpus spec (built-in name, path)."""
    rest = source[len(PREFIX) :]
    corpus, _, n = rest.rpartition(":") if rest.rpartition(":")[2].isdigit() else (rest, "", "")
    if not corpus:
        raise ConfigError(
            f"data.source {source!r} names no corpus",
            "use teacher:<corpus>[:<examples>], e.g. teacher:sotu:128",
        )
    count = int(n) if n else DEFAULT_EXAMPLES
    if count < 1:
        raise ConfigError(
            f"data.source {source!r} asks for {count} examples", "ask for at least one, e.g. teacher:sotu:128"
        )
    return corpus, count


def seed_passages(corpus: str, n: int, *, words: int = 80, seed: int = 0) -> list[str]:
    """``n`` passages of about ``words`` words from the corpus' training documents (never held-out ones)."""
    train, _ = split_documents(load_documents(corpus), corpus)
    paragraphs = [p.strip() for doc in train for p in doc.text.split("\n\n") if len(p.split()) >= 20]
    if not paragraphs:
        raise ConfigError(
            f"corpus {corpus!r} has no paragraph of 20+ words to prompt with",
            "use a corpus of prose, e.g. teacher:sotu",
        )
    rng = random.Random(seed)
    picks = [rng.choice(paragraphs) for _ in range(n)]
    return [" ".join(p.split()[:words]) for p in picks]


def _teacher_key(teacher, tokenizer) -> str:
    """Identifies the teacher's weights and template cheaply (name, size and a weight checksum)."""
    params = list(teacher.parameters())
    checksum = float(sum(p.detach().double().sum().item() for p in params[:4]))
    parts = [
        str(getattr(teacher.config, "_name_or_path", "")),
        str(sum(p.numel() for p in params)),
        f"{checksum:.6e}",
        str(getattr(tokenizer, "chat_template", "")),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def build_teacher_sft_data(
    source: str,
    teacher,
    tokenizer,
    *,
    max_new_tokens: int = 96,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
    instructions: tuple[str, ...] = INSTRUCTIONS,
) -> Path:
    """The JSONL file of teacher replies for ``source`` (generated once, then read from the cache);
    passage ``i`` is asked ``instructions[i % len(instructions)]``."""
    corpus, n = parse_teacher_source(source)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the teacher's tokenizer has no chat template to prompt it with",
            "use a chat/instruct teacher, or give data.source a chat dataset",
        )
    asked = (
        ""
        if instructions == INSTRUCTIONS
        else "|" + hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16]
    )
    key = hashlib.sha256(
        f"{_teacher_key(teacher, tokenizer)}|{corpus}|{n}|{max_new_tokens}|{seed}|v1{asked}".encode()
    ).hexdigest()[:16]
    path = cache_dir() / "teacher_samples" / f"{Path(corpus).name}-{n}-{key}.jsonl"
    if path.exists():
        return path
    # prompt + reply must fit the teacher's context: replies get at most half of it
    context = getattr(teacher.config, "max_position_embeddings", None) or 4096
    max_new_tokens = min(max_new_tokens, context // 2)

    def render(prompt: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )

    passages = seed_passages(corpus, n, seed=seed)
    prompts = _fitting_prompts(passages, instructions, tokenizer, render, context - max_new_tokens)
    records = _teacher_replies(
        teacher, tokenizer, prompts, render, max_new_tokens, batch_size, corpus, progress
    )
    if not records:
        raise ConfigError(
            f"the teacher gave no non-empty reply to {n} prompts from {corpus!r}",
            "check the teacher's chat template, or give a chat dataset",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def _fitting_prompts(
    passages: list[str], instructions: tuple[str, ...], tokenizer, render, room: int
) -> list[str]:
    """Passage ``i`` asked ``instructions[i % len(instructions)]``, the passage shortened until the
    rendered prompt takes at most ``room`` tokens (or is down to 4 words)."""
    prompts = []
    for i, passage in enumerate(passages):
        words = passage.split()
        while True:  # shorten the passage until the rendered prompt fits
            prompt = instructions[i % len(instructions)].format(text=" ".join(words))
            if (
                len(tokenizer(render(prompt), add_special_tokens=False)["input_ids"]) <= room
                or len(words) <= 4
            ):
                break
            words = words[: len(words) * 3 // 4]
        prompts.append(prompt)
    return prompts


def _teacher_replies(
    teacher,
    tokenizer,
    prompts: list[str],
    render,
    max_new_tokens: int,
    batch_size: int,
    corpus: str,
    progress: bool,
) -> list[dict]:
    """The teacher's greedy reply to each prompt, as chat records (empty replies dropped)."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    records = []
    try:
        with _sampling(teacher) as device:
            for start in tqdm(
                range(0, len(prompts), batch_size), desc=f"teacher replies ({corpus})", disable=not progress
            ):
                chunk = prompts[start : start + batch_size]
                texts = [render(p) for p in chunk]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = teacher.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=_pad_id(tokenizer)
                )
                for prompt, row in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
                    reply = tokenizer.decode(row, skip_special_tokens=True).strip()
                    if reply:
                        records.append(
                            {
                                "messages": [
                                    {"role": "user", "content": prompt},
                                    {"role": "assistant", "content": reply},
                                ]
                            }
                        )
    finally:
        tokenizer.padding_side = side
    return records


def build_chat_corpus(spec: str, teacher, tokenizer, *, seed: int = 0, progress: bool = True) -> Path:
    """``chat:<corpus>[:<n>]`` as a corpus file: the teacher's answers to ``n`` varied instructions
    (``CHAT_INSTRUCTIONS``) over passages of the corpus' training documents, each conversation
    rendered through the teacher's own chat template (special tokens as text, as the teacher reads
    them) — one ``{"text": …}`` line per conversation, beside the replies in ``cache_dir()/teacher_samples/``.
    The replies are sampled once (greedy; :func:`build_teacher_sft_data`); the file is then a local
    ``.jsonl`` corpus like any other (tokenized and cached by the corpus cache). A tokenizer without a
    chat template is a ConfigError (use ``generated:`` for a base teacher)."""
    from .specs import parse_chat_spec

    corpus, n = parse_chat_spec(spec)
    replies = build_teacher_sft_data(
        f"{PREFIX}{corpus}:{n}",
        teacher,
        tokenizer,
        seed=seed,
        progress=progress,
        instructions=CHAT_INSTRUCTIONS,
    )
    path = replies.with_suffix(".text.jsonl")
    if not path.is_file():
        lines = []
        for line in replies.read_text(encoding="utf-8").splitlines():
            messages = json.loads(line)["messages"]
            lines.append(json.dumps({"text": tokenizer.apply_chat_template(messages, tokenize=False)}) + "\n")
        atomic_write_text(path, "".join(lines))
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

MAX_AUTO_BATCH = 1024  # samples per generate call, at most, when a GPU's memory chooses
_AUTO_BATCH_MEMORY_SHARE = 0.25  # of the GPU memory the teacher's weights leave


@dataclass
class Sample:
    """One sample of a ``generated:`` corpus: a document of its train or held-out side."""

    index: int  # the n-th sample (its document id is ``generated:<index>``)
    side: str  # "train" or "heldout" (the hash rule on its id)
    # 1-D int64 on the CPU: prompt (if any) + new tokens, cut so the corpus ends at n_tokens
    ids: torch.Tensor


def sampling_batch(g, teacher, positions: int, length: int | None = None) -> int:
    """Samples per ``generate`` call for spec ``g``: its ``batch=`` when it set one, and on a CPU (16,
    the spec's default); on a GPU, when not set, the largest power of two up to ``MAX_AUTO_BATCH``
    whose KV cache (``positions`` per sample) and last-position logits fit a quarter of the memory the
    teacher's weights leave — from the device's total memory and the teacher's config, not from what
    is free now, so the same teacher on the same kind of GPU always samples (and caches) the same
    batches — and no larger than a corpus of ``n_tokens`` needs at ``length`` new tokens a sample
    (a small corpus is not sampled 1024 rows at a time); never below the default 16."""
    device = next(teacher.parameters()).device
    if "batch" in g.given or device.type != "cuda":
        return g.batch
    weights = sum(p.numel() * p.element_size() for p in teacher.parameters())
    # logits, softmax, top-p sort
    per_sample = (
        positions * _kv_bytes_per_position(teacher) + 16 * teacher.config.get_text_config().vocab_size
    )
    batch = auto_batch(torch.cuda.get_device_properties(device).total_memory, weights, per_sample)
    needed = -(-g.n_tokens // (length or g.length))  # samples the corpus needs if none ends early
    return max(g.batch, min(batch, 1 << (needed - 1).bit_length()))


def auto_batch(total_memory: int, weight_bytes: int, per_sample_bytes: int) -> int:
    """The largest power of two, 1 to ``MAX_AUTO_BATCH``, of samples whose memory fits a quarter of
    what the weights leave of ``total_memory``."""
    fits = int(_AUTO_BATCH_MEMORY_SHARE * max(total_memory - weight_bytes, 0)) // max(per_sample_bytes, 1)
    return min(1 << (max(fits, 1).bit_length() - 1), MAX_AUTO_BATCH)


def _kv_bytes_per_position(teacher) -> int:
    """Keys and values of one position in every layer (the KV cache ``generate`` keeps)."""
    cfg = teacher.config.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 1)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", 1)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 1)
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 2 * layers * kv_heads * head_dim * next(teacher.parameters()).element_size()


class TeacherSampler:
    """The samples of a ``generated:`` spec, drawn ``batch`` at a time with the teacher's ``generate``
    and handed out one by one (iterate it), so a caller can write them away as they come and no corpus
    ever sits in memory. ``settings`` and ``key`` identify the corpus before anything is sampled (the
    cache key of :func:`generate_corpus`); after (or during) iteration ``n_samples``, ``tokens``,
    ``seconds`` and ``tokens_per_second`` say what it did. Each batch is sampled under
    ``torch.random.fork_rng`` seeded from the spec's seed and the batch's index, so the caller's random
    state is untouched and the same spec, seed, teacher and kind of device give the same samples.
    """

    def __init__(
        self, spec: str, teacher, tokenizer, *, seed: int = 0, progress: bool = True, goal: int | None = None
    ):
        self.spec, self.teacher, self.tokenizer, self.seed, self.progress = (
            spec,
            teacher,
            tokenizer,
            seed,
            progress,
        )
        self.goal = goal  # what the progress bar counts up to (default n_tokens; a caller that stops early says where)
        self.g = g = parse_generated_spec(spec)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError(
                f"tokenizer {type(tokenizer).__name__} has no EOS token to end generated samples",
                "set tokenizer.eos_token before sampling",
            )
        self.start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos
        self.prompt_len = g.prompt_len if g.prompts else 1
        context = getattr(teacher.config, "max_position_embeddings", None) or 4096
        self.length = min(g.length, context - self.prompt_len)
        if self.length < 1:
            raise DataError(
                f"{spec!r}: prompts of {self.prompt_len} tokens leave no room in the teacher's {context} positions",
                "lower prompt_len",
            )
        self.batch = sampling_batch(g, teacher, self.prompt_len + self.length, self.length)
        self.settings = {
            "format": GENERATED_FORMAT,
            "teacher": _teacher_key(teacher, tokenizer),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "seed": seed,
            "n_tokens": g.n_tokens,
            "prompts": g.prompts,
            "prompts_stamp": corpus_stamp(g.prompts) if g.prompts else None,
            "field": g.field,
            "prompt_len": self.prompt_len,
            "start": self.start_id,
            "length": self.length,
            "temperature": g.temperature,
            "top_p": g.top_p,
            "batch": self.batch,
        }
        self.key = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:24]
        self.n_samples, self.tokens, self.docs, self.seconds = (
            0,
            {"train": 0, "heldout": 0},
            {"train": 0, "heldout": 0},
            0.0,
        )

    @property
    def tokens_per_second(self) -> float:
        """Corpus tokens (EOS joins included) per second of wall time, sampling and the caller's writes together."""
        return sum(self.tokens.values()) / self.seconds if self.seconds else 0.0

    def stats(self) -> dict:
        return {
            "n_samples": self.n_samples,
            "n_train_docs": self.docs["train"],
            "n_heldout_docs": self.docs["heldout"],
            "n_train_tokens": self.tokens["train"],
            "n_heldout_tokens": self.tokens["heldout"],
            "batch": self.batch,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
        }

    def __iter__(self):
        g, n = self.g, self.g.n_tokens
        prompt_ids = _prompt_source(g, self.tokenizer) if g.prompts else None
        was_training, device = self.teacher.training, next(self.teacher.parameters()).device
        self.teacher.eval()
        started = time.perf_counter()
        bar = tqdm(
            total=min(n, self.goal or n),
            desc=f"sampling {self.spec}",
            unit="tok",
            unit_scale=True,
            disable=not self.progress,
        )
        try:
            batch_i = 0
            while sum(self.tokens.values()) < n:
                out = self._sample(batch_i, prompt_ids, device)
                for row in out:
                    if sum(self.tokens.values()) >= n:
                        break
                    new = row[self.prompt_len if prompt_ids is not None else 1 :]
                    ends = (new == self.eos).nonzero()
                    # a sample ends at the teacher's EOS (padding after it)
                    new = new[: int(ends[0])] if len(ends) else new
                    # BOS is not text; a prompt is
                    sample = new if prompt_ids is None else torch.cat([row[: self.prompt_len], new])
                    side = "heldout" if is_heldout_id(f"generated:{self.n_samples}") else "train"
                    sep = 1 if self.docs[side] else 0  # the EOS joining it to its side counts
                    ids = sample[: n - sum(self.tokens.values()) - sep]
                    self.tokens[side] += ids.numel() + sep
                    self.docs[side] += 1
                    self.n_samples += 1
                    bar.update(min(sum(self.tokens.values()), bar.total) - bar.n)
                    yield Sample(self.n_samples - 1, side, ids)
                    self.seconds = time.perf_counter() - started
                batch_i += 1
        finally:
            self.seconds = time.perf_counter() - started
            bar.close()
            self.teacher.train(was_training)

    def _sample(self, batch_i: int, prompt_ids: torch.Tensor | None, device) -> torch.Tensor:
        """Batch ``batch_i``: ``(batch, prompt + length)`` ids on the CPU, its random draws seeded by its index."""
        g = self.g
        if prompt_ids is None:
            inputs = torch.full((self.batch, 1), self.start_id, dtype=torch.long)
        else:
            gen = torch.Generator().manual_seed(_stream_seed(self.seed, "prompts", batch_i))
            offsets = torch.randint(0, prompt_ids.numel() - self.prompt_len + 1, (self.batch,), generator=gen)
            inputs = torch.stack([prompt_ids[o : o + self.prompt_len] for o in offsets.tolist()])
        with torch.random.fork_rng(devices=_cuda_index(device)), torch.no_grad():
            torch.manual_seed(_stream_seed(self.seed, "sample", batch_i))
            return self.teacher.generate(
                input_ids=inputs.to(device),
                attention_mask=torch.ones_like(inputs, device=device),
                do_sample=True,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=0,
                max_new_tokens=self.length,
                min_new_tokens=1,
                eos_token_id=self.eos,
                pad_token_id=_pad_id(self.tokenizer),
            ).cpu()


def generate_corpus(
    spec: str, teacher, tokenizer, *, seed: int = 0, progress: bool = True
) -> TokenizedCorpus:
    """The ``generated:`` corpus ``spec`` names (see :mod:`.sources`): sampled once, then read from the cache.

    ``train_ids`` and ``heldout_ids`` hold ``n_tokens`` tokens together; ``meta["from_cache"]`` tells
    whether the cache answered. Raises :class:`DataError` for a bad spec or a tokenizer without EOS.
    For corpora too large to hold in memory, :func:`.shard_writer.generate_shards` writes the same samples to disk.
    """
    sampler = TeacherSampler(spec, teacher, tokenizer, seed=seed, progress=progress)
    path = cache_dir() / "generated" / f"{sampler.key}.pt"
    if path.is_file():
        try:
            corpus = load_tokenized(path, tokenizer)
        except DataError:
            pass  # unreadable: sample again
        else:
            corpus.meta.update(from_cache=True, cache_path=str(path))
            return corpus

    sides = {"train": Joiner(sampler.eos, None, "train"), "heldout": Joiner(sampler.eos, None, "held-out")}
    for sample in sampler:
        sides[sample.side].add(sample.ids.tolist())
    stats = sampler.stats()
    meta = {
        "spec": spec,
        "generated": True,
        **{
            k: stats[k]
            for k in ("n_samples", "n_train_docs", "n_heldout_docs", "n_train_tokens", "n_heldout_tokens")
        },
        "settings": sampler.settings,
        "tokens_per_second": stats["tokens_per_second"],
    }
    corpus = TokenizedCorpus(
        sides["train"].ids(), sides["heldout"].ids(), sampler.settings["tokenizer"], meta
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tokenized(corpus, path)
    corpus.meta.update(from_cache=False, cache_path=str(path))
    return corpus


def _prompt_source(g, tokenizer) -> torch.Tensor:
    """The prompt corpus' training tokens (never its held-out text), tokenized through the corpus cache."""
    limit = _PROMPT_CORPUS_STREAM_TOKENS if can_stream(g.prompts) else None
    ids = prepare_corpus(
        g.prompts, tokenizer, max_train_tokens=limit, max_heldout_tokens=0, text_field=g.field
    ).train_ids
    if ids.numel() < g.prompt_len:
        raise DataError(
            f"prompt corpus {g.prompts!r} has {ids.numel()} training tokens, fewer than prompt_len={g.prompt_len}",
            "lower prompt_len or use a larger corpus",
        )
    return ids
