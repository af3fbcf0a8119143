"""The ``attn2ssm`` command line, run as a user runs it: ``python -m attn2ssm …`` in a subprocess.

The product rule under test: bad input ends with exit code 2 and exactly one stderr line
``error: <problem> — <fix>``, never a traceback (unless ``--debug``).

Every run is offline (HF_HUB_OFFLINE=1) and uses this session's private ATTN2SSM_CACHE. A run
that imports torch + transformers costs several seconds, so the slow runs are started all at
once in a thread pool when the module's first test asks for them; the quick ones (errors raised
before any heavy import) run inline.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

TIMEOUT = 300


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert env.get("ATTN2SSM_CACHE"), "conftest gives every session a private ATTN2SSM_CACHE"
    return subprocess.run(
        [sys.executable, "-m", "attn2ssm", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, stderr is exactly one line ``error: …`` containing every needle, no traceback."""
    where = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 2, where
    assert "Traceback" not in result.stderr, where
    lines = result.stderr.splitlines()
    assert len(lines) == 1, where
    line = lines[0]
    assert line.startswith("error: "), where
    assert " — " in line, f"no fix given: {line}"  # Attn2SSMError's "<problem> — <fix>"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


# ---------------------------------------------------------------------------------- fixtures


PARAGRAPHS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money in my purse.",
    "Fellow citizens of the Senate and House of Representatives, the state of the Union is strong.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Tiny teachers and corpora, made once per module."""
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


@pytest.fixture(scope="module")
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
        "generate_no_folder": [
            "generate",
            "runs/no-such-run-attn2ssm-test",
            "--prompt",
            "hi",
        ],  # relative, one slash: also a hub id
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


def result_of(slow, name: str) -> subprocess.CompletedProcess:
    return slow[name].result(timeout=TIMEOUT * 2)


# ------------------------------------------------------------------- 1. teacher paths (quick)


def test_missing_teacher_dir(tmp_path):
    r = run_cli("convert", "--teacher", "/nope/dir", "--out", tmp_path / "x")
    assert_one_line_error(r, "teacher path not found", "/nope/dir", "check the path")
    assert not (tmp_path / "x").exists()


def test_missing_gguf_file(tmp_path):
    r = run_cli("convert", "--teacher", tmp_path / "model.gguf", "--out", tmp_path / "x")
    assert_one_line_error(r, "GGUF file not found", str(tmp_path / "model.gguf"), "smollm2-135m")


def test_distill_with_missing_teacher_fails_fast(tmp_path):
    r = run_cli("distill", "--teacher", "/nope/dir", "--out", tmp_path / "run")
    assert_one_line_error(r, "teacher path not found", "/nope/dir")


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--keep", "a,b", "--keep 'a,b'"),
        ("--option", "feature_map", "--option 'feature_map' is not key=value"),
    ],
)
def test_convert_flag_syntax(tmp_path, flag, value, needle):
    r = run_cli("convert", "--teacher", "/nope/dir", flag, value, "--out", tmp_path / "x")
    assert_one_line_error(r, needle)  # checked before the teacher is even looked at


# ------------------------------------------------------------------------ 3. recipes (quick)


def test_unknown_stage_key_lists_valid_keys():
    r = run_cli("distill", "--set", "stages.0.nonsense=1")
    line = assert_one_line_error(r, "unknown key 'nonsense'", "recipe.stages[0]", "valid keys:")
    for key in ("tokens", "batch_size", "optim", "schedule"):
        assert key in line


def test_misspelt_data_key_lists_valid_keys():
    r = run_cli("distill", "--set", "data.blokc_len=5")
    assert_one_line_error(r, "unknown key 'blokc_len'", "recipe.data", "valid keys:", "block_len", "corpus")


@pytest.mark.parametrize(
    ("override", "needle"),
    [("data.block_len", "has no '='"), ("stages.9.tokens=1", "is not an index of a list of")],
)
def test_malformed_overrides(override, needle):
    assert_one_line_error(run_cli("distill", "--set", override), needle)


def test_negative_learning_rate_fails_before_the_teacher_loads(tmp_path):
    r = run_cli("distill", "mamba2_pure", "--out", tmp_path / "run", "--set", "stages.0.optim.lr=-1")
    assert_one_line_error(r, "optim.lr=-1.0 is out of range", "stages.0.optim.lr")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("student.mixer=mamba3", "student.mixer='mamba3' is not a mixer"),
        ("student.attention_ratio=1.5", "student.attention_ratio=1.5 is outside [0, 1]"),
    ],
)
def test_student_plan_errors_fail_before_the_teacher_loads(tmp_path, override, needle):
    r = run_cli("distill", "mamba2_pure", "--out", tmp_path / "run", "--set", override)
    assert_one_line_error(r, needle)
    assert not (tmp_path / "run").exists()


def test_unknown_recipe_name():
    r = run_cli("distill", "quikstart")
    assert_one_line_error(r, "no recipe 'quikstart'", "quickstart")


def test_missing_recipe_yaml(tmp_path):
    path = tmp_path / "nope.yaml"
    r = run_cli("distill", path)
    assert_one_line_error(r, "config file not found", str(path), "attn2ssm recipes")


def test_malformed_recipe_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages: [\n")
    r = run_cli("distill", path, "--out", tmp_path / "run")
    assert_one_line_error(r, str(path), "not valid YAML", "line 3")
    assert not (tmp_path / "run").exists()


def test_unknown_recipe_for_recipes_command():
    assert_one_line_error(run_cli("recipes", "nonexistent"), "no built-in recipe 'nonexistent'", "quickstart")


# ------------------------------------------------------ cheap checks before the heavy imports (quick)

BOTH = ("torch", "transformers")
CHEAP_ERRORS = [  # argv (OUT: a path in tmp_path), a needle of the error line, modules not imported by then
    (["convert", "--keep", "a", "--out", "OUT"], "--keep 'a'", BOTH),
    (["convert", "--teacher", "/nope/dir", "--out", "OUT"], "teacher path not found", BOTH),
    (["eval", "m", "--window", "1"], "--window 1 is too short", BOTH),
    (["eval", "m", "--tasks", "x", "--attention"], "different evaluations", BOTH),
    (["generate", "m", "--prompt", "x", "--max-new-tokens", "0"], "generates nothing", BOTH),
    (
        ["export", "m", "--format", "native", "--outtype", "f16", "--out", "OUT"],
        "--outtype is for --format gguf",
        BOTH,
    ),
    (["bench", "quality", "--corpora", ","], "names no corpus", BOTH),
    (["generate", "m", "--prompt", "x", "--temperature", "-1"], "--temperature", ("transformers",)),
    (["distill", "quikstart"], "no recipe 'quikstart'", ("transformers",)),
    (["bench", "train", "--precisions", "fp8"], "--precisions 'fp8'", ("transformers",)),
    (
        ["data", "shards", "sotu", "--out", str(Path(__file__).resolve().parent)],
        "already holds other files",
        BOTH,
    ),
    (["data", "shards", "generated:lots", "--out", "OUT"], "does not start with a number of tokens", BOTH),
    (["data", "shards", "/nope/corpus", "--out", "OUT"], "corpus path '/nope/corpus' does not exist", BOTH),
    (["data", "shards", "shards:/nope/shards", "--out", "OUT"], "holds no token shards", BOTH),
    (["data", "shards", "sotu", "--out", "OUT", "--teacher", "/nope/dir"], "teacher path not found", BOTH),
    (["data", "shards", "sotu", "--out", "OUT", "--teacher", "no-such-teacher"], "no built-in name", BOTH),
    (
        ["data", "shards", "sotu", "--out", "OUT", "--max-tokens", "lots"],
        "--max-tokens 'lots' is not a number of tokens",
        BOTH,
    ),
    (
        ["data", "shards", "sotu", "--out", "OUT", "--dtype", "bfloat16"],
        "--device and --dtype are for generated:",
        BOTH,
    ),
    (["data", "info", "OUT"], "holds no token shards", BOTH),
]


@pytest.mark.parametrize(
    ("argv", "needle", "not_imported"), [pytest.param(*case, id=" ".join(case[0])) for case in CHEAP_ERRORS]
)
def test_cheap_checks_fail_before_the_heavy_imports(tmp_path, argv, needle, not_imported):
    """A bad flag is one line in a fraction of a second: torch / transformers are not even imported."""
    code = (
        "import json, sys; from attn2ssm.cli import main; rc = main(sys.argv[1:]); "
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules))); sys.exit(rc)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [str(tmp_path / "x") if a == "OUT" else a for a in argv]
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=TIMEOUT
    )
    assert_one_line_error(r, needle)
    imported = json.loads(r.stdout.splitlines()[-1])
    assert not set(imported) & set(not_imported), f"{' '.join(argv)} imported {imported} before failing"


# ----------------------------------------------------------------------------- 8. --debug


def test_debug_shows_the_traceback(tmp_path):
    r = run_cli("--debug", "convert", "--teacher", "/nope/dir", "--out", tmp_path / "x")
    assert r.returncode not in (0, 2)
    assert "Traceback" in r.stderr
    assert "CheckpointError: teacher path not found: /nope/dir" in r.stderr


# ------------------------------------------------------------ 2, 4, 5. errors after loading


def test_unsupported_architecture_lists_supported_families(slow):
    line = assert_one_line_error(result_of(slow, "unsupported"), "model_type 'bert'", "supported families")
    for family in ("llama", "mistral", "qwen2", "gpt2"):
        assert family in line


def test_truncated_gguf_teacher(slow, ws):
    assert_one_line_error(result_of(slow, "truncated_gguf"), str(ws.truncated_gguf), "complete GGUF")
    assert not (ws.root / "out" / "gguf-student").exists()


def test_block_len_above_the_models_maximum(slow, ws):
    """Found from the teacher's config.json before the teacher or the corpus loads: no run directory."""
    assert_one_line_error(result_of(slow, "block_len"), "block length 128", "maximum of 64", "data.block_len")
    assert not (ws.root / "out" / "run-block").exists()


def test_keep_attention_beyond_the_teachers_layers(slow, ws):
    assert_one_line_error(
        result_of(slow, "keep_attention"), "keep_attention has layer indices [5] outside 0..1"
    )
    assert not (ws.root / "out" / "run-keep").exists()


def test_empty_corpus(slow, ws):
    assert_one_line_error(result_of(slow, "empty_corpus"), "empty corpus", str(ws.empty))
    assert not (
        ws.root / "out" / "run-empty"
    ).exists()  # a corpus that fails to load leaves no recipe.yaml behind


# ----------------------------------------------------------------------------- 9. recipes


def test_recipes_lists_quickstart(slow):
    r = result_of(slow, "recipes")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("quickstart") for line in r.stdout.splitlines()), r.stdout


def test_recipe_prints_parseable_yaml(slow):
    r = result_of(slow, "recipe_quickstart")
    assert r.returncode == 0, r.stderr
    data = yaml.safe_load(r.stdout)
    assert data["name"] == "quickstart"
    assert {"teacher", "data", "student", "stages", "eval"} <= set(data)
    from attn2ssm.distill.recipe import load_recipe

    assert [st["kind"] for st in data["stages"]] == [st.kind for st in load_recipe("quickstart").stages]


# ------------------------------------------------------------- 10. convert → eval → generate


def test_convert_writes_a_loadable_hybrid(slow):
    from transformers import AutoModelForCausalLM

    r = result_of(slow, "convert")
    assert r.returncode == 0, r.stderr
    assert "attention kept at [1]" in r.stdout  # the last layer of each group (Mamba in the Llama)
    out = Path(slow["student_dir"])
    plan = json.loads((out / "config.json").read_text())["layer_plan"]
    assert len(plan) == 2 and plan.count("attention") == 1 and plan.count("linear_attention") == 1
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_plan == plan


def test_eval_prints_perplexity(slow):
    r = result_of(slow, "eval")
    assert r.returncode == 0, r.stderr
    assert "held-out perplexity" in r.stdout
    model_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("model"))
    ppl = float(model_line.split()[1])
    assert ppl > 1.0 and math.isfinite(ppl)  # a random model scored on real held-out tokens


def test_eval_of_a_student_with_a_truncated_weights_file(slow):
    damaged = Path(slow["student_dir"]).parent / "damaged-student"
    assert_one_line_error(
        result_of(slow, "eval_damaged"), str(damaged / "model.safetensors"), "damaged or incomplete"
    )
    assert sorted(p.name for p in damaged.iterdir()) == sorted(
        p.name for p in Path(slow["student_dir"]).iterdir()
    )  # nothing added
    assert (damaged / "model.safetensors").stat().st_size == 10_000


def test_eval_refuses_a_corpus_without_held_out_text(slow, ws, capsys):
    """In-process (the model is already built): no held-out tokens is an error, not 'perplexity 1.00'."""
    from attn2ssm.cli import main
    from attn2ssm.data import load_documents, split_documents

    train, heldout = split_documents(load_documents(str(ws.one_paragraph)), str(ws.one_paragraph))
    assert train and not heldout, "precondition: this corpus must have no held-out text"
    assert result_of(slow, "convert").returncode == 0
    assert main(["eval", str(slow["student_dir"]), "--corpus", str(ws.one_paragraph), "--window", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no held-out text" in err[0], err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--window", "1"], "--window 1 is too short"),
        (["--window", "16", "--stride", "40"], "--stride 40 is outside 1..16"),
    ],
)
def test_eval_window_checks(flags, needle, capsys):
    """In-process: checked before the model is even looked for."""
    from attn2ssm.cli import main

    assert main(["eval", "/nope/model", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["generate", "STUDENT", "--prompt", "Call me Ishmael. " * 20, "--max-new-tokens", "5"],
            ("positions; ", "reads at most 64", "shorten the prompt to fewer than 64"),
        ),
        (
            ["generate", "STUDENT", "--prompt", "Call me", "--max-new-tokens", "100"],
            ("reads at most 64", "lower --max-new-tokens to"),
        ),
        (
            ["generate", "STUDENT", "--prompt", "Call me", "--draft", "LLAMA", "--max-new-tokens", "100"],
            ("reads at most 64",),
        ),
        (
            ["eval", "STUDENT", "--window", "100"],
            ("--window 100 is longer than", "at most 64", "use --window 64 or less"),
        ),
        (["eval", "STUDENT", "--against", "LLAMA", "--window", "100"], ("--window 100",)),
    ],
)
def test_lengths_past_the_models_positions_are_one_line(slow, ws, capsys, argv, needles):
    """In-process: the converted hybrid keeps an attention layer, so it reads at most the teacher's 64 positions."""
    from attn2ssm.cli import main

    assert result_of(slow, "convert").returncode == 0
    capsys.readouterr()
    argv = [{"STUDENT": str(slow["student_dir"]), "LLAMA": str(ws.llama)}.get(a, a) for a in argv]
    assert main([*argv, *(["--corpus", str(ws.corpus)] if argv[0] == "eval" else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: ")
        and " — " in err[0]
        and all(n in err[0] for n in needles)
    ), err
    assert not captured.out  # nothing generated


def test_generate_from_a_folder_that_does_not_exist(slow):
    """A relative path with one slash could be a hub id: the error says there is no such folder, and what a hub id needs."""
    line = assert_one_line_error(
        result_of(slow, "generate_no_folder"),
        "there is no local folder 'runs/no-such-run-attn2ssm-test'",
        "a hub id needs the network",
    )
    assert not line.startswith("error: could not load the teacher's tokenizer")


def test_eval_of_a_folder_without_a_model(tmp_path, capsys):
    """In-process: eval / generate name what is missing, not --teacher."""
    from attn2ssm.cli import main

    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: {tmp_path} holds no model: config.json is missing — pass a student directory"
    ), err
    assert "--teacher" not in err[0]


def test_generate_runs(slow):
    r = result_of(slow, "generate")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert not any(line.startswith("error:") for line in r.stderr.splitlines()), r.stderr


def test_generate_with_a_draft_reports_acceptance(slow):
    """`generate --draft` (the teacher drafting for its student) decodes speculatively and says how it went."""
    r = result_of(slow, "generate_draft")
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if line.startswith("[speculative]")]
    assert len(stats) == 1 and "acceptance" in stats[0] and "tokens in" in stats[0], r.stderr


def test_generate_bad_draft_count_is_one_line(capsys):
    from attn2ssm.cli import main

    assert (
        main(
            ["generate", "/nope/model", "--draft", "/nope/draft", "--prompt", "x", "--num-draft-tokens", "0"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-draft-tokens 0" in err[0], err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--max-new-tokens", "-5"], "--max-new-tokens -5"),
        (["--temperature", "1", "--top-p", "2"], "--top-p 2.0 is outside (0, 1]"),
        (["--temperature", "1", "--top-p", "0"], "--top-p 0.0"),
        (["--temperature", "-1"], "--temperature -1.0"),
        (["--temperature", "nan"], "--temperature nan"),
        (["--top-k", "-1"], "--top-k -1"),
    ],
)
def test_generate_settings_out_of_range_are_one_line(flags, needle, capsys):
    """In-process: checked before the model is even looked for (no silent greedy for a negative temperature)."""
    from attn2ssm.cli import main

    assert main(["generate", "/nope/model", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0] and " — " in err[0], err


def test_convert_keep_auto_scores_layers_and_writes_the_plan(ws, tmp_path, capsys):
    """`convert --keep auto` (in-process): converts each layer alone on corpus blocks, keeps the most damaging."""
    from attn2ssm.cli import main

    out = tmp_path / "auto"
    assert (
        main(
            [
                "convert",
                "--teacher",
                str(ws.llama),
                "--mixer",
                "mamba2",
                "--attention-ratio",
                "0.5",
                "--keep",
                "auto",
                "--calibration",
                str(ws.corpus),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    scores = [
        float(item.split(":")[1])
        for item in printed.split("converted alone): ")[1].splitlines()[0].split(", ")
    ]
    plan = json.loads((out / "config.json").read_text())["layer_plan"]
    assert len(scores) == 2 and plan.count("attention") == 1
    assert plan.index("attention") == max(range(2), key=lambda i: (scores[i], -i))


# --------------------------------------------------------------------------- data shards | info


def test_data_shards_and_info(tiny_setup, tmp_path, capsys):
    """`data shards` writes a corpus and teacher samples as token shards and says what it wrote; `data
    info` reads the manifest back, hashes the files and checks the tokenizer; both read in a recipe."""
    import socket

    from attn2ssm.cli import main
    from attn2ssm.data.shards import read_manifest

    teacher, corpus = tiny_setup
    killed = (
        tmp_path / f".text.shards-abcd1234.{2**22 + 7}@{socket.gethostname()}"
    )  # what a SIGKILLed writer left (no such pid)
    killed.mkdir()
    assert (
        main(
            [
                "data",
                "shards",
                str(corpus),
                "--out",
                str(tmp_path / "text"),
                "--teacher",
                str(teacher),
                "--heldout-tokens",
                "300",
            ]
        )
        == 0
    )
    assert not killed.exists()
    printed = capsys.readouterr().out.splitlines()
    manifest = read_manifest(tmp_path / "text")
    n_train = sum(f["tokens"] for f in manifest["sides"]["train"])
    assert (
        printed[0]
        == f"{tmp_path / 'text'}: token shards of {str(corpus)!r}, {(n_train + 300) * 2 / 1024:.1f} KiB"
    )
    assert printed[2].split() == [
        "train",
        f"{n_train:,}",
        "tokens",
        "in",
        "1",
        "file",
        "(" + f"{n_train * 2 / 1024:.1f}",
        "KiB)",
    ]
    assert printed[3].split()[:2] == ["held-out", "300"] and printed[-1].startswith(
        f"use it: data.corpus: shards:{tmp_path / 'text'}"
    )

    spec = "generated:3000?length=24&batch=8"
    assert (
        main(
            [
                "data",
                "shards",
                spec,
                "--out",
                str(tmp_path / "gen"),
                "--teacher",
                str(teacher),
                "--max-tokens",
                "2k",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "train            2,000 tokens in 1 file" in printed
        and "batch 8 on cpu (float32)" in printed
        and "tokens/s" in printed
    )

    assert main(["data", "info", str(tmp_path / "gen"), "--verify", "--teacher", str(teacher)]) == 0
    printed = capsys.readouterr().out
    assert "verified: all 2 files match their size and SHA-256" in printed and "the ids belong to" in printed
    assert main(["data", "shards", "sotu", "--out", str(tmp_path / "gen"), "--teacher", str(teacher)]) == 2
    assert "already holds token shards" in capsys.readouterr().err
    assert (
        main(
            [
                "data",
                "shards",
                str(tmp_path / "gen"),
                "--out",
                str(tmp_path / "again"),
                "--teacher",
                str(teacher),
            ]
        )
        == 2
    )
    assert (
        f"holds token shards, not text files — name it shards:{tmp_path / 'gen'}" in capsys.readouterr().err
    )
    assert (
        main(
            [
                "data",
                "shards",
                f"shards:{tmp_path / 'gen'}",
                "--out",
                str(tmp_path / "cut"),
                "--teacher",
                str(teacher),
                "--fit-mib",
                "0.07",
            ]
        )
        == 0
    )
    assert (
        "train            2,000 tokens" in capsys.readouterr().out
    )  # room for 3,932 ids, 122 held out: all 2,000 training ones fit
    assert sum(f.stat().st_size for f in (tmp_path / "cut").iterdir()) <= 0.07 * 2**20


def test_data_shards_interrupted_leaves_nothing(tiny_setup, tmp_path):
    """SIGTERM while the teacher samples: exit 130, no folder at --out and no staging folder beside it."""
    import signal
    import time

    teacher, _ = tiny_setup
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "gen"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attn2ssm",
            "data",
            "shards",
            "generated:100000000?length=32&batch=4",
            "--out",
            str(out),
            "--teacher",
            str(teacher),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while (
            not [p for p in tmp_path.iterdir() if p.name.startswith(".gen.shards-")]
            and time.monotonic() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.2)
        time.sleep(1.0)  # some batches written
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_data_token_counts_and_fitting_a_transfer():
    from attn2ssm.cli.data import fit_limits, token_count
    from attn2ssm.errors import ConfigError

    assert [token_count("--max-tokens", t) for t in ("123", "30M", "1.5k", "2^25", "2 ^ 10", "1G", None)] == [
        123,
        30_000_000,
        1500,
        1 << 25,
        1024,
        10**9,
        None,
    ]
    with pytest.raises(ConfigError, match="not a number of tokens"):
        token_count("--max-tokens", "-5")
    train, held = fit_limits(64, 2, None, None)  # 64 MiB at 16 bits, 64 KiB left for the manifest
    assert train + held == ((64 << 20) - (64 << 10)) // 2 == 33_521_664 and held == 33_521_664 // 32
    assert fit_limits(64, 2, 1000, 50) == (1000, 50) and fit_limits(64, 4, None, 100) == (
        ((64 << 20) - (64 << 10)) // 4 - 100,
        100,
    )
    with pytest.raises(ConfigError, match="raise --fit-mib"):
        fit_limits(0.05, 2, None, None)
