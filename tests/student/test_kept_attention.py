"""``student.kept_attention: qwen35``: a hybrid's kept attention layers in Qwen3.5's form.

The gate starts exact (zero rows, o_proj doubled); the q/k norms cannot, and their calibrated start
(least-squares scales from the teacher's q and k) is closer to the teacher than ones. The form saves
and loads through remote code, a cache (prefill then one token at a time, left-padded) gives the full
forward's logits, its new parameters train with the mixers, and what it cannot rewrite is refused.
"""

import pytest
import torch

from attn2ssm.distill.calibration import calibrate_kept_attention
from attn2ssm.distill.stages.base import parameter_groups
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from attn2ssm.student.kept_attention import Qwen35FormAttention
from cache_forms import REMOTE_PRELUDE, full_and_pieces, positions, run_remote
from tiny_models import perturb_new_mixer_parameters, tiny_model

GDN = "gated_delta"
PLAN = [GDN, "attention", GDN, "attention"]


def _teacher(family="llama", layers=4):
    return tiny_model(family, layers=layers)


def _student(family="llama", calibrate=False, teacher=None):
    teacher = teacher or _teacher(family)
    student = convert(teacher, PLAN, {GDN: {}}, kept_attention="qwen35")
    if calibrate:
        calibrate_kept_attention(student, teacher, torch.randint(3, 200, (2, 24)))
    return teacher, student


def _batch():
    ids = torch.randint(3, 200, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def test_kept_layers_take_the_form_and_the_gate_starts_exact():
    teacher, student = _student()
    kept = student.kept_attention_layers()
    assert sorted(kept) == [1, 3] and all(isinstance(m, Qwen35FormAttention) for m in kept.values())
    assert student.config.kept_attention == "qwen35"
    t_attn = teacher.model.layers[1].self_attn
    m = kept[1]
    assert torch.equal(m.g_proj.weight, torch.zeros_like(m.g_proj.weight))
    assert torch.equal(m.o_proj.weight, 2 * t_attn.o_proj.weight) and torch.equal(
        m.q_proj.weight, t_attn.q_proj.weight
    )
    assert m.q_norm.eps == teacher.config.rms_norm_eps


@torch.no_grad()
def test_calibrated_norms_bring_the_kept_layers_closer_to_the_teacher():
    teacher = _teacher()
    ids, _ = _batch()
    student_ones = _student(teacher=teacher)[1]
    student_cal = _student(teacher=teacher, calibrate=True)[1]
    target = teacher(input_ids=ids).logits
    # the same mixers (same init) in both: only the kept layers' norm weights differ
    err = [(s(input_ids=ids).logits - target).pow(2).mean().item() for s in (student_ones, student_cal)]
    assert err[1] < err[0], err
    w = student_cal.kept_attention_layers()[1].q_norm.weight
    assert not torch.allclose(w, torch.ones_like(w))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@torch.no_grad()
def test_prefill_then_decode_equals_the_full_forward(family):
    _, student = _student(family, calibrate=True)
    perturb_new_mixer_parameters(student)
    for module in student.kept_attention_layers().values():
        for p in (module.g_proj.weight, module.q_norm.weight, module.k_norm.weight):
            p.add_(0.1 * torch.randn_like(p))
    ids, mask = _batch()
    full, pieces = full_and_pieces(student.eval(), ids, mask, [13, 1, 1, 1, 5])
    real = mask.bool()
    torch.testing.assert_close(pieces[real], full[real], rtol=0, atol=1e-4)


REMOTE = r"""
ids, mask = torch.load(d + "/batch.pt")
m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
kinds = sorted({type(m.base.model.layers[i].self_attn).__name__ for i in (1, 3)})
with torch.no_grad():
    logits = m(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=False).logits
torch.save(logits, d + "/remote.pt")
print(json.dumps({"kinds": kinds, "form": m.config.kept_attention}))
"""


@torch.no_grad()
def test_saves_and_loads_without_attn2ssm(tmp_path):
    _, student = _student(calibrate=True)
    for module in student.kept_attention_layers().values():
        module.g_proj.weight.add_(0.1 * torch.randn_like(module.g_proj.weight))
    student.save_pretrained(tmp_path)
    assert (tmp_path / "attn2ssm_student_kept_attention.py").is_file()
    ids, mask = _batch()
    torch.save((ids, mask), tmp_path / "batch.pt")
    out = run_remote(REMOTE, tmp_path)
    assert out == {"kinds": ["Qwen35FormAttention"], "form": "qwen35"}
    mine = student(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(torch.load(tmp_path / "remote.pt")[real], mine[real], rtol=0, atol=1e-5)
    assert REMOTE_PRELUDE  # the remote process could not import attn2ssm


def test_new_parameters_train_with_the_mixers():
    _, student = _student()
    groups = parameter_groups(student)
    new = {
        n
        for n in groups["all"]
        if any(f"layers.{i}.self_attn.{p}" in n for i in (1, 3) for p in ("q_norm", "k_norm", "g_proj"))
    }
    assert len(new) == 6 and new <= groups["mixers"]
    assert not new & groups["attention"] and not new & groups["norms"]
    assert "base.model.layers.1.self_attn.q_proj.weight" in groups["attention"]


@pytest.mark.parametrize(
    "family, form, needle",
    [("llama", "gated", "not a form"), ("gemma", "qwen35", "gemma"), ("phi", "qwen35", "phi")],
)
def test_what_cannot_take_the_form_is_refused_in_one_line(family, form, needle):
    teacher = _teacher(family, layers=2)
    with pytest.raises(ConfigError) as err:
        convert(teacher, [GDN, "attention"], {GDN: {}}, kept_attention=form)
    assert needle in str(err.value) and "\n" not in str(err.value) and err.value.fix
