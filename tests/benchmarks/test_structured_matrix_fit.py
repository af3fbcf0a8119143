"""``benchmarks/structured_matrix_fit.py`` (MOHAWK appendix C): every fitter reproduces a matrix
of its own class, the classes nest as they should, and main() runs end to end on a tiny teacher."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench_scripts import load_benchmark
from tiny_models import SENTENCES, make_tokenizer, tiny_config


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("structured_matrix_fit.py")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_toeplitz_is_the_band_mean_and_exact_on_toeplitz_matrices(bench):
    M = torch.tensor([[[1.0, 0.0], [3.0, 5.0]]])
    torch.testing.assert_close(bench.fit_toeplitz(M), torch.tensor([[[3.0, 0.0], [3.0, 3.0]]]))
    l, c = 9, torch.randn(2, 9, generator=_gen())
    i = torch.arange(l)
    lag = i[:, None] - i[None, :]
    T = torch.where(lag >= 0, c[:, lag.clamp_min(0)], torch.zeros(()))  # causal Toeplitz
    torch.testing.assert_close(bench.fit_toeplitz(T), T)


def _time_varying_ssm(m, l, n, g):
    """T[i, j] = C_i A_{i-1} ⋯ A_{j+1} B_j below the diagonal, D_i on it: semi-separable of order n."""
    A = torch.randn(m, l, n, n, generator=g) / n**0.5
    B, C, D = (
        torch.randn(m, l, n, generator=g),
        torch.randn(m, l, n, generator=g),
        torch.randn(m, l, generator=g),
    )
    T = torch.diag_embed(D)
    for j in range(l):
        state = B[:, j]  # (m, n): the state right after input j
        for i in range(j + 1, l):
            T[:, i, j] = (C[:, i] * state).sum(-1)
            state = (A[:, i] @ state[..., None])[..., 0]
    return T


def test_semiseparable_heuristic_reproduces_a_time_varying_ssm(bench):
    T = _time_varying_ssm(2, 12, 3, _gen(1))
    assert bench.hankel_rank(T).tolist() == [3, 3]
    torch.testing.assert_close(bench.fit_semiseparable(T, 3), T, atol=1e-5, rtol=1e-5)
    lower = bench.fit_semiseparable(T, 2)
    assert torch.equal(lower.diagonal(dim1=-2, dim2=-1), T.diagonal(dim1=-2, dim2=-1))  # the diagonal is kept
    assert (torch.linalg.matrix_norm(lower - T) > 1e-3).all() and (bench.hankel_rank(lower) <= 2).all()


def test_parametric_classes_nest(bench):
    """RetNet is SSD with one decay; LR is SSD with no decay; SSD without D is SSD with D = 0."""
    m, l, n = 2, 7, 3
    A, B = torch.rand(m, l, n, generator=_gen(2)), torch.rand(m, l, n, generator=_gen(3))
    logit = torch.randn(m, generator=_gen(4))
    torch.testing.assert_close(
        bench.retnet_matrix(A, B, logit), bench.ssd_matrix(A, B, logit[:, None].expand(m, l))
    )
    torch.testing.assert_close(
        bench.causal_low_rank(A, B), bench.ssd_matrix(A, B, torch.full((m, l), -200.0))
    )
    logits = torch.randn(m, l, generator=_gen(5))
    torch.testing.assert_close(bench.ssd_matrix(A, B, logits), bench.ssd_matrix(A, B, logits, torch.zeros(m)))
    with_d = bench.ssd_matrix(A, B, logits, torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(
        with_d - bench.ssd_matrix(A, B, logits), torch.diag_embed(torch.tensor([[0.5] * l, [-1.0] * l]))
    )


@pytest.mark.parametrize("kind", ["lr", "ssd", "ssd_no_d", "retnet"])
def test_gradient_fit_reproduces_a_member_of_its_class(bench, kind):
    m, l, n = 2, 10, 2
    g = _gen(6)
    true = bench.init_params(kind, m, l, n, generator=g)
    true["A"], true["B"] = torch.rand(m, l, n, generator=g), torch.rand(m, l, n, generator=g)
    if kind in ("ssd", "ssd_no_d"):
        true["logits"] = torch.randn(m, l, generator=g) - 2.0
    if kind == "ssd":
        true["D"] = torch.rand(m, generator=g)
    if kind == "retnet":
        true["logit"] = torch.randn(m, generator=g) - 1.0
    M = bench.build(kind, true)
    # its own parameters: 0
    assert bench.fit_gradient(M, kind, n, steps=0, lr=0.1, params=true).max().item() < 1e-6
    # from the paper's initialisation, AdamW gets within 3 % (relative) in 600 steps
    best = torch.fmin(
        bench.fit_gradient(M, kind, n, steps=600, lr=0.1), bench.fit_gradient(M, kind, n, steps=600, lr=0.01)
    )
    assert (best / torch.linalg.matrix_norm(M)).max().item() < 0.03, best


def test_tiny_run_writes_json_and_png(bench, tmp_path, monkeypatch):
    """main() end to end on a tiny random Llama (2 layers) and a one-file corpus."""
    import attn2ssm.teachers

    tok = make_tokenizer(300)
    config = tiny_config("llama")
    config.vocab_size = len(tok)
    teacher = AutoModelForCausalLM.from_config(config).eval()
    monkeypatch.setattr(attn2ssm.teachers, "load_teacher", lambda spec: (teacher, tok, None))
    corpus = tmp_path / "speech.txt"
    corpus.write_text(" ".join(SENTENCES * 10))
    out = tmp_path / "results"
    argv = [
        "--teacher",
        "tiny",
        "--corpus",
        str(corpus),
        "--seq-len",
        "16",
        "--samples",
        "2",
        "--states",
        "2,4",
        "--steps",
        "20",
        "--lrs",
        "0.1,0.01",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    data = json.loads((out / "structured_matrix_fit.json").read_text())
    assert data["settings"]["matrices"] == 4 and len(data["matrices"]) == 4  # 2 layers × 1 head × 2 samples
    assert set(data["results"]) == set(bench.CLASSES)
    for cls in bench.CLASSES:
        for n in ("2", "4"):
            r = data["results"][cls][n]
            assert r["mean"] >= 0 and r["std"] >= 0 and 0 <= r["relative_mean"] <= 1.5
    assert (
        data["results"]["ssd"]["2"]["best_lr"] in (0.1, 0.01)
        and data["results"]["ssm"]["4"]["max_hankel_rank"] <= 4
    )
    assert set(data["orderings"]["2"]["pairs"]) == {
        "ssm < ssd",
        "ssd < ssd_no_d",
        "ssd_no_d < retnet",
        "retnet < lr",
        "lr < toeplitz",
    }
    assert data["command"].startswith("python benchmarks/structured_matrix_fit.py") and "environment" in data
    assert (out / "structured_matrix_fit.png").read_bytes()[:4] == b"\x89PNG"
