"""``attn2ssm data shards | info``: any corpus spec written once as token shards (ids, no text: what
travels to a machine with no network), and what a shard folder holds (``cli.data_info``)."""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

from attn2ssm.cli import data_info
from attn2ssm.cli.data_info import check_teacher, describe
from attn2ssm.errors import ConfigError, Interrupted

MANIFEST_RESERVE = 64 << 10  # bytes --fit-mib leaves for the manifest
FIT_HELDOUT_SHARE = 32  # --fit-mib without --heldout-tokens: 1/32 of the tokens are held out


def add_parser(subparsers) -> None:
    d = subparsers.add_parser(
        "data",
        help="token shards: a corpus written once as token ids (shards), and what a shard folder holds (info)",
    )
    dsub = d.add_subparsers(dest="data", required=True)
    _add_shards_parser(dsub)
    data_info.add_parser(dsub)


def _add_shards_parser(dsub) -> None:
    """``data shards SPEC --out DIR``: the corpus, the limits, and for generated: the sampling."""
    s = dsub.add_parser(
        "shards",
        help="write a corpus spec as token shards with the teacher's tokenizer (generated: sampled from the teacher)",
    )
    s.add_argument(
        "spec",
        metavar="SPEC",
        help="built-in name (sotu, moby-dick), .txt/.jsonl/.parquet file or folder, hf:<dataset>[:<config>][:<split>], "
        "generated:<n_tokens>[:<prompt corpus>][?batch=…&length=…] (sampled from --teacher), or shards:<folder> (copied, cut to the limits)",
    )
    s.add_argument("--out", required=True, help="the shard folder to write (must not exist, or be empty)")
    s.add_argument(
        "--teacher",
        default=None,
        help="whose tokenizer (and for generated:, whose samples): built-in name, HF directory, .gguf file or hub id "
        "(default smollm2-135m; only generated: loads its weights)",
    )
    s.add_argument(
        "--max-tokens",
        default=None,
        help="training tokens to write, at most (e.g. 30000000, 30M, 2^25); default all",
    )
    s.add_argument("--heldout-tokens", default=None, help="held-out tokens to write, at most; default all")
    s.add_argument(
        "--fit-mib",
        type=float,
        default=None,
        help="size the limits so the folder fits this many MiB (64: a transfer of 64 MiB; "
        "2 bytes a token when the vocabulary has at most 65,536 ids); held out: --heldout-tokens, else 1/32 of the tokens",
    )
    s.add_argument(
        "--shard-tokens", default="2^25", help="ids per file (default 2^25: 64 MiB files at 16 bits)"
    )
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="generated: the sampling seed (the same seed, teacher, dtype and kind of device give the same samples)",
    )
    s.add_argument(
        "--device",
        default=None,
        help="generated: where the teacher samples (default cuda when available, else cpu)",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="generated: the teacher's weights (auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=run_shards)


# ------------------------------------------------------------------------------------- shards


def run_shards(args) -> int:
    # Cheap checks first: a typo fails in a fraction of a second, before torch / transformers load.
    limits, shard_tokens, generated = _check_shards_args(args)
    out = Path(args.out)

    from attn2ssm.data.shard_writer import write_corpus_shards  # heavy: torch
    from attn2ssm.data.shards import id_dtype
    from attn2ssm.paths import remove_stale_staging

    remove_stale_staging(out.parent)  # what a killed writer left beside it
    teacher = None
    if generated:
        teacher, tokenizer = _sampling_teacher(args)
    else:
        from attn2ssm.teachers import load_teacher_tokenizer  # heavy: transformers

        tokenizer = load_teacher_tokenizer(args.teacher)
    max_train, max_heldout = limits["--max-tokens"], limits["--heldout-tokens"]
    if args.fit_mib is not None:
        max_train, max_heldout = fit_limits(
            args.fit_mib, id_dtype(len(tokenizer)).itemsize, max_train, max_heldout
        )
    # SIGTERM too: the writer drops its staging folder, nothing is left at --out
    with _terminate_as_interrupt(out):
        manifest = write_corpus_shards(
            args.spec,
            out,
            tokenizer,
            teacher=teacher,
            seed=args.seed,
            max_train_tokens=max_train,
            max_heldout_tokens=max_heldout,
            shard_tokens=shard_tokens,
            progress=not args.no_progress,
        )
    for line in describe(out, manifest):
        print(line)
    print(f"use it: data.corpus: shards:{out}  (or an entry of data.sources)")
    return 0


def _check_shards_args(args) -> tuple[dict, int, bool]:
    """``data shards``' flags, refused in one line before anything heavy loads: the token limits by
    flag, the ids per file, and whether the spec is sampled from the teacher (``generated:``)."""
    from attn2ssm.data.specs import check_spec, is_generated
    from attn2ssm.paths import check_writable

    limits = {
        flag: token_count(flag, value)
        for flag, value in (("--max-tokens", args.max_tokens), ("--heldout-tokens", args.heldout_tokens))
    }
    shard_tokens = token_count("--shard-tokens", args.shard_tokens)
    if shard_tokens < 1:
        raise ConfigError(
            f"--shard-tokens {args.shard_tokens} is not a positive number of ids per file",
            "write e.g. --shard-tokens 2^25",
        )
    if args.fit_mib is not None and not args.fit_mib > 0:
        raise ConfigError(
            f"--fit-mib {args.fit_mib:g} is no size", "give the MiB the folder may take, e.g. --fit-mib 64"
        )
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()):  # a file there: check_writable says so
        held = "token shards" if (out / "manifest.json").exists() else "other files"
        raise ConfigError(f"--out {out} already holds {held}", "choose another --out, or remove it first")
    check_spec(args.spec)
    generated = is_generated(args.spec)
    check_teacher(args.teacher)
    if not generated and (args.device is not None or args.dtype != "auto"):
        raise ConfigError(
            f"--device and --dtype are for generated: specs, and {args.spec!r} is tokenized, not sampled",
            "drop them",
        )
    check_writable(out, beside=True, folder=True)
    return limits, shard_tokens, generated


def _sampling_teacher(args):
    """The teacher on --device in --dtype, and its tokenizer."""
    import torch  # heavy: torch

    from attn2ssm.devices import resolve_device
    from attn2ssm.teachers import load_teacher  # heavy: transformers

    device = resolve_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    teacher, tokenizer, _ = load_teacher(args.teacher, dtype=dtype, device=device)
    return teacher, tokenizer


@contextlib.contextmanager
def _terminate_as_interrupt(out: Path):
    """SIGTERM interrupts the block as Ctrl-C does (so files being written are cleaned up), and the
    command then exits 143 (128 + SIGTERM) as ``distill`` does, saying nothing was left at ``out``."""
    received = []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        if not received:
            raise
        raise Interrupted(
            f"stopped on SIGTERM: no token shards were written to {out}",
            "run the command again to write them",
            exit_code=128 + signal.SIGTERM,
        ) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


_COUNT = re.compile(
    r"^\s*(?:(?P<base>\d+)\s*\^\s*(?P<exp>\d+)|(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kKmMgGbB]?))\s*$"
)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def token_count(flag: str, text: str | None) -> int | None:
    """``30000000``, ``30M`` (k, M, G/B: powers of ten), ``2^25`` → an int of tokens; None stays None."""
    if text is None:
        return None
    m = _COUNT.match(str(text))
    if m is None:
        raise ConfigError(
            f"{flag} {text!r} is not a number of tokens",
            f"write e.g. {flag} 30000000, {flag} 30M or {flag} 2^25",
        )
    if m["base"] is not None:
        return int(m["base"]) ** int(m["exp"])
    return int(float(m["num"]) * _UNITS[m["unit"].lower()])


def fit_limits(
    mib: float, bytes_per_id: int, max_train: int | None, max_heldout: int | None
) -> tuple[int, int]:
    """Training and held-out token limits whose id files and manifest fit ``mib`` MiB: the held-out
    side takes ``max_heldout`` (else 1/32), the training side the rest (or ``max_train`` if smaller)."""
    total = (int(mib * (1 << 20)) - MANIFEST_RESERVE) // bytes_per_id
    heldout = max_heldout if max_heldout is not None else total // FIT_HELDOUT_SHARE
    if total < 1 or heldout >= total:
        raise ConfigError(
            f"--fit-mib {mib:g} holds {max(total, 0):,} tokens at {8 * bytes_per_id} bits, and {heldout:,} of them would be held out",
            "raise --fit-mib or lower --heldout-tokens",
        )
    train = total - heldout if max_train is None else min(max_train, total - heldout)
    return train, heldout
