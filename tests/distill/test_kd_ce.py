"""kd_ce (Mamba in the Llama's stage 1 loss) by hand; named parameter groups and `frozen` across families."""

import math

import pytest
import torch

from attn2ssm.distill.losses import kd_ce_loss
from attn2ssm.distill.recipe import StageConfig
from attn2ssm.distill.stages import STAGE_KINDS, select_trainable
from attn2ssm.distill.stages.base import parameter_groups
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from tiny_models import tiny_model


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _kl(t, s):
    pt, ps = _softmax(t), _softmax(s)
    return sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, ps))


S = [[1.0, 2.0, 0.5], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]]
T = [[2.0, 1.0, 0.0], [1.0, 1.5, 1.0], [0.0, 3.0, 0.0]]  # teacher argmax: 0, 1, 1
IDS = [0, 2, 1]


def _nll(row, target):
    return -math.log(_softmax(row)[target])


@pytest.mark.parametrize("labels", ["data", "teacher"])
def test_kd_ce_hand_computed(labels):
    s, t, ids = torch.tensor([S]), torch.tensor([T]), torch.tensor([IDS])
    kl = sum(_kl(ti, si) for si, ti in zip(S, T)) / 3  # every real position
    if labels == "data":  # positions 0 and 1 predict ids[1], ids[2]; the last predicts nothing
        ce = (_nll(S[0], 2) + _nll(S[1], 1)) / 2
    else:  # the teacher's argmax next token at every position
        ce = (_nll(S[0], 0) + _nll(S[1], 1) + _nll(S[2], 1)) / 3
    loss, got_ce, got_kl = kd_ce_loss(s, t, ids, labels=labels)
    assert got_ce.item() == pytest.approx(ce, rel=1e-6) and got_kl.item() == pytest.approx(kl, rel=1e-6)
    assert loss.item() == pytest.approx(ce + 0.1 * kl, rel=1e-6)  # defaults: α = 1, β = 0.1
    weighted, _, _ = kd_ce_loss(s, t, ids, labels=labels, ce_weight=0.5, kl_weight=2.0)
    assert weighted.item() == pytest.approx(0.5 * ce + 2.0 * kl, rel=1e-6)


@pytest.mark.parametrize("labels", ["data", "teacher"])
def test_kd_ce_per_real_token_with_padding(labels):
    s, t, ids = torch.tensor([S]), torch.tensor([T]), torch.tensor([IDS])
    mask = torch.tensor([[1, 1, 0]])  # the last token is padding
    kl = (_kl(T[0], S[0]) + _kl(T[1], S[1])) / 2
    ce = _nll(S[0], 2) if labels == "data" else (_nll(S[0], 0) + _nll(S[1], 1)) / 2
    loss, _, _ = kd_ce_loss(s, t, ids, mask, labels=labels)
    assert loss.item() == pytest.approx(ce + 0.1 * kl, rel=1e-6)


def test_kd_ce_gradient_reaches_the_student_only():
    s = torch.tensor([S], requires_grad=True)
    t = torch.tensor([T], requires_grad=True)
    loss, _, _ = kd_ce_loss(s, t, torch.tensor([IDS]), labels="teacher")
    loss.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0 and t.grad is None


def test_kd_ce_stage_options_and_identical_models():
    kind = STAGE_KINDS["kd_ce"]
    assert kind.options(StageConfig(kind="kd_ce")) == {"kl_weight": 0.1, "ce_weight": 1.0, "labels": "data"}
    with pytest.raises(ConfigError, match="labels"):
        kind.options(StageConfig(kind="kd_ce", losses={"labels": "sampled"}))
    with pytest.raises(ConfigError, match="must be a number"):
        kind.options(StageConfig(kind="kd_ce", losses={"kl_weight": "high"}))
    teacher = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, metrics = kind.loss(teacher, teacher, {"input_ids": ids}, StageConfig(kind="kd_ce"))
    assert float(metrics["kl"]) == pytest.approx(0.0, abs=1e-6)
    assert loss.item() == pytest.approx(float(metrics["ce"]), rel=1e-6)


# ------------------------------------------------------------------------------ parameter groups


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_parameter_groups_are_found_and_disjoint_from_mixers(family):
    # layer 1 keeps softmax attention
    student = convert(tiny_model(family), ["linear_attention", "attention"])
    groups = parameter_groups(student)
    mixers = groups["mixers"]
    assert mixers and all(".h.0." in n or ".layers.0." in n for n in mixers)
    for name in ("mlps", "embeddings", "norms", "attention"):
        assert groups[name], name
        assert not groups[name] & mixers, name
    assert all(".mlp." in n for n in groups["mlps"]) and len(groups["mlps"]) >= 4  # both layers
    assert all(".layers.1." in n or ".h.1." in n for n in groups["attention"])
    assert not groups["mlps"] & groups["norms"] and not groups["embeddings"] & groups["mlps"]
    emb = groups["embeddings"]
    if family == "llama":
        assert emb == {"base.model.embed_tokens.weight", "base.lm_head.weight"}
        assert {"base.model.norm.weight", "base.model.layers.0.input_layernorm.weight"} <= groups["norms"]
    else:  # tied head (one tensor) and the learned positions count as embeddings
        assert emb == {"base.transformer.wte.weight", "base.transformer.wpe.weight"}
        assert {"base.transformer.ln_f.weight", "base.transformer.h.1.ln_2.bias"} <= groups["norms"]


def test_frozen_applies_after_trainable():
    student = convert(tiny_model("llama"), ["linear_attention", "attention"])
    groups = parameter_groups(student)
    names = set(select_trainable(student, ["all"], ["mlps", "embeddings"]))
    assert names == groups["all"] - groups["mlps"] - groups["embeddings"]
    assert {n for n, p in student.named_parameters() if p.requires_grad} == names
    # Mamba in the Llama's stage 1: everything but the mixers frozen
    names = set(select_trainable(student, ["all"], ["mlps", "embeddings", "norms", "attention"]))
    assert names == groups["mixers"]
    names = set(select_trainable(student, ["mixers", "norms"], ["*.layers.1.*"]))
    assert names == groups["mixers"] | {n for n in groups["norms"] if ".layers.1." not in n}


def test_frozen_errors():
    student = convert(tiny_model("llama"), ["linear_attention", "linear_attention"])
    with pytest.raises(ConfigError, match="'attention' matches no kept softmax-attention layer"):
        select_trainable(student, ["all"], ["attention"])
    with pytest.raises(ConfigError, match="leaves no parameter to train") as err:
        select_trainable(student, ["mixers"], ["mixers"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="frozen pattern 'nothing.*' matches no parameter"):
        select_trainable(student, ["all"], ["nothing.*"])
