"""Tiny random teachers for every supported family, built in code (never downloaded).

``TINY_CONFIGS[family]()`` returns a fresh transformers config small enough for CPU tests
(hidden 64, 2 layers, vocab 256) that still exercises what makes the family special: GQA,
sliding-window layers with a window (4) shorter than test sequences, soft-capping, q/k
norms, partial RoPE. ``VARIANT_CONFIGS`` holds extra shapes of the same families (keys are
not family names; ``get_adapter`` maps them to the family in the comment).

Weights are drawn with ``initializer_range=0.2`` rather than the usual 0.02: at 0.02 a tiny
model's attention is almost uniform, and a wrong scale or mask would hide inside tolerances.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 256
HIDDEN = 64
LAYERS = 2
INIT_STD = 0.2
SLIDING_WINDOW = 4
# The recipe trainer tests start from (with the tiny teacher and data as overrides): the plain
# Hedgehog conversion, so the built-in recipes can be tuned without moving the tests.
BASE_RECIPE = str(Path(__file__).parent / "fixtures" / "base_recipe.yaml")

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    max_position_embeddings=128,
    initializer_range=INIT_STD,
    attn_implementation="eager",
)
_LLAMA_LIKE = dict(_COMMON, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
_GEMMA = dict(_LLAMA_LIKE, head_dim=16, pad_token_id=0, bos_token_id=2, eos_token_id=1)
_LOCAL_GLOBAL = ["sliding_attention", "full_attention"]


def llama() -> LlamaConfig:
    return LlamaConfig(**_LLAMA_LIKE)


def mistral() -> MistralConfig:
    return MistralConfig(**_LLAMA_LIKE, sliding_window=SLIDING_WINDOW)  # every layer windowed


def qwen2() -> Qwen2Config:
    # use_sliding_window + max_window_layers=1: layer 0 global, layer 1 sliding.
    return Qwen2Config(
        **_LLAMA_LIKE, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1
    )


def gemma() -> GemmaConfig:
    return GemmaConfig(**dict(_GEMMA, num_key_value_heads=1))  # multi-query, like gemma-2b


def gemma2() -> Gemma2Config:
    return Gemma2Config(
        **_GEMMA,
        query_pre_attn_scalar=24,  # != head_dim, so the scaling rule is tested
        attn_logit_softcapping=2.0,  # small enough to bend these logits
        final_logit_softcapping=30.0,
        sliding_window=SLIDING_WINDOW,
        layer_types=_LOCAL_GLOBAL,
    )


def gemma3() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        **_GEMMA,
        query_pre_attn_scalar=24,
        sliding_window=SLIDING_WINDOW,
        layer_types=_LOCAL_GLOBAL,  # local layer: RoPE base 10k, global layer: 1M
    )


def phi() -> PhiConfig:
    return PhiConfig(**_LLAMA_LIKE, partial_rotary_factor=0.5)  # rotary_dim 8 of head_dim 16


def gpt_neox() -> GPTNeoXConfig:
    return GPTNeoXConfig(**_COMMON, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25)


def gpt2() -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=128,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,  # defaults (50256) lie outside the tiny vocab
        initializer_range=INIT_STD,
        attn_implementation="eager",
    )


TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "phi": phi,
    "gpt_neox": gpt_neox,
    "gpt2": gpt2,
}


def smollm2() -> LlamaConfig:
    """SmolLM2 shape (model_type "llama"): 3 query heads per kv head, tied embeddings."""
    return LlamaConfig(
        **dict(_LLAMA_LIKE, hidden_size=48, num_attention_heads=3, num_key_value_heads=1),
        tie_word_embeddings=True,
    )


def gqa_9x3() -> LlamaConfig:
    """SmolLM2-135M's head layout (9 query heads over 3 kv heads) at head_dim 8."""
    return LlamaConfig(**dict(_LLAMA_LIKE, hidden_size=72, num_attention_heads=9, num_key_value_heads=3))


def phi_qk_layernorm() -> PhiConfig:
    cfg = phi()
    cfg.qk_layernorm = True
    return cfg


def gpt2_layer_scaled() -> GPT2Config:
    cfg = gpt2()
    cfg.scale_attn_by_inverse_layer_idx = True
    cfg.reorder_and_upcast_attn = True
    return cfg


VARIANT_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "smollm2": smollm2,  # family llama
    "gqa_9x3": gqa_9x3,  # family llama
    "phi_qk_layernorm": phi_qk_layernorm,  # family phi
    "gpt2_layer_scaled": gpt2_layer_scaled,  # family gpt2
}


def tiny_config(name: str) -> PretrainedConfig:
    """A fresh config for a family in TINY_CONFIGS or a variant in VARIANT_CONFIGS."""
    try:
        return {**TINY_CONFIGS, **VARIANT_CONFIGS}[name]()
    except KeyError:
        raise KeyError(
            f"no tiny config {name!r}; have {sorted(TINY_CONFIGS) + sorted(VARIANT_CONFIGS)}"
        ) from None


def tiny_model(
    family: str,
    seed: int = 0,
    layers: int | None = None,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    max_positions: int | None = None,
) -> torch.nn.Module:
    """A randomly initialised CausalLM for ``family`` (or a variant): fp32, eval mode, eager attention.

    ``layers`` sets the depth (a family's per-layer ``layer_types`` repeated to that many layers);
    ``tokenizer`` sizes the vocabulary to it and makes its end-of-text the bos, eos and pad token (a
    teacher to save beside it); ``max_positions`` sets ``max_position_embeddings``."""
    config = tiny_config(family)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = (config.layer_types * layers)[:layers]
    if tokenizer is not None:
        config.vocab_size = len(tokenizer)
        config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    if max_positions is not None:
        config.max_position_embeddings = max_positions
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.float().eval()


def tiny_student(family: str, kind: str, ratio: float = 0.0, options: dict | None = None) -> torch.nn.Module:
    """``tiny_model(family)`` converted to ``kind`` mixers (keeping ``ratio`` of the layers as
    attention), in eval mode, with the mixers' new parameters (decay, conv, gate …) moved off their
    identity init so a wrongly carried or restored state cannot hide behind an identity map."""
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    torch.manual_seed(0)
    teacher = tiny_model(family)
    student = convert(
        teacher,
        make_plan(teacher.config.num_hidden_layers, kind, attention_ratio=ratio),
        {kind: options or {}},
    )
    perturb_new_mixer_parameters(student)
    return student.eval()


@torch.no_grad()
def perturb_new_mixer_parameters(student, scale: float = 0.1) -> None:
    """Move every mixer parameter that attention did not provide (all but q/k/v/o) off its init
    by ``scale``·N(0, 1), drawing from the current RNG state."""
    for mixer in student.mixers().values():
        for name, p in mixer.named_parameters():
            if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                p.add_(scale * torch.randn_like(p))


def one_line_error(capsys, argv) -> str:
    """Run the CLI on ``argv``; assert it exits 2 with one ``error: …`` line on stderr; return it."""
    from attn2ssm.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


SENTENCES = [
    "Call me Ishmael. Some years ago, never mind how long precisely.",
    "Fellow citizens of the Senate and House of Representatives.",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
] * 4


def make_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on a few sentences; any text encodes, no network."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", model_max_length=64)


def write_sentence_corpus(folder: Path, n_docs: int = 40) -> Path:
    """A corpus directory of ``n_docs`` short documents made of SENTENCES (what ``eval --corpus``
    reads). Returns ``folder``."""
    folder.mkdir()
    for i in range(n_docs):
        (folder / f"d{i}.txt").write_text(" ".join(SENTENCES[i % 4 :] * 3))
    return folder


def save_tiny_teacher(path, family: str = "llama", max_positions: int | None = None) -> torch.nn.Module:
    """A tiny random ``family`` teacher (seed 0) over ``make_tokenizer``'s vocabulary, saved with that
    tokenizer in ``path`` (config, weights, tokenizer: a directory ``--teacher`` takes). Returns it.
    ``max_positions`` sets ``max_position_embeddings``."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    cfg = tiny_config(family)
    cfg.vocab_size = len(tok)
    if max_positions is not None:
        cfg.max_position_embeddings = max_positions
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cfg)
    teacher.save_pretrained(path)
    tok.save_pretrained(path)
    return teacher


def save_tiny_teacher_and_corpus(tmp_path):
    """A tiny random Llama teacher (+ tokenizer) saved under tmp_path/teacher and a small text
    corpus file: the inputs the CLI benchmarks take. Returns (teacher dir, corpus path)."""
    save_tiny_teacher(tmp_path / "teacher")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(SENTENCES))
    return tmp_path / "teacher", corpus


# ------------------------------------------------------------------- a tiny corpus and a distill run on it
WORDS = (
    "the union state people congress nation government year war peace law work children future "
    "america world economy freedom trade tax health security jobs energy history hope country we our"
).split()


def write_corpus(root, n_docs=24, words_per_doc=400, seed=0):
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (root / f"doc{i:02d}.txt").write_text(text.capitalize() + ".\n")
    return root


def tiny_overrides(teacher_dir, corpus_dir, **extra):
    """--set strings for a fast two-stage run on the tiny setup."""
    sets = {
        "teacher": str(teacher_dir),
        "data.corpus": str(corpus_dir),
        "data.block_len": 32,
        "data.max_heldout_tokens": 2000,
        "eval.max_tokens": 512,
        "stages": "[{name: kd, kind: kd, tokens: 1536, batch_size: 4, save_every: 3, eval_every: 4, optim: {lr: 0.01}},"
        " {name: ce, kind: ce, tokens: 768, batch_size: 4, grad_accum: 2, trainable: [all], save_every: 3, optim: {lr: 0.001},"
        " schedule: {kind: wsd}},"
        " {name: lora, kind: ce, tokens: 384, batch_size: 4, trainable: [lora], lora: {r: 4, alpha: 8}, save_every: 1, optim: {lr: 0.01}}]",
    }
    sets.update(extra)
    return [f"{k}={v}" for k, v in sets.items()]


# ------------------------------------------------------------------------- a distill run killed, and resumed
class Crash(Exception):
    """What ``crash_after`` raises: the run dies there, as if killed."""


def crash_after(monkeypatch, n: int, method: str = "_save_checkpoint") -> None:
    """``Distiller.<method>`` raises Crash right after its n-th call (``monkeypatch.undo()`` lifts it)."""
    import attn2ssm.distill.trainer as T

    original, calls = getattr(T.Distiller, method), {"n": 0}

    def then_crash(self, *args, **kwargs):
        original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:
            raise Crash

    monkeypatch.setattr(T.Distiller, method, then_crash)


def assert_same_student(reference: Path, run: Path) -> None:
    """The two runs' final students hold the same tensors (1e-6): a resumed run is the uninterrupted one."""
    from safetensors.torch import load_file

    a, b = (
        load_file(reference / "student" / "model.safetensors"),
        load_file(run / "student" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6, msg=name)
