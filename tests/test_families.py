"""Every supported teacher family, end to end through the command line (in-process ``main``):

    tiny random teacher + tokenizer saved to a directory
    → ``attn2ssm convert``  → ``attn2ssm distill`` (attention transfer + KD, a handful of tokens)
    → the saved student reloaded where attn2ssm cannot be imported (trust_remote_code):
      same logits, and ``generate`` with its cache = greedy by full forwards
    → ``attn2ssm generate --compile`` (CPU decode mode: the decode plan, its compiled step traced
      with a counting backend instead of inductor) prints the full-forward greedy text.

The README's list of supported families is exactly the families this file passes. Families whose
layers the one-token decode plan does not run (parallel residuals, no ``layers`` + ``norm``:
Phi, GPT-NeoX, GPT-2) decode through HF's forward, and ``--compile`` says why it cannot compile.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import attn2ssm.student  # noqa: F401  (registers the Auto classes)
from attn2ssm.cli import main
from attn2ssm.decode import compiled as compiled_step
from attn2ssm.decode.plan import DecodePlan
from cache_forms import greedy_by_full_forwards, run_remote
from tiny_models import make_tokenizer, tiny_config

FAMILIES = ["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3", "phi", "gpt_neox", "gpt2"]
PLANNED = {"llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3"}  # pre-norm or sandwich-norm layers
PROMPT = "Call me Ishmael. Some years ago"
NEW_TOKENS = 6

RECIPE = """\
name: family-matrix
seed: 0
data: {block_len: 16, max_heldout_tokens: 256}
student:
  mixer: linear_attention
  mixer_options: {feature_map: hedgehog}
stages:
  - {name: transfer, kind: attention_transfer, tokens: 64, batch_size: 2, trainable: [feature_maps],
     losses: {attention: 1.0, attention_form: soft_ce}, optim: {lr: 1.0e-2}, save_every: 2}
  - {name: kd, kind: kd, tokens: 64, batch_size: 2, trainable: [lora, feature_maps], lora: {r: 4, alpha: 8},
     optim: {lr: 1.0e-3}, save_every: 2}
eval: {max_tokens: 128}
"""

PARAGRAPHS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.",
    "Fellow citizens of the Senate and House of Representatives, the state of the Union is strong.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
]

# In a process without attn2ssm: logits of fixed ids, greedy through generate's cache and by full forwards.
REMOTE = r"""
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
ids = torch.tensor(IDS)
with torch.no_grad():
    logits = m(input_ids=ids, use_cache=False).logits
    m.generation_config.eos_token_id = None  # NEW tokens whatever they are, as the full forwards make
    cached = m.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(NEW):
        seq = torch.cat([seq, m(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
print(json.dumps({"module": type(m).__module__, "logits": logits.tolist(), "cached": cached.tolist(), "full": seq.tolist()}))
"""


class CountingBackend:
    """A dynamo backend that counts traces and calls and runs each traced graph as it is (no inductor)."""

    def __init__(self):
        self.traces = self.calls = 0

    def __call__(self, graph_module, example_inputs):
        self.traces += 1

        def run(*args):
            self.calls += 1
            return graph_module.forward(*args)

        return run


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(PARAGRAPHS[i % 4] for i in range(60)) + "\n")
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    return root, corpus, recipe


def _teacher_dir(family: str, path):
    tok = make_tokenizer()
    cfg = tiny_config(family)
    cfg.vocab_size = len(tok)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the tiny tokenizer's one special token
        setattr(cfg, name, tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def _until_eos(tokens: list[int], eos) -> list[int]:
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_converts_distils_reloads_and_generates(family, workspace, monkeypatch, capsys):
    root, corpus, recipe = workspace
    teacher, tok = _teacher_dir(family, root / f"{family}-teacher")

    converted = root / f"{family}-converted"
    assert (
        main(
            [
                "convert",
                "--teacher",
                str(teacher),
                "--out",
                str(converted),
                "--option",
                "feature_map=hedgehog",
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert json.loads((converted / "config.json").read_text())["layer_plan"] == ["linear_attention"] * 2

    run = root / f"{family}-run"
    assert (
        main(
            [
                "distill",
                str(recipe),
                "--out",
                str(run),
                "--no-progress",
                "--set",
                f"teacher={teacher}",
                "--set",
                f"data.corpus={corpus}",
            ]
        )
        == 0
    ), capsys.readouterr().err
    results = json.loads((run / "results.json").read_text())
    assert math.isfinite(results["student_ppl"]) and math.isfinite(results["teacher_ppl"])
    student_dir = run / "student"

    # reloaded without attn2ssm: the same logits, and its cached greedy is its full-forward greedy
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    ids = torch.tensor([tok(PROMPT).input_ids])
    remote = run_remote(f"NEW, IDS = {NEW_TOKENS}, {ids.tolist()}\n" + REMOTE, student_dir)
    assert remote["module"].startswith("transformers_modules")
    with torch.no_grad():
        torch.testing.assert_close(
            torch.tensor(remote["logits"]),
            student(input_ids=ids, use_cache=False).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    reference = greedy_by_full_forwards(student, ids, NEW_TOKENS)
    assert remote["full"] == reference.tolist()
    assert remote["cached"] == remote["full"]

    # the CLI, in CPU decode mode with the compiled step traced: the full-forward greedy text
    backend = CountingBackend()
    monkeypatch.setattr(compiled_step, "BACKEND", backend)
    plan_steps = []
    original_call = DecodePlan.__call__
    monkeypatch.setattr(
        DecodePlan, "__call__", lambda self, *a: plan_steps.append(1) or original_call(self, *a)
    )
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(student_dir),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(NEW_TOKENS),
                "--compile",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    new = _until_eos(reference[0, ids.shape[1] :].tolist(), student.generation_config.eos_token_id)
    assert out.strip() == tok.decode(new, skip_special_tokens=True).strip()
    if family in PLANNED:
        assert "decoding eagerly" not in err, err
        assert len(plan_steps) == len(new) - 1 + (len(new) < NEW_TOKENS)  # every token after the prefill's
        assert backend.traces == 1 and backend.calls == len(plan_steps)
    else:
        assert "--compile: decoding eagerly: no decode plan" in err and not plan_steps
