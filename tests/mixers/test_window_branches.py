"""LoLCATs' window + linear mixer taken apart: the window branch alone is sliding-window softmax
attention, the linear branch alone is the same mixer without a window; sliding-window dropout runs
the linear branch in training only."""

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.student.convert import convert
from tiny_models import tiny_model

OPTIONS = {"feature_map": "hedgehog", "window": 4}


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("gqa_9x3")


def _mixer(teacher, **extra):
    return (
        convert(teacher, ["linear_attention"] * 2, {"linear_attention": {**OPTIONS, **extra}})
        .mixers()[0]
        .eval()
    )


def test_window_branch_is_sliding_window_softmax(teacher):
    mixer = _mixer(teacher)
    mixer.branch = "window"
    u = torch.randn(2, 11, 72, generator=torch.Generator().manual_seed(0))
    out, _ = mixer(u)
    q, k, v = mixer.project_qkv(u)
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    allowed = (i - j >= 0) & (i - j < 4)  # the last 4 keys, itself included
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=mixer.scaling)
    torch.testing.assert_close(out, mixer.merge_heads(ref), atol=1e-5, rtol=1e-5)


def test_linear_branch_is_the_mixer_without_its_window(teacher):
    both, plain = _mixer(teacher), _mixer(teacher, window=0)
    plain.load_state_dict({k: v for k, v in both.state_dict().items() if k != "window_factor"})
    both.branch = "linear"
    u = torch.randn(2, 11, 72, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(both(u)[0], plain(u)[0])


def test_window_dropout_runs_the_linear_branch_in_training_only(teacher):
    mixer = _mixer(teacher, window_dropout=0.999)
    u = torch.randn(1, 9, 72, generator=torch.Generator().manual_seed(2))
    linear = _mixer(teacher)
    linear.load_state_dict(mixer.state_dict())
    linear.branch = "linear"
    full = _mixer(teacher)
    full.load_state_dict(mixer.state_dict())
    torch.manual_seed(0)
    torch.testing.assert_close(mixer(u)[0], full(u)[0])  # eval: the whole mixer
    mixer.train()
    torch.manual_seed(0)
    torch.testing.assert_close(mixer(u)[0], linear(u)[0])  # training: the draw (p = 0.999) drops the window
    with pytest.raises(ConfigError, match="window_dropout"):
        _mixer(teacher, window_dropout=1.0)
