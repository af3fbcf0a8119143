"""``attn2ssm export --format gguf``: a pure gated delta-rule student as llama.cpp's ``qwen35``.

Fast: the form llama.cpp takes (export/native_qwen35.py, ``llama_cpp=True``: the student's Gated
DeltaNet layers and one identity attention layer) gives the student's logits on a left-padded batch
and its greedy tokens (with transformers' cache, which the attention layer makes possible) in
transformers' Qwen3_5ForCausalLM; the identity layer's weights are all zero.

A hybrid (``student.kept_attention: qwen35``) needs no identity layer: its own attention layers are
llama.cpp's, at the plan's layers (the converter writes ``qwen35.attention.recurrent_layers`` per
layer from ``layer_types``, so any placement maps, not only a regular ``full_attention_interval``).

Slow (``-m slow``; skipped without ``make llama-cpp``): a pure student of the built-in teacher,
every new mixer parameter and block norm moved off its init, exported to f32 GGUF, gives the HF
student's greedy tokens and logits in llama.cpp; a q8_0 export (the converter's own) runs; and so
does a hybrid whose kept layers (Qwen3.5's form, their norms and gate off their init too) sit at
irregular places.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.export.native import to_native
from attn2ssm.student.convert import convert
from cache_forms import positions
from real_cache import PROMPTS, needs_llama_cpp, real_cache
from tiny_models import perturb_new_mixer_parameters, tiny_config

GDN = "gated_delta"
EXPORT_FORM = {"gate_bias": False, "beta_bias": False, "conv_bias": False, "norm_eps": "auto"}


def _student(family: str, layers: int = 3):
    config = tiny_config(family)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    student = convert(teacher, [GDN] * layers, {GDN: EXPORT_FORM})
    torch.manual_seed(1)
    with torch.no_grad():
        perturb_new_mixer_parameters(student)
    return student.eval()


@pytest.mark.parametrize("family", ["llama", "smollm2"])
def test_llama_cpp_form_equals_the_student_in_transformers(family):
    student = _student(family)
    native = to_native(student, llama_cpp=True)
    cfg = native.config
    assert list(cfg.layer_types) == ["linear_attention"] * 3 + ["full_attention"] and cfg.use_cache
    last = native.model.layers[-1]
    # q/k/v/o, q/k norms, MLP and (zero-centred) block norms
    assert all(p.abs().max() == 0 for p in last.parameters())
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    with torch.no_grad():
        mine = student(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
        ).logits
        theirs = native(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(theirs[mask.bool()], mine[mask.bool()], rtol=0, atol=1e-4)
        greedy = native.generate(
            input_ids=ids[:1, :12], max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=True
        )
    assert (
        greedy.tolist()
        == student.generate(
            input_ids=ids[:1, :12], max_new_tokens=8, do_sample=False, pad_token_id=0
        ).tolist()
    )


def _hybrid(teacher, kept: list[int], scale: float = 0.1):
    """A gated_delta hybrid of ``teacher`` keeping ``kept`` in Qwen3.5's form, off every init."""
    n = teacher.config.num_hidden_layers
    plan = ["attention" if i in kept else GDN for i in range(n)]
    student = convert(teacher, plan, {GDN: EXPORT_FORM}, kept_attention="qwen35")
    torch.manual_seed(1)
    with torch.no_grad():
        perturb_new_mixer_parameters(student, scale)
        for module in student.kept_attention_layers().values():
            for p in (module.g_proj.weight, module.q_norm.weight, module.k_norm.weight):
                p.add_(scale * torch.randn_like(p))
    return student.eval()


@pytest.mark.parametrize("family", ["llama", "smollm2"])
def test_hybrid_llama_cpp_form_has_no_identity_layer_and_equals_the_student(family):
    config = tiny_config(family)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    student = _hybrid(teacher, kept=[0, 3])
    native = to_native(student, llama_cpp=True)
    assert list(native.config.layer_types) == [
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ]
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    with torch.no_grad():
        mine = student(
            input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False
        ).logits
        theirs = native(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(theirs[mask.bool()], mine[mask.bool()], rtol=0, atol=1e-4)
        greedy = native.generate(input_ids=ids[:1, :12], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert (
        greedy.tolist()
        == student.generate(
            input_ids=ids[:1, :12], max_new_tokens=8, do_sample=False, pad_token_id=0
        ).tolist()
    )


# ------------------------------------------------------------------------------------- slow
@pytest.fixture(scope="module")
def builtin_gdn_student(tmp_path_factory):
    """A pure gated_delta student of the built-in teacher in the export form, off its init."""
    root = needs_llama_cpp()
    from attn2ssm.teachers import load_teacher

    mp = pytest.MonkeyPatch()
    mp.setenv("ATTN2SSM_CACHE", str(real_cache()))
    mp.setenv("ATTN2SSM_LLAMA_CPP", str(root))
    teacher, tok, _ = load_teacher("smollm2-135m")
    torch.manual_seed(0)
    student = convert(teacher, [GDN] * teacher.config.num_hidden_layers, {GDN: EXPORT_FORM}).eval()
    with torch.no_grad():
        perturb_new_mixer_parameters(student, scale=0.02)
    directory = tmp_path_factory.mktemp("gdn") / "student"
    student.save_pretrained(directory)
    tok.save_pretrained(directory)
    yield directory, student, tok
    mp.undo()


@pytest.mark.slow
def test_f32_gguf_decodes_the_students_greedy_tokens_in_llama_cpp(builtin_gdn_student, tmp_path, capsys):
    from attn2ssm.export.gguf import llama_cpp_tolerance
    from attn2ssm.export.llamacpp import GGUFModel, read_metadata

    directory, student, tok = builtin_gdn_student
    gguf = tmp_path / "gdn.gguf"
    assert main(["export", str(directory), "--format", "gguf", "--out", str(gguf), "--outtype", "f32"]) == 0
    out = capsys.readouterr().out
    assert "within tolerance" in out and "qwen35" in out, out
    meta = read_metadata(gguf)
    # 30 + the identity layer
    assert meta["general.architecture"] == "qwen35" and meta["qwen35.block_count"] == 31
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
def test_q8_0_export_runs(builtin_gdn_student, tmp_path):
    from attn2ssm.export.gguf import export_gguf
    from attn2ssm.export.llamacpp import GGUFModel

    directory, _, tok = builtin_gdn_student
    result = export_gguf(directory, tmp_path / "q8.gguf", outtype="q8_0")
    assert result.llama_cpp_max_abs_diff is not None and result.identity_layers == [30]
    model = GGUFModel(result.out, n_ctx=64, threads=2)
    assert len(model.greedy(tok(PROMPTS[0])["input_ids"], 8)) == 8
    model.close()


HYBRID_KEPT = [2, 9, 10, 23, 29]  # irregular: no full_attention_interval expresses it


@pytest.mark.slow
def test_hybrid_f32_gguf_decodes_the_students_greedy_tokens_in_llama_cpp(tmp_path, capsys):
    from attn2ssm.export.gguf import llama_cpp_tolerance
    from attn2ssm.export.llamacpp import GGUFModel, read_metadata
    from attn2ssm.teachers import load_teacher

    root = needs_llama_cpp()
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTN2SSM_CACHE", str(real_cache()))
    mp.setenv("ATTN2SSM_LLAMA_CPP", str(root))
    try:
        teacher, tok, _ = load_teacher("smollm2-135m")
        student = _hybrid(teacher, HYBRID_KEPT, scale=0.02)
        directory = tmp_path / "student"
        student.save_pretrained(directory)
        tok.save_pretrained(directory)
        gguf = tmp_path / "hybrid.gguf"
        assert (
            main(["export", str(directory), "--format", "gguf", "--out", str(gguf), "--outtype", "f32"]) == 0
        )
        out = capsys.readouterr().out
        assert "within tolerance" in out and "identity layer" not in out, out
        meta = read_metadata(gguf)
        # no identity layer
        assert meta["general.architecture"] == "qwen35" and meta["qwen35.block_count"] == 30
        model = GGUFModel(gguf, n_ctx=128, threads=2, flash_attn=False, kv_type="f32", logits_all=True)
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                hf = student.generate(
                    input_ids=ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id
                )
                logits = student(input_ids=ids, use_cache=False).logits[0]
            assert model.greedy(ids[0].tolist(), 24) == hf[0, ids.shape[1] :].tolist(), prompt
            model.reset()
            model.feed(ids[0].tolist())
            theirs = torch.from_numpy(model.all_logits())[:, : logits.shape[-1]]
            assert (theirs - logits).abs().max() <= llama_cpp_tolerance(float(logits.abs().max())), prompt
        model.close()
    finally:
        mp.undo()
