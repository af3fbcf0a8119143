"""LoRA adapters: start as the identity, merge to the same function, leave checkpoints plain."""

import pytest
import torch

from attn2ssm.distill.lora import attach_lora, merge_lora, state_dict_without_lora
from attn2ssm.distill.stages import select_trainable
from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from tiny_models import tiny_model


def _student():
    t = tiny_model("llama")
    return convert(t, ["linear_attention", "attention"])


def test_lora_starts_as_identity_and_merges_exactly():
    s = _student()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    before = s(input_ids=ids, use_cache=False).logits
    names = attach_lora(s, ["q_proj", "k_proj", "v_proj", "o_proj"], r=4, alpha=8)
    assert len(names) == 8  # q/k/v/o in the mixer layer and in the kept attention layer
    torch.testing.assert_close(s(input_ids=ids, use_cache=False).logits, before, atol=0, rtol=0)
    with torch.no_grad():
        for adapter in s.lora.values():
            adapter.B.normal_(std=0.05)
    adapted = s(input_ids=ids, use_cache=False).logits
    assert (adapted - before).abs().max() > 1e-3
    trainable = select_trainable(s, ["lora"])
    assert trainable and all(n.startswith("lora.") for n in trainable)
    assert not any(k.startswith("lora.") for k in state_dict_without_lora(s))
    merge_lora(s)
    assert not hasattr(s, "lora")
    torch.testing.assert_close(s(input_ids=ids, use_cache=False).logits, adapted, atol=1e-5, rtol=1e-5)
    assert all(not k.startswith("lora.") for k in s.state_dict())


def test_lora_bad_targets():
    with pytest.raises(ConfigError, match="match no linear layer"):
        attach_lora(_student(), ["nope_proj"])
