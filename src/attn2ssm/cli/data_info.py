"""``attn2ssm data info``: what a shard folder holds (``describe``, which ``data shards`` prints too),
checked as reading it checks (manifest fields, file sizes, ids within the vocabulary; --verify: the
SHA-256 too), its ids against a teacher's tokenizer (--teacher)."""

from __future__ import annotations

import os
from pathlib import Path

from attn2ssm.errors import ConfigError


def add_parser(dsub) -> None:
    i = dsub.add_parser(
        "info",
        help="what a shard folder holds: source, tokenizer, tokens and bytes per side, how it was sampled",
    )
    i.add_argument("dir", metavar="DIR")
    i.add_argument(
        "--verify", action="store_true", help="check every file's SHA-256 against the manifest (after a copy)"
    )
    i.add_argument(
        "--teacher",
        default=None,
        help="also check that the ids belong to this teacher's tokenizer (loads the tokenizer only)",
    )
    i.set_defaults(func=run_info)


def run_info(args) -> int:
    folder = Path(args.dir[len("shards:") :] if args.dir.startswith("shards:") else args.dir)
    if not (folder / "manifest.json").is_file():
        raise ConfigError(
            f"{folder} holds no token shards (manifest.json missing)",
            "give the folder 'attn2ssm data shards --out' wrote",
        )
    check_teacher(args.teacher)

    from attn2ssm.data.shards import check_shards  # heavy: torch

    manifest = check_shards(folder, verify=args.verify)  # what reading them in eval or distill checks
    for line in describe(folder, manifest):
        print(line)
    if args.verify:
        print(
            f"verified: all {sum(len(manifest['sides'][s]) for s in manifest['sides'])} files match their size and SHA-256"
        )
    if args.teacher is not None:
        from attn2ssm.data.packing import tokenizer_fingerprint  # heavy: torch
        from attn2ssm.errors import DataError
        from attn2ssm.teachers import load_teacher_tokenizer  # heavy: transformers

        theirs = tokenizer_fingerprint(load_teacher_tokenizer(args.teacher))
        if theirs != manifest["tokenizer_fingerprint"]:
            raise DataError(
                f"the ids in {folder} belong to another tokenizer than {args.teacher}'s (fingerprint {manifest['tokenizer_fingerprint']}, "
                f"{args.teacher}: {theirs})",
                "train with the teacher whose tokenizer wrote them, or write the shards again",
            )
        print(f"tokenizer: the ids belong to {args.teacher}'s tokenizer (fingerprint {theirs})")
    return 0


def describe(folder: Path, manifest: dict) -> list[str]:
    """What a shard folder holds, a few lines: source, tokenizer, each side, how it was made."""
    from attn2ssm.data.shards import shard_bytes, side_tokens  # heavy: torch

    meta = manifest.get("meta", {})
    lines = [
        f"{folder}: token shards of {manifest['source']!r}, {_size(shard_bytes(manifest))}",
        f"  tokenizer {manifest['tokenizer_class']}, {manifest['vocab_size']:,} ids, fingerprint {manifest['tokenizer_fingerprint']}, "
        f"EOS {manifest['eos_token_id']}; ids {manifest['dtype']}",
    ]
    for side, label in (("train", "train"), ("heldout", "held-out")):
        files = len(manifest["sides"][side])
        lines.append(
            f"  {label:<8} {side_tokens(manifest, side):>13,} tokens in {files} file{'s' * (files != 1)} ({_size(shard_bytes(manifest, side))})"
        )
    if meta.get("generated"):
        lines.append(
            f"  sampled: {meta.get('n_samples', 0):,} samples, batch {meta.get('batch')} on {meta.get('device')} ({str(meta.get('teacher_dtype', '')).replace('torch.', '')}), "
            f"{meta.get('tokens_per_second', 0):,.0f} tokens/s over {meta.get('seconds', 0):,.1f} s"
        )
    elif "tokens_per_second" in meta:
        streamed = f", {meta['rows_read']:,} rows streamed" if meta.get("streamed") else ""
        lines.append(
            f"  tokenized: {meta.get('n_train_docs', 0):,} + {meta.get('n_heldout_docs', 0):,} documents{streamed}, "
            f"{meta['tokens_per_second']:,.0f} tokens/s"
        )
    return lines


def _size(n: int) -> str:
    return (
        f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 2**10:.1f} KiB" if n >= 1 << 10 else f"{n} bytes"
    )


def check_teacher(spec: str | None) -> None:
    """A teacher that cannot be there, refused in one line before anything heavy loads: a path that does
    not exist, or offline, a hub id the Hugging Face cache does not hold (a built-in is not converted here)."""
    from attn2ssm.errors import CheckpointError
    from attn2ssm.teachers import BUILTIN_TEACHERS, resolve_teacher

    if spec is None or spec in BUILTIN_TEACHERS:
        return
    source = resolve_teacher(spec)
    if source.kind == "hub" and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        from huggingface_hub import try_to_load_from_cache  # (no torch)

        if not isinstance(try_to_load_from_cache(spec, "config.json"), str):
            raise CheckpointError(
                f"--teacher {spec!r} is no built-in name ({', '.join(BUILTIN_TEACHERS)}), local folder or file, and the hub is offline "
                "with no copy of it in the Hugging Face cache",
                "check the name or path",
            )
