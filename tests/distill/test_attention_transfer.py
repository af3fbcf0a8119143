"""Attention transfer: only the feature maps train, and the per-layer KL to softmax falls."""

import torch

from attn2ssm.distill.recipe import StageConfig
from attn2ssm.distill.stages import STAGE_KINDS, select_trainable
from attn2ssm.eval.attention import attention_fidelity
from attn2ssm.student.convert import convert
from tiny_models import tiny_model


def test_attention_transfer_lowers_per_layer_kl():
    torch.manual_seed(0)
    teacher = tiny_model("llama")
    student = convert(teacher, ["linear_attention"] * 2, {"linear_attention": {"feature_map": "hedgehog"}})
    names = select_trainable(student, ["feature_maps"])
    assert names and all(".feature_map_" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in student.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(0)
    held_out = torch.randint(0, 256, (4, 32), generator=g)
    before = attention_fidelity(student, teacher, held_out)
    cfg = StageConfig(name="at", kind="attention_transfer")
    kind = STAGE_KINDS["attention_transfer"]
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(100):  # fresh batches: with a handful of fixed ones the maps overfit
        loss, _ = kind.loss(student, teacher, {"input_ids": torch.randint(0, 256, (4, 32), generator=g)}, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = attention_fidelity(student, teacher, held_out)
    for b, a in zip(before["layers"], after["layers"]):
        assert a["kl"] < 0.92 * b["kl"], (b["kl"], a["kl"])
    # nothing but the maps moved
    for n, p in student.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
