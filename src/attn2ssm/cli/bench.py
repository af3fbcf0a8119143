"""``attn2ssm bench generate | quality | train``: the group; each benchmark's parser and run live in
its own module (``bench_generate`` with ``bench_generate_flags``, ``bench_quality``, ``bench_train``):
its flags checked into its settings (one-line errors, before any model loads), then the run in
``attn2ssm.bench``."""

from __future__ import annotations

from attn2ssm.cli import bench_generate, bench_quality, bench_train


def add_parser(subparsers) -> None:
    b = subparsers.add_parser(
        "bench",
        help="benchmarks (generate: decode speed / memory vs context, speculative decoding; quality: the family × budget scoreboard)",
    )
    bsub = b.add_subparsers(dest="bench", required=True)
    bench_generate.add_parser(bsub)
    bench_quality.add_parser(bsub)
    bench_train.add_parser(bsub)
