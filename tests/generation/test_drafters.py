"""Drafters (generation/drafters.py) and speculative decoding with the student as the target
(Mamba in the Llama §4): prompt lookup proposes what followed the latest occurrence of the text's
tail; with it or a model draft, greedy output equals the target's plain greedy output for a pure
Mamba-2 target and a 25 % hybrid, and the target's state after a run equals that of a model that
never saw the rejected drafts."""

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.generation.drafters import ModelDrafter, NgramDrafter, Runner, make_drafter
from attn2ssm.generation.speculative import DraftLength, speculative_generate
from attn2ssm.student.cache import MixerStateLayer
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import perturb_new_mixer_parameters, tiny_model


# ------------------------------------------------------------------------------- prompt lookup
def _propose(text, k, max_n=3):
    drafter = NgramDrafter(max_n=max_n)
    drafter.start(torch.tensor([text]))
    return drafter.propose(text, k, None, None)[0]


def test_ngram_takes_the_longest_then_latest_match():
    # tail "1 2 3": the trigram occurred once (followed by 7 8); the bigram "2 3" more recently (→ 9)
    text = [1, 2, 3, 7, 8, 0, 2, 3, 9, 5, 1, 2, 3]
    assert _propose(text, 2) == [7, 8]
    assert _propose(text, 2, max_n=2) == [9, 5]  # the latest "2 3" wins when trigrams are not tried
    # unigram only: latest earlier "3" is at position 6, followed by 9, 5, 1, 2 …
    assert _propose([4, 3, 9, 5, 6, 3], 3, max_n=1) == [9, 5, 6]


def test_ngram_continues_through_its_own_proposals():
    """A loop "a b c a b c": the continuation of the latest match runs off the known text, so
    the lookup repeats from the proposed tokens and still fills k."""
    assert _propose([5, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_ngram_proposes_k_or_nothing():
    """A continuation that reaches the end of the text continues through the proposals (the text
    is periodic there), so a lookup that finds anything fills k; one that finds nothing is empty."""
    assert _propose([1, 2, 3, 4], 4) == []  # every token new: nothing to look up
    assert _propose([1, 7, 0], 4) == []  # 0 never had a successor
    assert _propose([1, 2, 9, 4, 7, 4], 4) == [7, 4, 7, 4]  # "4" → 7 4, then the loop
    assert _propose([6, 1, 2, 5, 8, 1, 2], 5) == [5, 8, 1, 2, 5]  # "1 2" → 5 8 1 2, again → 5
    assert _propose([7, 0, 5, 7], 4) == [0, 5, 7, 0]
    assert _propose([6, 1, 2, 5, 8, 1, 2], 2) == [5, 8]  # k bounds a long continuation


def test_ngram_index_grows_with_the_text():
    drafter = NgramDrafter(max_n=2)
    text = [1, 2, 3]
    drafter.start(torch.tensor([text]))
    assert drafter.propose(text, 2, None, None)[0] == []
    text += [1, 2]
    assert drafter.propose(text, 2, None, None)[0] == [3, 1]


def test_ngram_sampling_distributions_are_one_hot():
    drafter = NgramDrafter(vocab_size=10)
    drafter.start(torch.tensor([[1, 2, 1]]))
    tokens, probs = drafter.propose([1, 2, 1], 2, {"temperature": 1.0}, None)
    assert (
        tokens == [2, 1]
        and [int(p.argmax()) for p in probs] == tokens
        and all(float(p.sum()) == 1.0 for p in probs)
    )


def test_bad_drafters_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown drafter"):
        make_drafter("lookup", 256)
    with pytest.raises(ConfigError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)
    assert isinstance(make_drafter("ngram:5", 256), NgramDrafter) and make_drafter("ngram:5", 256).max_n == 5


# ------------------------------------------------------------------------------- end to end
def _student(ratio, seed=0):
    """A 4-layer tiny Llama converted to Mamba-2 (25 %: one layer keeps attention)."""
    teacher = tiny_model("llama", seed=seed, layers=4)
    torch.manual_seed(seed)
    student = convert(teacher, make_plan(4, "mamba2", attention_ratio=ratio))
    perturb_new_mixer_parameters(student)
    student.generation_config.eos_token_id = (
        None  # plain generate runs the full length, as speculation here does
    )
    return student.eval()


def _plain(model, ids, n):
    # an explicit mask: generate would otherwise take the prompt's 0 tokens for padding
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )


def _prompts():
    g = torch.Generator().manual_seed(11)
    passage = torch.randint(0, 256, (1, 12), generator=g)
    return {
        "distinct": torch.randperm(256, generator=g)[:9][None],  # lookup finds nothing in the prompt
        # a passage to repeat
        "copy": torch.cat([passage, torch.randint(0, 256, (1, 3), generator=g), passage[:, :4]], 1),
        "random": torch.randint(0, 32, (1, 20), generator=g),  # many short matches, most wrong
    }


def _echo(target, name):
    """A prompt P, the target's own greedy continuation G of it, then P again: lookup proposes G,
    which the target partly repeats (its state after P G P is not its state after P)."""
    p = _prompts()[name]
    return torch.cat([p, _plain(target, p, 24)[:, p.shape[1] :], p], 1)


@pytest.mark.parametrize("ratio", [0.0, 0.25], ids=["pure", "hybrid25"])
@pytest.mark.parametrize("prompt", ["distinct", "copy", "random", "echo"])
@pytest.mark.parametrize("k", [1, 4])
def test_ngram_speculation_equals_plain_greedy(ratio, prompt, k):
    target = _student(ratio)
    assert ("attention" in target.config.layer_plan) == (ratio > 0)
    ids = _echo(target, "distinct") if prompt == "echo" else _prompts()[prompt]
    out = speculative_generate(target, "ngram", ids, max_new_tokens=24, num_draft_tokens=k)
    assert torch.equal(out.sequences, _plain(target, ids, 24))
    s = out.stats
    assert s.generated == 24 and s.rounds == 24 - s.accepted and s.drafted <= k * s.rounds


def test_ngram_rounds_cover_nothing_fewer_and_rejections():
    """One run where lookup proposes nothing in some rounds, fewer than num_draft_tokens in some
    (the last rounds, where max_new_tokens bounds k), and has drafts rejected in some: every path
    of the loop runs and the output is still exact."""
    target = _student(0.0)
    ids = _echo(target, "copy")
    seen = []

    class Watch(NgramDrafter):
        def propose(self, text, k, sampling, generator):
            drafts, probs = super().propose(text, k, sampling, generator)
            seen.append(len(drafts))
            return drafts, probs

    out = speculative_generate(target, Watch(), ids, max_new_tokens=32, num_draft_tokens=6)
    assert torch.equal(out.sequences, _plain(target, ids, 32))
    assert 0 in seen and any(0 < n < 6 for n in seen) and 6 in seen
    assert out.stats.accepted < out.stats.drafted


@pytest.mark.parametrize("ratio", [0.0, 0.25], ids=["pure", "hybrid25"])
def test_model_draft_equals_plain_greedy(ratio):
    """A shallow draft (2 of the teacher's 4 layers) as a model draft, and as an object."""
    target = _student(ratio)
    teacher = tiny_model("llama", layers=4)
    draft = convert(teacher, make_plan(2, "mamba2"), depth=2).eval()
    for prompt in ("copy", "random"):
        ids = _prompts()[prompt]
        for d in (draft, ModelDrafter(draft)):
            out = speculative_generate(target, d, ids, max_new_tokens=20, num_draft_tokens=3)
            assert torch.equal(out.sequences, _plain(target, ids, 20))


def _noised_copy(model):
    """A draft that agrees with the target part of the time: the target with a noised head."""
    import copy

    draft = copy.deepcopy(model)
    with torch.no_grad():
        w = draft.get_output_embeddings().weight
        w.add_(0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    return draft


@pytest.mark.parametrize(
    "ratio,drafter",
    [(0.0, "ngram"), (0.0, "model"), (0.25, "model")],
    ids=["pure-ngram", "pure-model", "hybrid25-model"],
)
def test_target_state_after_speculation_never_saw_the_rejected_drafts(ratio, drafter):
    """After a run the target's cache holds the text but its last token; its states (and KV
    rows) equal those of the same model fed exactly that text once."""
    target = _student(ratio)
    ids = _echo(target, "distinct")
    cache = Runner(target)
    with torch.no_grad():
        cache.feed(ids[:, :-1], keep=1)
    draft = "ngram" if drafter == "ngram" else _noised_copy(target)
    out = speculative_generate(
        target, draft, ids, max_new_tokens=20, num_draft_tokens=4, past_key_values=(cache.cache, None)
    )
    assert 0 < out.stats.accepted < out.stats.drafted
    fresh = Runner(target)
    with torch.no_grad():
        fresh.feed(out.sequences[:, :-1], keep=1)
    assert cache.cache.get_seq_length() == fresh.cache.get_seq_length() == out.sequences.shape[1] - 1
    for a, b in zip(cache.cache.layers, fresh.cache.layers):
        if isinstance(a, MixerStateLayer):
            assert a.states.keys() == b.states.keys() and a.states
            for key in a.states:
                for x, y in zip(_tensors(a.states[key]), _tensors(b.states[key])):
                    torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)


def _tensors(value):
    import dataclasses

    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def test_ngram_sampling_runs_and_stops():
    target = _student(0.0)
    ids = _prompts()["copy"]
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target, "ngram", ids, max_new_tokens=12, num_draft_tokens=3, do_sample=True, top_k=5, generator=g
    )
    assert out.sequences.shape[1] == ids.shape[1] + 12 and out.stats.generated == 12


# ------------------------------------------------------------------------- num_draft_tokens="auto"
def test_draft_length_expected_tokens_and_choice_by_hand():
    """tokens(k) = 1 + α + … + α^k; the choice maximises tokens(k) / seconds(k)."""
    policy = DraftLength(max_k=4)
    policy.kept, policy.tried = 1.0, 2.0  # α = 0.5
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1.75)
    assert policy.expected_tokens(4) == pytest.approx(1.9375)
    # measured: a plain step 10 ms, a round with 2 drafts 14 ms, with 4 drafts 20 ms:
    # rates 1/10 = 0.1, 1.75/14 = 0.125, 1.9375/20 = 0.097; k = 3 interpolates (17 ms: 1.875/17 = 0.110),
    # k = 1 extrapolates by the prior's 0.05 plain steps a draft (13.5 ms: 1.5/13.5 = 0.111)
    policy.seconds = {0: 0.010, 2: 0.014, 4: 0.020}
    assert policy.choose(room=10) == 2
    policy.kept, policy.tried = 0.2, 2.0  # α = 0.1: 1.11/14 ms < 1/10 ms — drafting does not pay
    assert policy.choose(room=10) == 0
    assert policy._round_seconds(3) == pytest.approx(0.017) and policy._round_seconds(1) == pytest.approx(
        0.0135
    )
    assert policy._round_seconds(6) == pytest.approx(0.021)
    policy.kept, policy.tried = 1.0, 2.0
    assert policy.choose(room=1) == 1  # room bounds k (1 draft: 1.5 / 13.5 ms = 0.111 > 0.1)
    assert policy.choose(room=0) == 0


def test_draft_length_learns_acceptance_from_rounds_and_probes():
    policy = DraftLength(max_k=6)
    assert policy.alpha == pytest.approx(0.6)  # the prior
    policy.observe(4, 1, 0.02)  # one of four kept: 1 kept, 2 judged (the rest never were)
    assert policy.alpha == pytest.approx((0.6 * 2 * 0.9 + 1) / (2 * 0.9 + 2))
    policy.observe(0, 0, 0.01)
    assert policy.seconds == {4: 0.02, 0: 0.01}
    policy.observe(0, 0, 0.02)
    assert policy.seconds[0] == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)  # a moving average
    for _ in range(40):
        policy.observe_probe(False)
    assert policy.alpha < 0.01 and policy.choose(room=10) == 0
    for _ in range(40):  # lookup starts being right: drafting resumes
        policy.observe_probe(True)
    assert policy.alpha > 0.95 and policy.choose(room=10) >= 4


def test_draft_length_probes_a_model_drafter_every_few_plain_rounds():
    policy = DraftLength(max_k=6, free=False, probe_every=3)
    policy.kept, policy.tried = 0.01, 10.0
    policy.seconds = {0: 0.01, 1: 0.018}
    assert policy.choose(room=10) == 0
    for _ in range(3):
        policy.observe(0, 0, 0.01)
    assert policy.choose(room=10) == 1  # a probe: the draft may have become right
    policy.observe(1, 0, 0.018)
    assert policy.choose(room=10) == 0


def test_draft_length_prices_a_model_drafts_tokens_without_its_catch_up():
    """seconds(k) = verify(k) + k · draft; the draft's seconds per token come from rounds after a
    round with drafts, not from the first round after plain steps (the draft then catches up)."""
    policy = DraftLength(max_k=4, free=False)
    policy.observe(0, 0, 0.010)
    policy.observe(2, 2, 0.017, 0.050)  # after a plain round: the draft caught up, not counted
    assert policy.draft is None
    policy.observe(2, 2, 0.017, 0.008)
    assert policy.draft == pytest.approx(0.004)
    # α = 0.5: k = 2 gives 1.75 tokens in 17 + 8 ms = 70/s < a plain step's 100/s
    policy.kept, policy.tried = 1.0, 2.0
    assert policy.choose(room=10) == 0
    policy.draft = 0.0  # free drafts: 1.75 / 17 ms = 103/s > 100/s
    assert policy.choose(room=10) >= 1


@pytest.mark.parametrize("ratio", [0.0, 0.25], ids=["pure", "hybrid25"])
@pytest.mark.parametrize("prompt", ["copy", "random", "echo"])
def test_auto_draft_length_equals_plain_greedy(ratio, prompt):
    """num_draft_tokens="auto" with prompt lookup and with a model draft: the same tokens as
    plain greedy, whatever K each round chose (0 included)."""
    target = _student(ratio)
    ids = _echo(target, "distinct") if prompt == "echo" else _prompts()[prompt]
    teacher = tiny_model("llama", layers=4)
    model = convert(teacher, make_plan(2, "mamba2"), depth=2).eval()
    for draft in ("ngram", model):
        out = speculative_generate(target, draft, ids, max_new_tokens=24, num_draft_tokens="auto")
        assert torch.equal(out.sequences, _plain(target, ids, 24))
        s = out.stats
        assert s.generated == 24 and sum(s.draft_lengths.values()) == s.rounds
        assert all(0 <= k <= 7 for k in s.draft_lengths)


def test_bad_num_draft_tokens_is_one_clear_error():
    target = _student(0.0)
    for bad in (0, "four", 2.5):
        with pytest.raises(ConfigError, match="num_draft_tokens"):
            speculative_generate(target, "ngram", _prompts()["copy"], max_new_tokens=4, num_draft_tokens=bad)
