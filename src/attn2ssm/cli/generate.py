"""``attn2ssm generate``: text from a student or teacher, streamed; speculative with --draft."""

from __future__ import annotations

import sys

from attn2ssm.cli.parsing import draft_tokens
from attn2ssm.errors import ConfigError


def add_parser(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate text with a student or teacher")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--echo", action="store_true", help="print the prompt too")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--draft",
        default=None,
        help="speculative decoding: 'ngram' (prompt lookup, no model) or a draft model (student dir or teacher "
        "spec, same tokenizer) proposes tokens that MODEL verifies",
    )
    g.add_argument(
        "--num-draft-tokens",
        default="auto",
        help="with --draft: tokens proposed per verifier forward, or auto (default: "
        "chosen each round from the acceptance and round times measured so far, 0 where drafting does not pay)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="CPU, pure students: run the decode step as one torch.compile'd function (~1.5x faster a token; the first step compiles, about a minute on 2 cores)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        help="weights and activations: float32 or bfloat16 (SSM decay, skip and dt bias stay float32)",
    )
    g.add_argument(
        "--quantize",
        default=None,
        help="int8: linear weights int8 with per-channel scales (weight-only; activations in --dtype)",
    )
    g.set_defaults(func=run)


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} generates nothing",
            "ask for at least 1 token, e.g. --max-new-tokens 64",
        )
    from attn2ssm.generation.sampling import check_sampling  # heavy: torch

    # 0 = greedy; a negative one is not
    check_sampling(args.temperature, args.top_k, args.top_p, cli=True)
    num_draft_tokens = draft_tokens("--num-draft-tokens", args.num_draft_tokens)
    check_prompt_text(args.prompt)
    import torch  # heavy: torch
    from transformers import TextStreamer  # heavy: transformers

    from attn2ssm.decode.layout import cpu_decode_layout  # heavy: torch + transformers
    from attn2ssm.decode.quantize import apply_weight_format, check_weight_format  # heavy: torch
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: torch + transformers

    # a bad --dtype / --quantize: one line, before anything loads
    check_weight_format(args.dtype, args.quantize)
    model, tokenizer = load_model_and_tokenizer(args.model)
    # before the layout: it fuses what is still a plain linear
    apply_weight_format(model, args.dtype, args.quantize)
    cpu_decode_layout(model, compile=args.compile)  # faster one-token steps on CPU (a no-op elsewhere)
    if args.compile and getattr(model, "compiled_step_reason", ""):
        print(f"--compile: decoding eagerly: {model.compiled_step_reason}", file=sys.stderr)
    inputs = _prompt_inputs(args, tokenizer)
    _check_positions(model, args.model, inputs["input_ids"].shape[1], args.max_new_tokens)
    sample = args.temperature > 0
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=not args.echo, skip_special_tokens=True)
    if args.draft is None:
        model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=sample,
            temperature=args.temperature if sample else None,
            top_p=args.top_p if sample else None,
            top_k=args.top_k if sample else None,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id,
        )
        return 0
    _speculative(args, model, tokenizer, inputs, num_draft_tokens, streamer)
    return 0


def check_prompt_text(prompt: str) -> None:
    """Refuse a --prompt that is not UTF-8 text (the shell passed bytes Python could not decode; they
    arrive as lone surrogates, which no tokenizer takes), naming the first bad byte and where it is."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = prompt.encode("utf-8", "surrogateescape")
        try:
            raw.decode("utf-8")
            where = f"character {exc.start}"  # a lone surrogate that was not a byte (Python callers)
        except UnicodeDecodeError as bad:
            where = f"byte 0x{raw[bad.start]:02x} at offset {bad.start}"
        raise ConfigError(
            f"--prompt is not UTF-8 text ({where})",
            "pass the prompt in UTF-8 (e.g. convert it with iconv -t UTF-8)",
        ) from None


def _prompt_inputs(args, tokenizer) -> dict:
    """--prompt tokenized (in the chat template with --chat); an empty one starts from BOS."""
    import torch  # heavy: torch

    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = args.prompt
    # (a prompt past the model's positions is refused below, in one line)
    inputs = tokenizer(text, return_tensors="pt", verbose=False)
    if inputs["input_ids"].shape[1] == 0:  # an empty prompt, with a tokenizer that adds no BOS
        if tokenizer.bos_token_id is None:
            raise ConfigError(
                f"--prompt {args.prompt!r} gives no tokens and the tokenizer of {args.model} has no BOS token to start from",
                "give a prompt of at least one token, e.g. --prompt 'The'",
            )
        ids = torch.tensor([[tokenizer.bos_token_id]])  # start where a document starts
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return inputs


def _speculative(args, model, tokenizer, inputs: dict, num_draft_tokens: int | str, streamer) -> None:
    """--draft: MODEL verifies what the draft (prompt lookup or a model) proposes; stats on stderr."""
    import torch  # heavy: torch

    from attn2ssm.decode.layout import cpu_decode_layout  # heavy: torch + transformers
    from attn2ssm.generation.speculative import speculative_generate  # heavy: torch + transformers
    from attn2ssm.student.loading import load_model_and_tokenizer  # heavy: torch + transformers

    sample = args.temperature > 0
    if args.draft.startswith("ngram"):
        draft = args.draft  # prompt lookup: no model
    else:
        draft, _ = load_model_and_tokenizer(args.draft)
        _check_positions(draft, f"--draft {args.draft}", inputs["input_ids"].shape[1], args.max_new_tokens)
        cpu_decode_layout(draft)
    out = speculative_generate(
        model,
        draft,
        inputs["input_ids"],
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        do_sample=sample,
        temperature=args.temperature if sample else 1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator().manual_seed(args.seed),
        streamer=streamer,
    )
    s = out.stats
    print(
        f"[speculative] {s.generated} tokens in {s.rounds} target forwards ({s.tokens_per_round:.2f} per forward); "
        f"draft acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted}); "
        f"draft {s.draft_seconds:.1f}s, verify {s.verify_seconds:.1f}s",
        file=sys.stderr,
    )


def _check_positions(model, name: str, prompt: int, new: int) -> None:
    """Refuse a prompt + new tokens longer than ``model`` reads positions for (an attention model's
    output past them is garbage; a student with no positions at all has no limit)."""
    from attn2ssm.student.loading import position_limit  # heavy: torch + transformers

    limit = position_limit(model.config)
    if limit is not None and prompt + new > limit:
        fix = (
            f"lower --max-new-tokens to {limit - prompt} or less, or shorten the prompt"
            if prompt < limit
            else f"shorten the prompt to fewer than {limit} tokens"
        )
        raise ConfigError(
            f"the prompt ({prompt} tokens) and --max-new-tokens {new} need {prompt + new} positions; {name} reads at most {limit}",
            fix,
        )
