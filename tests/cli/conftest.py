"""The command-line tests' shared setup: tiny teachers and corpora (``ws``), and every run that loads
torch + transformers (``slow``). Such a run costs several seconds, so they all start at once in a
thread pool when the first test asks for one (session-scoped: the convert, distill, eval, generate and
recipes tests share them); the quick ones (errors raised before any heavy import) run inline.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from cli_run import run_cli

PARAGRAPHS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.",
    "Fellow citizens of the Senate and House of Representatives, the state of the Union is strong.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
]


@pytest.fixture(scope="session")
def ws(tmp_path_factory):
    """Tiny teachers and corpora, made once for tests/cli/."""
    import torch
    from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel

    from tiny_models import make_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("cli")
    tok = make_tokenizer()

    llama = root / "tiny-llama"  # a supported family whose context (64) is shorter than block_len 128
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    cfg.max_position_embeddings = 64
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(llama)
    tok.save_pretrained(llama)

    bert = root / "tiny-bert"  # a causal LM transformers knows but attn2ssm has no adapter for
    bert_cfg = BertConfig(
        is_decoder=True,
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    BertLMHeadModel(bert_cfg).save_pretrained(bert)
    tok.save_pretrained(bert)

    corpus = root / "corpus.txt"  # one document of many paragraphs: its last ~5% is held out
    corpus.write_text("\n\n".join(PARAGRAPHS[i % 4] for i in range(60)) + "\n")
    empty = root / "empty.txt"
    empty.write_text("  \n\n\t \n")
    one_paragraph = root / "one-paragraph.txt"  # one short paragraph: the held-out cut leaves only "\n"
    one_paragraph.write_text(" ".join(PARAGRAPHS) + "\n\n")
    truncated_gguf = root / "truncated.gguf"  # the magic bytes and a version, then the file ends
    truncated_gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    return SimpleNamespace(
        root=root,
        llama=llama,
        bert=bert,
        corpus=corpus,
        empty=empty,
        one_paragraph=one_paragraph,
        truncated_gguf=truncated_gguf,
    )


@pytest.fixture(scope="session")
def slow(ws):
    """name -> Future[CompletedProcess] for every run that loads torch/transformers, all started now."""
    out = ws.root / "out"
    student = out / "student"
    cases = {
        "unsupported": ["convert", "--teacher", ws.bert, "--out", out / "bert-student"],
        "block_len": [
            "distill",
            "--teacher",
            ws.llama,
            "--out",
            out / "run-block",
            "--no-progress",
            "--set",
            f"data.corpus={ws.corpus}",
            "--set",
            "data.block_len=128",
        ],
        "empty_corpus": [
            "distill",
            "--teacher",
            ws.llama,
            "--out",
            out / "run-empty",
            "--no-progress",
            "--set",
            f"data.corpus={ws.empty}",
            "--set",
            "data.block_len=16",
            "--set",
            "eval.window=16",
        ],
        "keep_attention": [
            "distill",
            "--teacher",
            ws.llama,
            "--out",
            out / "run-keep",
            "--no-progress",
            "--set",
            f"data.corpus={ws.corpus}",
            "--set",
            "data.block_len=16",
            "--set",
            "eval.window=16",
            "--set",
            "student.keep_attention=[5]",
        ],
        "truncated_gguf": ["convert", "--teacher", ws.truncated_gguf, "--out", out / "gguf-student"],
        # relative, one slash: also a hub id
        "generate_no_folder": ["generate", "runs/no-such-run-attn2ssm-test", "--prompt", "hi"],
        "recipes": ["recipes"],
        "recipe_quickstart": ["recipes", "quickstart"],
    }
    after_convert = {
        "eval": ["eval", student, "--corpus", ws.corpus, "--window", "16", "--max-tokens", "200"],
        "generate": ["generate", student, "--prompt", "hello", "--max-new-tokens", "5"],
        "eval_damaged": [
            "eval",
            out / "damaged-student",
            "--corpus",
            ws.corpus,
            "--window",
            "16",
            "--max-tokens",
            "200",
        ],
        "generate_draft": [
            "generate",
            student,
            "--draft",
            ws.llama,
            "--prompt",
            "hello",
            "--max-new-tokens",
            "6",
            "--num-draft-tokens",
            "3",
        ],
    }
    pool = ThreadPoolExecutor(max_workers=4)
    futures: dict[str, Future] = {name: Future() for name in after_convert}

    def settle(future: Future, args) -> None:
        try:
            future.set_result(run_cli(*args))
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting test)
            future.set_exception(exc)

    def convert_then_use():
        result = run_cli("convert", "--teacher", ws.llama, "--attention-ratio", "0.5", "--out", student)
        if result.returncode == 0:  # a copy whose weights file was cut short, as by an interrupted download
            shutil.copytree(student, out / "damaged-student")
            os.truncate(out / "damaged-student" / "model.safetensors", 10_000)
        for name, args in after_convert.items():
            pool.submit(settle, futures[name], args)
        return result

    futures["convert"] = pool.submit(convert_then_use)  # the longest chain starts first
    futures.update({name: pool.submit(run_cli, *args) for name, args in cases.items()})
    futures["student_dir"] = student
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
