"""``attn2ssm export --format gguf``: a Mamba-2 student through llama.cpp's own converter.

Fast: the form llama.cpp takes (student/native_export.py, ``llama_cpp=True``: expand 2 with zero
heads, no in_proj / out_proj bias, a pure student's identity attention layer) gives the student's
logits and greedy tokens in transformers' GraniteMoeHybrid for tiny teachers; what llama.cpp cannot
run exactly is refused in one line; a missing converter or runtime is one line naming
``make llama-cpp``; the mixer's ``gate_bias: false``.

Slow (``-m slow``; skipped without ``make llama-cpp``): students of the built-in teacher, pure and
hybrid, exported to f32 GGUF, give the HF student's greedy tokens and logits in llama.cpp; a q4_1
export (llama_model_quantize) keeps the hybrid's RoPE switch and runs.
"""

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.errors import ExportError
from attn2ssm.export.native import check_native, llama_cpp_problem, mamba2_tensors, to_native
from attn2ssm.mixers.mamba2 import Mamba2Mixer
from attn2ssm.student.convert import convert
from cache_forms import positions
from read_only import deny_access
from real_cache import PROMPTS, needs_llama_cpp, real_cache
from tiny_models import make_tokenizer, one_line_error, perturb_new_mixer_parameters, tiny_config

MAMBA2 = "mamba2"


def _teacher(family: str, layers: int = 4):
    config = tiny_config(family)
    config.num_hidden_layers = layers
    if family == "qwen2":
        config.layer_types = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def _student(teacher, plan, **options):
    """A student with the options a GGUF export needs, every mixer parameter moved off its init."""
    options = {"norm": True, "norm_eps": teacher.config.rms_norm_eps, "gate_bias": False, **options}
    student = convert(teacher, plan, {MAMBA2: options})
    torch.manual_seed(1)
    perturb_new_mixer_parameters(student)
    return student.eval()


CASES = [("llama", []), ("llama", [1, 3]), ("smollm2", []), ("smollm2", [3]), ("mistral", [])]


@pytest.mark.parametrize(
    "family,kept", CASES, ids=[f"{f}-{'_'.join(map(str, k)) or 'pure'}" for f, k in CASES]
)
def test_llama_cpp_form_equals_the_student_in_transformers(family, kept):
    """Logits on a left-padded batch and greedy tokens (with transformers' cache) equal the
    student's; the extra heads really are zero and the layout is the one llama.cpp asserts."""
    teacher = _teacher(family)
    plan = ["attention" if i in kept else MAMBA2 for i in range(4)]
    student = _student(teacher, plan)
    native = to_native(student, llama_cpp=True)
    cfg, h, d = (
        native.config,
        student.config.layer_geometry[0]["num_heads"],
        student.config.layer_geometry[0]["head_dim"],
    )
    assert (
        cfg.mamba_expand == 2 and cfg.mamba_n_heads == cfg.mamba_n_groups == 2 * h and not cfg.mamba_proj_bias
    )
    # llama.cpp: GGML_ASSERT(2 * n_embd == d_inner)
    assert cfg.mamba_n_heads * cfg.mamba_d_head == 2 * cfg.hidden_size
    layer_types = ["attention" if k == "attention" else "mamba" for k in plan] + (
        [] if kept else ["attention"]
    )
    assert list(cfg.layer_types) in (
        layer_types,
        [{"mamba": "linear_attention", "attention": "full_attention"}[t] for t in layer_types],
    )
    mamba = native.model.layers[plan.index(MAMBA2)].mamba
    assert mamba.in_proj.bias is None and mamba.out_proj.bias is None
    z, x, B, C, _ = mamba.in_proj.weight.split([2 * h * d] * 4 + [2 * h])
    for block in (z, x, B, C):
        assert block[h * d :].abs().max() == 0 and block[: h * d].abs().max() > 0
    assert mamba.out_proj.weight[:, h * d :].abs().max() == 0
    if not kept:  # the identity layer adds exactly nothing
        last = native.model.layers[-1]
        assert (
            last.self_attn.o_proj.weight.abs().max() == 0
            and last.shared_mlp.output_linear.weight.abs().max() == 0
        )

    ids = torch.randint(3, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    pos, real = positions(mask), mask.bool()
    with torch.no_grad():
        mine = student(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        theirs = native(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(theirs[real], mine[real], rtol=0, atol=1e-4)
        greedy = student.generate(input_ids=ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(
            native.generate(
                input_ids=ids[:1], max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=True
            ),
            greedy,
        )
    default = to_native(student)  # the plain native export of the same student is unchanged
    assert (
        default.config.mamba_expand == 1
        and default.config.mamba_proj_bias
        and default.config.num_hidden_layers == 4
    )


def _config(family="llama", plan=(MAMBA2, MAMBA2), **options):
    teacher = _teacher(family, len(plan))
    return convert(
        teacher, list(plan), {MAMBA2: {"norm": True, "norm_eps": teacher.config.rms_norm_eps, **options}}
    ).config


def test_what_llama_cpp_cannot_run_exactly_is_refused_in_one_line():
    assert llama_cpp_problem(_config(gate_bias=False)) is None
    check_native(_config(), llama_cpp=False)  # the default gate (with its bias) still exports natively
    for config, words in (
        (_config(), ["gate_bias: true", "no bias", "gate_bias: false"]),
        (_config(gate=False), ["gate: false", "in_proj has no bias", "gate: true, gate_bias: false"]),
        (_config("qwen2", (MAMBA2, MAMBA2), gate_bias=False), ["q/k/v/o biases", "--format native"]),
    ):
        with pytest.raises(ExportError) as err:
            check_native(config, llama_cpp=True)
        message = str(err.value)
        assert len(message.splitlines()) == 1 and all(w in message for w in words), message


def test_a_nonzero_projection_bias_is_never_dropped():
    student = _student(_teacher("llama", 2), [MAMBA2, MAMBA2], gate_bias=True)
    mixer = next(iter(student.mixers().values()))
    with pytest.raises(ExportError, match="in_proj.bias is not zero"):
        mamba2_tensors(mixer, heads=2 * mixer.num_heads, proj_bias=False)


def test_gate_bias_false_has_no_bias_and_reloads(tmp_path):
    geometry = {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
    mixer = Mamba2Mixer(geometry, 0, gate_bias=False, norm=True)
    # nn.Linear's init: SiLU(0·u) = 0 would silence it
    assert mixer.gate.bias is None and mixer.gate.weight.abs().max() > 0
    assert Mamba2Mixer(geometry, 0).gate.bias is not None  # the default keeps the identity gate
    student = _student(_teacher("llama", 2), [MAMBA2, "attention"])
    student.save_pretrained(tmp_path)
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    again = Attn2SSMForCausalLM.from_pretrained(tmp_path).eval()
    assert next(iter(again.mixers().values())).gate.bias is None
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            again(input_ids=ids).logits, student(input_ids=ids).logits, rtol=0, atol=1e-6
        )


# ------------------------------------------------------------------------------------------ CLI errors
@pytest.fixture
def student_dir(tmp_path):
    student = _student(_teacher("llama", 2), [MAMBA2, MAMBA2])
    student.save_pretrained(tmp_path / "student")
    make_tokenizer().save_pretrained(tmp_path / "student")
    return tmp_path / "student"


def test_gguf_export_flags_are_one_line_errors(student_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ATTN2SSM_LLAMA_CPP", raising=False)
    s = str(student_dir)
    assert "does not end in .gguf" in one_line_error(
        capsys, ["export", s, "--format", "gguf", "--out", str(tmp_path / "m.bin")]
    )
    assert "--outtype is for --format gguf" in one_line_error(
        capsys, ["export", s, "--format", "native", "--out", str(tmp_path / "n"), "--outtype", "f16"]
    )
    (tmp_path / "there.gguf").write_bytes(b"x")
    assert "--force" in one_line_error(
        capsys, ["export", s, "--format", "gguf", "--out", str(tmp_path / "there.gguf")]
    )
    # the private test cache holds no llama-cpp-python sdist: the converter is missing
    err = one_line_error(capsys, ["export", s, "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert "convert_hf_to_gguf.py" in err and "make llama-cpp" in err
    monkeypatch.setenv("ATTN2SSM_LLAMA_CPP", str(tmp_path))
    err = one_line_error(capsys, ["export", s, "--format", "gguf", "--out", str(tmp_path / "m.gguf")])
    assert "$ATTN2SSM_LLAMA_CPP" in err and "make llama-cpp" in err
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob(".m.gguf.export-*"))


# ------------------------------------------------------------------------------------------ llama.cpp (slow)
@pytest.fixture(scope="module")
def builtin_students(tmp_path_factory):
    """Students of the built-in teacher, pure and 25 % attention, built with the GGUF options and
    every mixer parameter moved off its init (D, conv, norm weights) so each mapped tensor counts."""
    root = needs_llama_cpp()
    from attn2ssm.student.plans import make_plan
    from attn2ssm.teachers import load_teacher

    mp = pytest.MonkeyPatch()
    mp.setenv("ATTN2SSM_CACHE", str(real_cache()))  # the converted teacher, as the other slow tests use it
    mp.setenv("ATTN2SSM_LLAMA_CPP", str(root))
    teacher, tok, _ = load_teacher("smollm2-135m")
    out = {}
    for name, ratio in (("pure", 0.0), ("hybrid25", 0.25)):
        torch.manual_seed(0)
        plan = make_plan(teacher.config.num_hidden_layers, MAMBA2, attention_ratio=ratio)
        student = convert(
            teacher, plan, {MAMBA2: {"norm": True, "norm_eps": "auto", "gate_bias": False}}
        ).eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for mixer in student.mixers().values():
                mixer.D.copy_(torch.rand(mixer.D.shape, generator=g))
                mixer.norm.weight.mul_(1 + 0.2 * torch.randn(mixer.norm.weight.shape, generator=g))
                mixer.conv.weight.add_(0.1 * torch.randn(mixer.conv.weight.shape, generator=g))
                mixer.conv.bias.add_(0.1 * torch.randn(mixer.conv.bias.shape, generator=g))
        directory = tmp_path_factory.mktemp(name) / "student"
        student.save_pretrained(directory)
        tok.save_pretrained(directory)
        out[name] = (directory, student, tok)
    yield out
    mp.undo()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pure", "hybrid25"])
def test_f32_gguf_decodes_the_students_greedy_tokens_in_llama_cpp(builtin_students, name, tmp_path, capsys):
    from attn2ssm.export.gguf import llama_cpp_tolerance
    from attn2ssm.export.llamacpp import GGUFModel, read_metadata

    directory, student, tok = builtin_students[name]
    gguf = tmp_path / f"{name}.gguf"
    assert main(["export", str(directory), "--format", "gguf", "--out", str(gguf), "--outtype", "f32"]) == 0
    assert "within tolerance" in capsys.readouterr().out
    meta = read_metadata(gguf)
    assert meta["general.architecture"] == "granitehybrid" and meta["granitehybrid.ssm.inner_size"] == 2 * 576
    assert meta["granitehybrid.context_length"] == 8192 and meta["granitehybrid.block_count"] == 30 + (
        name == "pure"
    )
    if name == "hybrid25":
        # set back: the converter reads hybrids as NoPE
        assert meta["granitehybrid.rope.scaling.finetuned"] is True
    model = GGUFModel(gguf, n_ctx=128, threads=2, flash_attn=False, kv_type="f32", logits_all=True)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hf = student.generate(
                input_ids=ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id
            )[0, ids.shape[1] :].tolist()
            logits = student(input_ids=ids, use_cache=False).logits[0]
        assert model.greedy(ids[0].tolist(), 24) == hf, prompt
        model.reset()
        model.feed(ids[0].tolist())
        theirs = torch.from_numpy(model.all_logits())[:, : logits.shape[-1]]
        assert (theirs - logits).abs().max() <= llama_cpp_tolerance(float(logits.abs().max())), prompt
    model.close()


@pytest.mark.slow
def test_q4_1_export_quantises_with_llama_cpp_and_keeps_the_rope_switch(builtin_students, tmp_path):
    from attn2ssm.export.gguf import export_gguf
    from attn2ssm.export.llamacpp import GGUFModel, read_metadata

    directory, _, tok = builtin_students["hybrid25"]
    result = export_gguf(directory, tmp_path / "q41.gguf", outtype="q4_1")
    meta = read_metadata(result.out)
    # LLAMA_FTYPE_MOSTLY_Q4_1
    assert meta["general.file_type"] == 3 and meta["granitehybrid.rope.scaling.finetuned"] is True
    # f32: 722 MiB, f16: 362 MiB
    assert result.llama_cpp_max_abs_diff is not None and result.bytes < 160 * 2**20
    model = GGUFModel(result.out, n_ctx=64, threads=2)
    assert len(model.greedy(tok(PROMPTS[0])["input_ids"], 8)) == 8
    model.close()


def test_gguf_a_read_only_folder_or_a_full_disk_is_one_line_and_a_killed_exports_staging_goes(
    student_dir, tmp_path, monkeypatch, capsys
):
    import attn2ssm.export.gguf as G

    monkeypatch.setattr(G, "converter_dir", lambda: tmp_path)  # as if 'make llama-cpp' had run
    out, s = tmp_path / "m.gguf", str(student_dir)
    real_access = os.access
    deny_access(monkeypatch, tmp_path)  # as if tmp_path were read-only
    err = one_line_error(capsys, ["export", s, "--format", "gguf", "--out", str(out)])
    assert (
        err
        == f"error: --out {out}: {tmp_path} is not writable (permission denied) — choose another --out, or make {tmp_path} writable"
    )
    monkeypatch.setattr(os, "access", real_access)

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    # export --force SIGKILLed mid-way
    stale = tmp_path / f".m.gguf.export-abc123.{proc.pid}@{socket.gethostname()}"
    (stale / "native").mkdir(parents=True)

    def fills_the_disk(native_dir, gguf, outtype, work, threads, **_):
        Path(gguf).write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(G, "to_gguf", fills_the_disk)
    capsys.readouterr()
    assert main(["export", s, "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own progress bars
    assert (
        err
        == f"error: cannot write the GGUF file to {out}: No space left on device — free space on its disk, then run the command again (what --out held is unchanged)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]
