"""The same students on CUDA as on the CPU (skipped where no GPU is present, e.g. in CI).

The pure-PyTorch CPU path is the reference. On a GPU every mixer kind, pure and hybrid with kept
sliding-window attention, must give the CPU's logits for a left-padded batch, keep its cache forms
in agreement (one full forward == chunked prefill == prefill then one token at a time), generate the
CPU's greedy tokens, and train: gradients reach every trainable parameter, finite, on the GPU.
Optional CUDA kernels (mamba_ssm, causal_conv1d) are used where they import, so the tolerances are
those of fp32 with TF32 switched off.
"""

import copy
import os

import pytest
import torch

from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.mixers.registry import MIXERS
from cache_forms import full_and_pieces, positions
from tiny_models import tiny_student

# the device compared with the CPU; ATTN2SSM_TEST_DEVICE=cpu dry-runs these tests' logic on a CPU
DEVICE = torch.device(os.environ.get("ATTN2SSM_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

KINDS = sorted(MIXERS)
SHAPES = [("llama", 0.0), ("gemma2", 0.5)]


@pytest.fixture(autouse=True)
def _exact_fp32():
    """TF32 off for matmuls and cuDNN convolutions while a test runs (it rounds inputs to 10 bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _on(t):
    return t.device.type == DEVICE.type


def _batch(length=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    return ids, mask


def _close(a, b, tol=2e-4):
    scale = b.abs().max().item()
    err = (a.float().cpu() - b.float().cpu()).abs().max().item()
    assert err <= tol * max(1.0, scale), f"max abs error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,ratio", SHAPES)
@torch.no_grad()
def test_cuda_logits_and_cache_forms_match_cpu(kind, family, ratio):
    cpu = tiny_student(family, kind, ratio)
    gpu = copy.deepcopy(cpu).to(DEVICE)
    ids, mask = _batch()
    ref = cpu(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    real = mask.bool()
    full, chunked = full_and_pieces(gpu, ids.to(DEVICE), mask.to(DEVICE), [9, 7, 8])
    _close(full[real.to(DEVICE)], ref[real])
    _close(chunked[real.to(DEVICE)], ref[real])
    _, stepped = full_and_pieces(gpu, ids.to(DEVICE), mask.to(DEVICE), [10] + [1] * 14)
    _close(stepped[real.to(DEVICE)], ref[real])
    assert all(_on(p) for p in gpu.parameters())


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_cuda_generate_equals_cpu(kind):
    cpu = tiny_student("llama", kind, 0.5)
    gpu = copy.deepcopy(cpu).to(DEVICE)
    if DEVICE.type != "cpu":
        assert cpu_decode_layout(gpu) == 0  # CPU decode mode leaves a GPU model alone
    ids, mask = _batch(12)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = cpu.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = gpu.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), **kwargs)
    assert _on(got) and got.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_backward_reaches_every_mixer_parameter(kind):
    cpu = tiny_student("llama", kind, 0.0).train()
    gpu = copy.deepcopy(cpu).to(DEVICE).train()
    ids, mask = _batch()
    losses = []
    for model, dev in ((cpu, "cpu"), (gpu, DEVICE)):
        out = model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions(mask).to(dev),
            labels=ids.to(dev),
        )
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    cpu_grads = dict(cpu.named_parameters())
    checked = 0
    for name, p in gpu.named_parameters():
        want = cpu_grads[name].grad
        if want is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and _on(p.grad), name
        _close(p.grad, want, tol=1e-3)
        checked += 1
    mixer_grads = [p.grad for m in gpu.mixers().values() for p in m.parameters() if p.grad is not None]
    assert checked > len(mixer_grads) > 0
