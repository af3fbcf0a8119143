"""Teacher-measured layer selection: which layers keep attention (scores, top-k, padding, auto_plan)."""

import math

import pytest
import torch

import attn2ssm.student  # noqa: F401  (registers Auto classes)
from attn2ssm.distill import layer_selection
from attn2ssm.distill.layer_selection import auto_plan, select_attention_layers
from attn2ssm.distill.losses import forward_kl
from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import MIXERS
from attn2ssm.student.convert import convert
from tiny_models import TINY_CONFIGS, tiny_model

LA = "linear_attention"
A = "attention"


def _ids(b=2, l=12, seed=0):
    return torch.randint(0, 256, (b, l), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("llama", layers=4)


def _naive_scores(teacher, ids, mask=None, options=None, base_plan=None):
    """Reference: a full ``convert`` per layer and a full forward from the embeddings (None for a
    layer ``base_plan`` has already converted)."""
    n = teacher.config.num_hidden_layers
    base_plan = base_plan or [A] * n
    with torch.no_grad():
        ref = teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = []
        for i in range(n):
            if base_plan[i] != A:
                out.append(None)
                continue
            plan = [LA if j == i else base_plan[j] for j in range(n)]
            torch.manual_seed(0)  # the already-converted layers start from the same init in every student
            student = convert(teacher, plan, {LA: options or {}})
            out.append(
                forward_kl(
                    student(input_ids=ids, attention_mask=mask, use_cache=False).logits, ref, mask
                ).item()
            )
    return out


def test_selection_scores_and_top_k(teacher):
    ids = _ids()
    keep, scores = select_attention_layers(
        teacher, ids, LA, {"feature_map": "hedgehog"}, keep=2, progress=False
    )
    assert len(scores) == 4 and all(math.isfinite(s) and s >= 0 for s in scores)
    assert keep == sorted(sorted(range(4), key=lambda i: -scores[i])[:2])
    torch.testing.assert_close(
        torch.tensor(scores),
        torch.tensor(_naive_scores(teacher, ids, options={"feature_map": "hedgehog"})),
        rtol=1e-4,
        atol=1e-6,
    )
    # micro-batches give the same per-token mean
    _, split = select_attention_layers(teacher, _ids(b=3), LA, keep=1, batch_size=2, progress=False)
    _, whole = select_attention_layers(teacher, _ids(b=3), LA, keep=1, progress=False)
    torch.testing.assert_close(torch.tensor(split), torch.tensor(whole), rtol=1e-4, atol=1e-7)
    assert select_attention_layers(teacher, ids, LA, keep=0, progress=False)[0] == []
    with pytest.raises(ConfigError, match="keep"):
        select_attention_layers(teacher, ids, LA, keep=5, progress=False)


def test_selection_with_padding_and_teacher_untouched(teacher):
    ids, mask = _ids(l=10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    _, scores = select_attention_layers(teacher, ids, LA, keep=1, attention_mask=mask, progress=False)
    torch.testing.assert_close(
        torch.tensor(scores), torch.tensor(_naive_scores(teacher, ids, mask)), rtol=1e-4, atol=1e-6
    )
    after = teacher.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not teacher.training


def test_selection_finds_a_planted_layer():
    """One layer's o_proj scaled up (the others' down) makes converting that layer the most damaging.

    The others are quietened because in a random tiny model layer 0 is by far the most damaging
    to convert on its own (its attention output is as large as the embeddings it adds to).
    """
    for planted in (1, 2, 3):
        teacher = tiny_model("llama", seed=1, layers=4)
        with torch.no_grad():
            for i, layer in enumerate(teacher.model.layers):
                layer.self_attn.o_proj.weight.mul_(3.0 if i == planted else 0.01)
        keep, scores = select_attention_layers(teacher, _ids(l=16), LA, keep=1, progress=False)
        assert keep == [planted], scores
        assert scores[planted] > 3 * max(s for i, s in enumerate(scores) if i != planted), scores


def test_ties_go_to_the_lower_index(teacher, monkeypatch):
    monkeypatch.setattr(layer_selection, "forward_kl", lambda s, t, m=None: torch.tensor(0.5))
    keep, scores = select_attention_layers(teacher, _ids(), LA, keep=2, progress=False)
    assert scores == [0.5] * 4 and keep == [0, 1]


def test_auto_plan(teacher):
    plan, scores = auto_plan(teacher, _ids(), LA, None, 0.5, progress=False)
    kept = [i for i, kind in enumerate(plan) if kind == A]
    assert len(kept) == 2 and set(plan) == {A, LA}
    assert kept == sorted(sorted(range(4), key=lambda i: (-scores[i], i))[:2])


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_every_mixer_kind_scores(kind, teacher):
    """Mamba-family mixers too: every layer gets a score."""
    keep, scores = select_attention_layers(teacher, _ids(), kind, keep=2, progress=False)
    assert len(keep) == 2 and len(scores) == 4 and all(math.isfinite(s) and s >= 0 for s in scores)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_scores_from_replayed_layers_match_full_forwards(family):
    """The probe starts at the swapped layer (the layers below replay their recorded outputs):
    the scores equal those of full forwards of a fully converted student, in every family."""
    teacher = tiny_model(family)
    ids = _ids(b=3, l=10)
    _, scores = select_attention_layers(teacher, ids, LA, keep=1, batch_size=2, progress=False)
    torch.testing.assert_close(
        torch.tensor(scores), torch.tensor(_naive_scores(teacher, ids)), rtol=1e-4, atol=1e-6
    )


def test_layers_below_the_swap_are_not_recomputed(teacher, monkeypatch):
    """Layer 0's attention runs in the recording forward only: every later candidate replays it.
    Afterwards the layers compute again and an instance ``forward`` (accelerate's hooks) is kept."""
    calls = []
    real_convert = layer_selection.convert

    def counting_convert(*args, **kwargs):
        probe = real_convert(*args, **kwargs)
        probe.base.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        hooked = probe.base.model.layers[1]
        own_forward = hooked.forward

        def counted(*args, **kwargs):
            calls.append(2)
            return own_forward(*args, **kwargs)

        hooked.forward = counted
        counting_convert.probe = probe
        return probe

    monkeypatch.setattr(layer_selection, "convert", counting_convert)
    select_attention_layers(teacher, _ids(), LA, keep=1, progress=False)
    # layer 0's attention: the recording forward (candidate 0 swaps it out; 1-3 replay it);
    # layer 1 (through its own instance forward): recording, candidates 0 and 1
    assert calls.count(1) == 1 and calls.count(2) == 3, calls
    layers = counting_convert.probe.base.model.layers
    assert "forward" not in layers[0].__dict__ and "forward" in layers[1].__dict__
    calls.clear()
    counting_convert.probe(input_ids=_ids(), use_cache=False)
    assert calls == [1, 2]


def test_stepwise_student_scores_match_full_forwards(teacher):
    """A partly converted student as the probe: only its attention layers get scores, each the KL
    of the student with that layer converted too, against the teacher."""
    base_plan = [LA, A, A, LA]
    torch.manual_seed(0)
    student = convert(teacher, base_plan, {LA: {}})
    ids = _ids()
    keep, scores = select_attention_layers(teacher, ids, LA, keep=1, student=student, progress=False)
    naive = _naive_scores(teacher, ids, base_plan=base_plan)
    assert scores[0] is None and scores[3] is None and keep[0] in (1, 2)
    torch.testing.assert_close(torch.tensor(scores[1:3]), torch.tensor(naive[1:3]), rtol=1e-4, atol=1e-6)
    assert student.config.layer_plan == base_plan and student.config.layer_plan[1] == A
