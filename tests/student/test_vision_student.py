"""The Vision Mamba student: an HF image classifier (save, reload, remote code without attn2ssm),
and the ViT/DeiT adapter it is built through."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModelForImageClassification,
    DeiTConfig,
    DeiTForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)

from attn2ssm.adapters import get_adapter, supported_families
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert_vision import build_vision_student

SMALL = dict(
    image_size=8,
    patch_size=4,
    num_channels=1,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    num_labels=3,
)


def vit():
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(**SMALL)).eval()


def deit():
    torch.manual_seed(0)
    return DeiTForImageClassification(DeiTConfig(**SMALL)).eval()


@pytest.mark.parametrize(
    "make, prefix, path", [(vit, 1, "vit.layers.1.attention"), (deit, 2, "deit.layers.1.attention")]
)
def test_adapter_finds_attention_heads_and_prefix_tokens(make, prefix, path):
    model = make()
    a = get_adapter(model)
    assert a.family == "vit" and a.attention_module_paths(model)[1] == path
    g = a.geometry(model.config, 1)
    assert (g.num_heads, g.num_kv_heads, g.head_dim, g.rotary_dim, g.qkv_bias, g.o_bias) == (
        2,
        2,
        8,
        0,
        True,
        True,
    )
    assert (
        a.num_prefix_tokens(model.config) == prefix
        and a.student_geometry(model.config, 0)["num_patches"] == 4
    )
    attn = a.attention_modules(model)[1]
    h = torch.randn(2, 4 + prefix, 16)
    probs = a.attention_probs(attn, h)
    assert probs.shape == (2, 2, 4 + prefix, 4 + prefix) and bool((probs[..., 0, -1] > 0).all())  # non-causal
    out, _ = attn(h)
    v = attn.v_proj(h).view(2, -1, 2, 8).transpose(1, 2)
    torch.testing.assert_close(attn.o_proj((probs @ v).transpose(1, 2).flatten(2)), out, atol=1e-5, rtol=1e-4)
    # not a causal LM teacher
    assert "vit" not in supported_families() and "vit" in supported_families(encoders=True)


def test_student_save_reload_and_remote_code_without_attn2ssm(tmp_path):
    student = build_vision_student(deit(), mixer_options={"d_state": 4, "A_init": -1e-4}).eval()
    x = torch.randn(2, 1, 8, 8)
    want = student(pixel_values=x).logits
    student.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (
        cfg["auto_map"]["AutoModelForImageClassification"].endswith("Attn2SSMForImageClassification")
        and cfg["model_type"] == "attn2ssm"
    )
    again = AutoModelForImageClassification.from_pretrained(tmp_path)
    torch.testing.assert_close(again(pixel_values=x).logits, want)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch\nsys.modules['attn2ssm'] = None\nfrom transformers import AutoModelForImageClassification\n"
        "d = sys.argv[1]\nm = AutoModelForImageClassification.from_pretrained(d, trust_remote_code=True).eval()\n"
        "print(type(m).__module__, m(pixel_values=torch.load(d + '/x.pt')).logits.tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    module, logits = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert "attn2ssm_student_vision" in module
    torch.testing.assert_close(torch.tensor(json.loads(logits)), want, atol=1e-5, rtol=1e-5)


def test_builder_refuses_lm_mixers_and_bad_depth():
    with pytest.raises(ConfigError, match="not an encoder mixer"):
        build_vision_student(vit(), "mamba")
    with pytest.raises(ConfigError, match="bimamba"):
        build_vision_student(vit(), "bimamba", {"cls_position": "end"})
