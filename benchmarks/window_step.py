"""Decode speed of windowed linear-attention students with and without the window's one-token step.

    python benchmarks/window_step.py --out benchmarks/results/window_step.json

A linear-attention layer with a softmax window decodes a token, once the context has filled its
window, through ``window_linear_attention_step`` (the window's softmax terms and the sums of the
older keys). Before that step existed, every one-token call ran the block form over a block of one
token (``window_linear_attention``: the window cache concatenated, masks and distances built, the
linear weights computed and masked out). This script times both on the same prefilled cache, the
forms taking turns in every round: the long-context recipes' untrained students (their
architecture exactly; decode speed does not depend on the weights) in the CPU decode layout, greedy,
``--new-tokens`` a round, tokens/s = 1 / the median token time. Both forms must give the same
tokens (checked). Run it alone on the machine: the rates are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bar_chart, run_info, write_json  # noqa: E402  (benchmarks/ on sys.path first)

FORMS = ("window step", "block form")


@contextlib.contextmanager
def block_form_only():
    """Every windowed linear-attention layer decodes through its block form (no one-token step),
    as before the window step: ``can_step`` says no for a softmax window."""
    from attn2ssm.mixers.linear_attention import LinearAttentionMixer

    own = LinearAttentionMixer.can_step

    def no_window_step(self, layer):
        return False if self.window and self.branch != "linear" else own(self, layer)

    LinearAttentionMixer.can_step = no_window_step
    try:
        yield
    finally:
        LinearAttentionMixer.can_step = own


def time_forms(model, prompt, new_tokens: int, rounds: int) -> dict:
    """Each form's token times over ``rounds`` rounds from one prefilled cache, taking turns."""
    from attn2ssm.bench.generate.timing import decode_round, prefill, warm_up

    warm_up(model, prompt)
    with block_form_only():
        warm_up(model, prompt)
    pre = prefill(model, prompt)
    seconds: dict[str, list[float]] = {f: [] for f in FORMS}
    tokens: dict[str, list] = {}
    for _ in range(rounds):
        for form in FORMS:
            with block_form_only() if form == "block form" else contextlib.nullcontext():
                r = decode_round(model, pre, new_tokens)
            seconds[form] += r["seconds"]
            tokens.setdefault(form, r["tokens"])
    if tokens["window step"] != tokens["block form"]:
        raise AssertionError(f"the two forms decoded different tokens: {tokens}")
    rate = {f: 1 / statistics.median(s) for f, s in seconds.items()}
    return {
        "tokens_per_second": rate,
        "speedup": rate["window step"] / rate["block form"],
        "token_seconds": seconds,
        "tokens": tokens["window step"],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from attn2ssm.bench.generate.models import build_models, prompt_ids
    from attn2ssm.decode.layout import cpu_decode_layout
    from attn2ssm.teachers import load_teacher

    torch.set_num_threads(args.threads)
    teacher, tokenizer, _ = load_teacher(args.teacher, device="cpu")
    models = build_models(teacher, args.models.split(","), torch.device("cpu"))
    prompt = prompt_ids(tokenizer, args.corpus, args.context, torch.device("cpu"))
    results = {}
    with torch.no_grad():
        for name, model in models.items():
            cpu_decode_layout(model)
            results[name] = time_forms(model, prompt, args.new_tokens, args.rounds)
            rate = results[name]["tokens_per_second"]
            print(
                f"{name}: window step {rate['window step']:.2f} tokens/s, block form "
                f"{rate['block form']:.2f} ({results[name]['speedup']:.2f}x)",
                flush=True,
            )
    data = {
        **run_info("benchmarks/window_step.py", argv if argv is not None else sys.argv[1:]),
        "settings": vars(args),
        "models": results,
    }
    out = Path(args.out)
    write_json(out, data)
    names = list(results)
    panels = [
        {"values": [results[n]["tokens_per_second"][f] for n in names], "ylabel": "tokens/s", "title": f}
        for f in FORMS
    ]
    bar_chart(
        out.with_suffix(".png"), names, panels, f"decode at {args.context} tokens, {args.threads} threads"
    )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return data


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--models", default="linear_hybrid25,retrieval_heads", help="bench generate's model names")
    p.add_argument(
        "--corpus", default="sotu", help="text the prompt is cut from (a built-in corpus or a file)"
    )
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (past the window: the step runs)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/window_step.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
