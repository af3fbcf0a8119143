"""Chat and preference datasets for the ``sft`` and ``dpo`` stages.

A stage's ``data.source`` names a local ``.jsonl`` / ``.json`` / ``.parquet`` file or
``hf:<dataset>[:<config>][:<split>]`` (see :mod:`.sources`). Records come in the usual Hugging
Face shapes, told apart by their fields (``format: auto``) or named explicitly:

* ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}``;
* ``prompt_completion``: ``{"prompt": str, "completion": str}`` (or ``"response"``), read as one
  user turn and one assistant turn, so it trains the same chat format as ``messages``;
* ``preference``: ``{"prompt", "chosen", "rejected"}`` where chosen/rejected are strings (the
  reply to ``prompt``), assistant-only message lists (appended to ``prompt``), or whole
  conversations whose trailing assistant turns are the reply (``HuggingFaceH4/ultrafeedback_binarized``;
  ``prompt`` may then be absent).

Every conversation is rendered with the teacher tokenizer's chat template. Which tokens are the
assistant's is found by rendering prefixes — ``messages[:i]`` with the generation prompt and
``messages[:i+1]`` — and marking the characters in between (the reply and the template's
end-of-turn), so any template works without ``{% generation %}`` support. A template that does not
render a conversation's prefixes as prefixes of the whole (some drop earlier turns' reasoning) falls
back to training on the last assistant turn only.

Long examples are cut at ``max_len`` tokens from the right; examples left without a reply token
are dropped (and counted in ``meta``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn2ssm.errors import ConfigError, DataError

from .sources import open_hf_dataset
from .tokenize import LONG_SEQ_WARNING

FORMATS = ("auto", "messages", "prompt_completion", "preference")
SFT_FORMATS = ("auto", "messages", "prompt_completion")
PREFERENCE_FORMATS = ("auto", "preference")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_FORMAT_FIX = (
    "give records 'messages' (a list of {role, content}), 'prompt' + 'completion' (or 'response'), "
    "or 'prompt' + 'chosen' + 'rejected' for preference data"
)


# ------------------------------------------------------------------------------ records


def load_records(source: str, max_examples: int | None = None) -> list[tuple[str, dict]]:
    """``(where, record)`` pairs from ``source``, in source order; at most ``max_examples``."""
    if not isinstance(source, str) or not source.strip():
        raise DataError(
            "no dataset given", "set the stage's data.source to a .jsonl/.json/.parquet file or hf:<dataset>"
        )
    source = source.strip()
    if source.startswith("hf:"):
        ds = open_hf_dataset(
            source[3:],
            offline_fix="download the dataset once and point data.source at a local .jsonl/.json/.parquet copy",
        )
        if max_examples is not None:
            ds = ds.select(range(min(max_examples, len(ds))))
        return [(f"{source} row {i}", r) for i, r in enumerate(ds)]
    path = Path(source).expanduser()
    if not path.is_file():
        raise DataError(
            f"dataset file {str(path)!r} does not exist", "check data.source, or use hf:<dataset>"
        )
    if path.suffix not in FILE_SUFFIXES:
        raise DataError(
            f"cannot read dataset file {str(path)!r}: unsupported format",
            f"use one of {', '.join(FILE_SUFFIXES)} or hf:<dataset>",
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # heavy: pyarrow, only for .parquet files

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(
                f"cannot read parquet file {path} ({e})", "check that the file is complete"
            ) from e
        records = [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    elif path.suffix == ".json":
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            records = _jsonl_records(path)  # JSON Lines under a .json name, as datasets accepts
        else:
            if not isinstance(data, list):
                raise DataError(
                    f"{path} holds a JSON {type(data).__name__}, not a list of records",
                    "write a JSON list of objects, or JSON Lines",
                )
            records = [(f"{path} row {i}", r) for i, r in enumerate(data)]
    else:
        records = _jsonl_records(path)
    return records[:max_examples] if max_examples is not None else records


def _jsonl_records(path: Path) -> list[tuple[str, dict]]:
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({e.msg})", "fix or remove that line"
                ) from e
    return records


def detect_format(record) -> str | None:
    """The format a record's fields fit (``messages``, ``preference``, ``prompt_completion``), or None."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "messages"
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "prompt" in record and ("completion" in record or "response" in record):
        return "prompt_completion"
    return None


def _keys(record) -> str:
    return ", ".join(record) if isinstance(record, dict) else type(record).__name__


def _check_messages(messages, where: str, name: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: '{name}' is not a non-empty list of messages",
            "write it as [{role: user, content: ...}, {role: assistant, content: ...}]",
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: a message in '{name}' lacks 'role' or 'content' ({m!r:.80})",
                "give every message a role and a content",
            )
    return messages


def _as_messages(value, role: str, where: str, name: str) -> list[dict]:
    """A string becomes one message of ``role``; a list must already be messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _check_messages(value, where, name)


def to_conversation(record, fmt: str, where: str) -> list[dict]:
    """An SFT record as a list of messages."""
    if fmt == "messages":
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(f"{where} has no field 'messages' (has: {_keys(record)})", _FORMAT_FIX)
        return _check_messages(record["messages"], where, "messages")
    if (
        not isinstance(record, dict)
        or "prompt" not in record
        or not ("completion" in record or "response" in record)
    ):
        raise DataError(
            f"{where} lacks 'prompt' and 'completion'/'response' (has: {_keys(record)})", _FORMAT_FIX
        )
    reply = record["completion"] if "completion" in record else record["response"]
    return _as_messages(record["prompt"], "user", where, "prompt") + _as_messages(
        reply, "assistant", where, "completion"
    )


def _reply_start(conversation: list[dict]) -> int:
    """Index of the first of the trailing assistant messages."""
    i = len(conversation)
    while i > 0 and conversation[i - 1]["role"] == "assistant":
        i -= 1
    return i


def to_preference(record, where: str) -> tuple[tuple[list[dict], int], tuple[list[dict], int]]:
    """A preference record as ``((chosen_conversation, reply_start), (rejected_conversation, reply_start))``."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise DataError(f"{where} lacks 'chosen' and 'rejected' (has: {_keys(record)})", _FORMAT_FIX)
    out = []
    for name in ("chosen", "rejected"):
        value = record[name]
        if isinstance(value, list) and _check_messages(value, where, name)[0]["role"] != "assistant":
            conversation = value  # a whole conversation: its trailing assistant turns are the reply
        else:
            if "prompt" not in record:
                raise DataError(
                    f"{where} has no 'prompt' and '{name}' is not a whole conversation",
                    "add the prompt, or give chosen/rejected as full conversations",
                )
            conversation = _as_messages(record["prompt"], "user", where, "prompt") + _as_messages(
                value, "assistant", where, name
            )
        start = _reply_start(conversation)
        if start == len(conversation):
            raise DataError(
                f"{where}: '{name}' does not end with an assistant message",
                "the reply must be the last, assistant turn",
            )
        out.append((conversation, start))
    return out[0], out[1]


# ----------------------------------------------------------------------------- rendering


def require_chat_template(tokenizer, stage: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"stage '{stage}': the teacher's tokenizer ({type(tokenizer).__name__}) has no chat template to format chat data with",
            "use an instruct teacher, or set tokenizer.chat_template to a Jinja template and save it beside the teacher's tokenizer (chat_template.jinja)",
        )


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # the template's own raise_exception (e.g. roles must alternate)
        if not messages:
            return ""
        raise DataError(
            f"{where}: the chat template refused this conversation ({str(e).splitlines()[0][:200]})",
            "fix the record or use a teacher whose template accepts it",
        ) from e


def assistant_char_spans(
    tokenizer, messages: list[dict], first_turn: int = 0, where: str = "record"
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns at index ≥ ``first_turn``.

    Span of turn i = [len(render(messages[:i], generation prompt)), len(render(messages[:i+1]))).
    """
    text = _render(tokenizer, messages, False, where)
    spans = []
    for i in range(first_turn, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, where)
        upto = _render(tokenizer, messages[: i + 1], False, where)
        if not (upto.startswith(before) and text.startswith(upto)):
            break
        spans.append((len(before), len(upto)))
    else:
        return text, spans
    # Not prefix-stable: train the last assistant turn only, rendered as the end of the conversation.
    last = max(i for i in range(first_turn, len(messages)) if messages[i]["role"] == "assistant")
    before = _render(tokenizer, messages[:last], True, where)
    text = _render(tokenizer, messages[: last + 1], False, where)
    if not text.startswith(before):
        raise DataError(
            f"{where}: the chat template renders the conversation before the last assistant turn differently from its start",
            "use a template that renders prefixes consistently, or give one-turn examples",
        )
    return text, [(len(before), len(text))]


@contextlib.contextmanager
def _long_inputs_allowed(tokenizer):
    """Silence "sequence length is longer than the maximum": examples are cut to max_len afterwards."""
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if not isinstance(warned, dict):
        yield
        return
    before = warned.get(LONG_SEQ_WARNING, False)
    warned[LONG_SEQ_WARNING] = True
    try:
        yield
    finally:
        warned[LONG_SEQ_WARNING] = before


def tokenize_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` (no extra special tokens: the template already has them) and a mask of
    the tokens that start inside ``spans``."""
    with _long_inputs_allowed(tokenizer):
        return _tokenize_with_mask(tokenizer, text, spans)


def _tokenize_with_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        mask = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer: no offsets
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = [False] * len(ids)
        for a, b in spans:
            lo = len(tokenizer(text[:a], add_special_tokens=False)["input_ids"])
            hi = len(tokenizer(text[:b], add_special_tokens=False)["input_ids"])
            mask[lo:hi] = [True] * (hi - lo)
    return list(ids), mask


def encode_conversation(
    tokenizer, messages: list[dict], first_turn: int = 0, where: str = "record"
) -> tuple[list[int], list[bool]]:
    """``(ids, loss_mask)``: the rendered conversation with its assistant tokens (from ``first_turn``) marked."""
    text, spans = assistant_char_spans(tokenizer, messages, first_turn, where)
    return tokenize_with_mask(tokenizer, text, spans)


# ------------------------------------------------------------------------------ datasets


def _pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    return 0


def pad_right(
    rows: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad 1-D ids and loss masks to the longest row: ``(input_ids, attention_mask, loss_mask)``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)], attn[i, : len(r)], loss[i, : len(r)] = r, 1, m
    return ids, attn, loss


def _fit(ids: list[int], mask: list[bool], max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cut to ``max_len``; None when no scored reply token is left (position 0 is never a target)."""
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask[1:]):
        return None
    # int32 halves the memory
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool)


@dataclass
class ChatDataset:
    """Tokenized SFT conversations: ``ids[i]`` (l,) int32 and ``loss_masks[i]`` (l,) marking assistant tokens;
    :meth:`collate` gives right-padded ``torch.long`` batches."""

    ids: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    pad_id: int
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, indices) -> int:
        return sum(len(self.ids[i]) for i in indices)

    def loss_tokens(self, indices) -> int:
        """Scored targets (marked tokens after position 0)."""
        return sum(int(self.loss_masks[i][1:].sum()) for i in indices)

    def collate(self, indices) -> dict:
        ids, attn, loss = pad_right(
            [self.ids[i] for i in indices], [self.loss_masks[i] for i in indices], self.pad_id
        )
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


@dataclass
class PreferenceDataset:
    """Tokenized preference pairs; each side's loss mask marks its reply tokens."""

    chosen: ChatDataset
    rejected: ChatDataset
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.chosen)

    def tokens(self, indices) -> int:
        return self.chosen.tokens(indices) + self.rejected.tokens(indices)

    def loss_tokens(self, indices) -> int:
        return self.chosen.loss_tokens(indices) + self.rejected.loss_tokens(indices)

    def collate(self, indices) -> dict:
        batch = {}
        for side, data in (("chosen", self.chosen), ("rejected", self.rejected)):
            batch.update({f"{side}_{k}": v for k, v in data.collate(indices).items()})
        return batch


def _resolve_format(records: list[tuple[str, dict]], fmt: str, allowed: tuple[str, ...], source: str) -> str:
    if fmt not in allowed:
        raise ConfigError(f"data format '{fmt}' cannot be used here", f"use one of: {', '.join(allowed)}")
    if fmt != "auto":
        return fmt
    where, first = records[0]
    found = detect_format(first)
    if found is None or found not in allowed:
        wanted = (
            "preference data (prompt, chosen, rejected)"
            if allowed == PREFERENCE_FORMATS
            else "chat data (messages, or prompt + completion/response)"
        )
        raise DataError(f"{where} does not look like {wanted} (has: {_keys(first)})", _FORMAT_FIX)
    return found


def load_sft_dataset(
    source: str,
    tokenizer,
    *,
    format: str = "auto",
    max_len: int = 512,
    max_examples: int | None = None,
    stage: str = "sft",
) -> ChatDataset:
    """Read, render and tokenize an SFT dataset; assistant tokens are the loss mask."""
    require_chat_template(tokenizer, stage)
    records = load_records(source, max_examples)
    if not records:
        raise DataError(f"dataset {source!r} holds no records", "check data.source")
    fmt = _resolve_format(records, format, SFT_FORMATS, source)
    ids, masks, dropped = [], [], 0
    for where, record in records:
        messages = to_conversation(record, fmt, where)
        fitted = (
            _fit(*encode_conversation(tokenizer, messages, 0, where), max_len)
            if any(m["role"] == "assistant" for m in messages)
            else None
        )
        if fitted is None:
            dropped += 1
            continue
        ids.append(fitted[0])
        masks.append(fitted[1])
    if not ids:
        raise DataError(
            f"no example of {source!r} has an assistant token within max_len={max_len}",
            "raise data.max_len or check that conversations have assistant turns",
        )
    return ChatDataset(
        ids,
        masks,
        _pad_id(tokenizer),
        {"source": source, "format": fmt, "examples": len(ids), "dropped": dropped},
    )


def load_preference_dataset(
    source: str,
    tokenizer,
    *,
    format: str = "auto",
    max_len: int = 512,
    max_examples: int | None = None,
    stage: str = "dpo",
) -> PreferenceDataset:
    """Read, render and tokenize preference pairs; each side's reply tokens are its loss mask."""
    require_chat_template(tokenizer, stage)
    records = load_records(source, max_examples)
    if not records:
        raise DataError(f"dataset {source!r} holds no records", "check data.source")
    _resolve_format(records, format, PREFERENCE_FORMATS, source)
    sides: dict[str, tuple[list, list]] = {"chosen": ([], []), "rejected": ([], [])}
    dropped = 0
    for where, record in records:
        pair = to_preference(record, where)
        fitted = [_fit(*encode_conversation(tokenizer, conv, start, where), max_len) for conv, start in pair]
        if any(f is None for f in fitted):
            dropped += 1
            continue
        for side, (i, m) in zip(sides, fitted):
            sides[side][0].append(i)
            sides[side][1].append(m)
    if not sides["chosen"][0]:
        raise DataError(
            f"no pair of {source!r} has reply tokens within max_len={max_len}", "raise data.max_len"
        )
    pad = _pad_id(tokenizer)
    chosen, rejected = (ChatDataset(*sides[s], pad) for s in ("chosen", "rejected"))
    return PreferenceDataset(
        chosen,
        rejected,
        {"source": source, "format": "preference", "examples": len(chosen), "dropped": dropped},
    )
