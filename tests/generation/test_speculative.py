"""Speculative decoding: the acceptance rules keep the verifier's distribution, greedy output is
token-identical to plain greedy for every verifier/draft pair (students of each mixer kind,
hybrids, the teacher), and transformers' own ``assistant_model=`` path works for students."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from attn2ssm.generation.sampling import accept_greedy, accept_sampled, warp
from attn2ssm.generation.speculative import speculative_generate
from attn2ssm.mixers.registry import MIXERS
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import tiny_model

KINDS = sorted(MIXERS)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


# ------------------------------------------------------------------------------- acceptance rules
def test_warp_matches_hand_computed_filters():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(warp(logits, 2.0), (logits / 2).softmax(-1))
    top2 = warp(logits, 1.0, top_k=2)
    torch.testing.assert_close(
        top2, torch.tensor([1.0, 1.0, 0, 0]) * torch.tensor([2.0, 1.0, 0, 0]).exp() / (torch.e**2 + torch.e)
    )
    # softmax([2,1,0,-1]) = [.644, .237, .087, .032]: top_p .85 keeps the two tokens that reach it
    p = warp(logits, 1.0, top_p=0.85)
    assert (p > 0).tolist() == [True, True, False, False]
    assert (warp(logits, 1.0, top_p=0.5) > 0).tolist() == [True, False, False, False]
    assert (warp(logits, 1.0, top_p=0.9) > 0).tolist() == [True, True, True, False]


def test_accept_greedy_hand_cases():
    v = torch.zeros(4, 5)
    v[0, 1] = v[1, 2] = v[2, 4] = v[3, 0] = 1.0  # verifier argmax: 1, 2, 4, 0
    assert accept_greedy(v, torch.tensor([1, 2, 3])) == (2, 4)  # third draft wrong → verifier's 4
    assert accept_greedy(v, torch.tensor([1, 2, 4])) == (3, 0)  # all right → bonus token
    assert accept_greedy(v, torch.tensor([0, 2, 4])) == (0, 1)
    assert accept_greedy(v[:1], torch.tensor([], dtype=torch.long)) == (0, 1)


def test_rejection_sampling_keeps_the_verifier_distribution():
    """Monte Carlo over 20k rounds with K = 2 fixed per-position distributions: the emitted
    token at each position is distributed as p (not q), and the acceptance rate is
    Σ min(p, q) at the first position, as the theory says."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    n_trials = 20000
    first, second, accepted_first = torch.zeros(4), torch.zeros(4), 0
    n_second = 0
    for _ in range(n_trials):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        n, nxt = accept_sampled(p, q, drafts, g)
        out = drafts[:n].tolist() + [nxt]
        first[out[0]] += 1
        accepted_first += n >= 1
        if len(out) > 1:
            second[out[1]] += 1
            n_second += 1
    assert _tv(first / n_trials, p[0]) < 0.015
    assert _tv(second / n_second, p[1]) < 0.02
    assert _tv(first / n_trials, q[0]) > 0.3  # the test could fail: q is far from p
    assert abs(accepted_first / n_trials - float(torch.minimum(p[0], q[0]).sum())) < 0.015


# ------------------------------------------------------------------------------- end to end
def _models(kind, verifier_ratio=0.5, draft_ratio=0.0, noise=0.0):
    torch.manual_seed(0)
    teacher = tiny_model("llama").eval()
    n = teacher.config.num_hidden_layers
    verifier = convert(teacher, make_plan(n, kind, attention_ratio=verifier_ratio)).eval()
    draft = convert(teacher, make_plan(n, kind, attention_ratio=draft_ratio)).eval()
    if noise:
        with torch.no_grad():
            draft.get_output_embeddings().weight.add_(
                noise * torch.randn_like(draft.get_output_embeddings().weight)
            )
    return teacher, verifier, draft


def _greedy(model, ids, n):
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def _self_draft(model):
    """A draft that agrees with the verifier most of the time: the verifier itself, slightly noised."""
    import copy

    draft = copy.deepcopy(model)
    with torch.no_grad():
        w = draft.get_output_embeddings().weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    return draft


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_equals_plain_greedy(kind, k):
    teacher, verifier, _ = _models(kind)
    draft = _self_draft(verifier)  # partial acceptance: both the accept and the rollback paths run
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    out = speculative_generate(verifier, draft, ids, max_new_tokens=24, num_draft_tokens=k)
    assert torch.equal(out.sequences, _greedy(verifier, ids, 24))
    s = out.stats
    assert 0 < s.accepted < s.drafted, s.as_dict()  # both paths exercised
    assert s.generated == 24 and s.rounds == 24 - s.accepted


@pytest.mark.parametrize("kind", KINDS)
def test_any_model_can_draft_or_verify(kind):
    teacher, student, pure = _models(kind)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(5))
    for verifier, draft in (
        (teacher, pure),
        (pure, teacher),
        (student, pure),
        (pure, student),
        (teacher, _self_draft(teacher)),
    ):
        out = speculative_generate(verifier, draft, ids, max_new_tokens=12, num_draft_tokens=3)
        assert torch.equal(out.sequences, _greedy(verifier, ids, 12))


def test_transformers_assistant_model_path():
    """``student.generate(..., assistant_model=draft)`` runs transformers' assisted decoding on
    our cache (activate_past_recording / crop) for student and teacher pairs."""
    teacher, verifier, draft = _models("mamba2")
    draft = _self_draft(verifier)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(6))
    for v, d in ((verifier, draft), (teacher, verifier), (verifier, teacher)):
        hf = v.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, assistant_model=d)
        assert torch.equal(hf, _greedy(v, ids, 16))


def test_stops_at_eos_and_streams():
    _, verifier, _ = _models("linear_attention")
    draft = _self_draft(verifier)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(7))
    plain = _greedy(verifier, ids, 20)[0, 6:].tolist()
    eos = plain[9]
    stop = plain.index(eos)

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = speculative_generate(
        verifier, draft, ids, max_new_tokens=20, num_draft_tokens=4, eos_token_id=[eos], streamer=streamer
    )
    assert out.sequences[0, 6:].tolist() == plain[: stop + 1]
    assert (
        streamer.chunks[0] == ids[0].tolist()
        and sum(streamer.chunks[1:], []) == plain[: stop + 1]
        and streamer.ended
    )


def test_sampling_follows_the_verifier_distribution():
    """Two sampled tokens (top-k 3 → 9 outcomes), 600 speculative runs: their empirical law is
    the verifier's exact joint law, not the (different) draft's."""
    _, verifier, draft = _models("mamba2", noise=0.0)
    draft = _self_draft(draft)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(8))
    opts = dict(temperature=1.5, top_k=3)

    def joint(model):
        with torch.no_grad():
            p1 = warp(model(ids).logits[0, -1], **opts)
            law = {}
            for t1 in p1.nonzero().flatten().tolist():
                p2 = warp(model(torch.cat([ids, torch.tensor([[t1]])], 1)).logits[0, -1], **opts)
                for t2 in p2.nonzero().flatten().tolist():
                    law[(t1, t2)] = float(p1[t1] * p2[t2])
        return law

    exact, draft_law = joint(verifier), joint(draft)
    g = torch.Generator().manual_seed(9)
    counts: dict = {}
    n = 600
    for _ in range(n):
        seq = speculative_generate(
            verifier, draft, ids, max_new_tokens=2, num_draft_tokens=2, do_sample=True, generator=g, **opts
        ).sequences
        key = tuple(seq[0, 5:].tolist())
        counts[key] = counts.get(key, 0) + 1
    keys = set(exact) | set(counts) | set(draft_law)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    tv_draft = 0.5 * sum(abs(draft_law.get(k, 0.0) - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.09, (tv, tv_draft)
    assert tv_draft > 0.2  # the draft alone would fail this test


def test_bad_inputs_are_clear_errors():
    teacher, verifier, draft = _models("mamba2")
    from attn2ssm.errors import ConfigError

    with pytest.raises(ConfigError, match="one prompt"):
        speculative_generate(verifier, draft, torch.zeros(2, 4, dtype=torch.long))
    other = tiny_model("llama")
    other.resize_token_embeddings(300)
    with pytest.raises(ConfigError, match="vocabulary"):
        speculative_generate(verifier, other, torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(temperature=0.0), "temperature=0 with do_sample=True"),
        (dict(top_p=1.5), "top_p=1.5 is outside (0, 1]"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_k=-2), "top_k=-2"),
    ],
)
def test_sampling_settings_out_of_range_are_clear_errors(opts, needle):
    from attn2ssm.errors import ConfigError

    _, verifier, draft = _models("mamba2")
    with pytest.raises(ConfigError) as info:
        speculative_generate(verifier, draft, torch.zeros(1, 4, dtype=torch.long), do_sample=True, **opts)
    assert needle in str(info.value) and "\n" not in str(info.value)
