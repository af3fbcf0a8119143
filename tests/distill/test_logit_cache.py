"""The teacher-logit cache: the top-k + tail KL against the full KL (hand-computed on a tiny
vocabulary), its gradient, and the on-disk cache (hits, misses, keys, atomic writes, resume)."""

import copy
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attn2ssm.distill.logit_cache import (
    LogitCache,
    block_digest,
    find_cache_dir,
    teacher_fingerprint,
    teacher_source_key,
)
from attn2ssm.distill.losses import forward_kl, kd_ce_loss, topk_targets
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError, TrainingError
from tiny_models import BASE_RECIPE, tiny_model

V = 7


def _softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def _hand_kls(s_row, t_row, k):
    """(full KL, top-k + tail KL, tail-conditional KL) in plain Python floats."""
    p, q = _softmax(t_row), _softmax(s_row)
    top = sorted(range(len(p)), key=lambda i: -p[i])[:k]
    rest = [j for j in range(len(p)) if j not in top]
    full = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    P, Q = sum(p[j] for j in rest), sum(q[j] for j in rest)
    sparse = sum(p[i] * math.log(p[i] / q[i]) for i in top) + (P * math.log(P / Q) if rest else 0.0)
    tail = sum(p[j] / P * math.log((p[j] / P) / (q[j] / Q)) for j in rest) if rest else 0.0
    return full, sparse, P * tail


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, V, generator=g, dtype=torch.float64) * 2, torch.randn(
        2, 3, V, generator=g, dtype=torch.float64
    ) * 2


@pytest.mark.parametrize("k", range(1, V + 1))
def test_sparse_kl_against_the_hand_computed_full_kl(logits, k):
    s, t = logits
    hand = [_hand_kls(s[b, i].tolist(), t[b, i].tolist(), k) for b in range(2) for i in range(3)]
    full, sparse, gap = (sum(h[j] for h in hand) / len(hand) for j in range(3))
    got = forward_kl(s, topk_targets(t, k)).item()
    assert got == pytest.approx(sparse, rel=1e-5, abs=1e-7)
    assert forward_kl(s, t).item() == pytest.approx(full, rel=1e-5)
    # the top-k + tail KL is the full KL minus P·KL(p(·|tail) ‖ q(·|tail)) ≥ 0: exact at k = V
    assert full - got == pytest.approx(gap, rel=1e-4, abs=1e-6) and full - got >= -1e-7
    if k == V:
        assert got == pytest.approx(full, rel=1e-6)


def test_gradient_is_q_minus_p_tilde_and_passes_gradcheck(logits):
    s, t = logits
    targets = topk_targets(t, 3)
    x = s.clone().requires_grad_(True)
    forward_kl(x, targets).backward()
    q, p = torch.softmax(s, -1), torch.softmax(t, -1)
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, targets.indices, True)
    P = (p * ~in_top).sum(-1, keepdim=True)
    Q = (q * ~in_top).sum(-1, keepdim=True)
    p_tilde = torch.where(in_top, p, P * q / Q)
    torch.testing.assert_close(x.grad, (q - p_tilde) / 6, rtol=1e-5, atol=1e-7)  # 6 tokens
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.autograd.gradcheck(
        lambda y: forward_kl(y, targets, mask, chunk_size=2), (s.clone().requires_grad_(True),)
    )
    # at k = V the gradient is the full KL's
    x.grad = None
    forward_kl(x, topk_targets(t, V)).backward()
    torch.testing.assert_close(x.grad, (q - p) / 6, rtol=1e-5, atol=1e-8)


def test_mask_chunks_kd_ce_and_temperature(logits):
    s, t = (x.float() for x in logits)
    targets = topk_targets(t, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    a = forward_kl(s, targets, mask, chunk_size=1)
    b = forward_kl(s[mask.bool()], targets[mask.bool()], chunk_size=64)
    torch.testing.assert_close(a, b)
    ids = torch.randint(0, V, (2, 3))
    _, ce, _ = kd_ce_loss(s, targets, ids, mask, labels="teacher")
    _, ce_full, _ = kd_ce_loss(s, t, ids, mask, labels="teacher")
    torch.testing.assert_close(ce, ce_full)  # the cached top-1 is the teacher's argmax
    with pytest.raises(ValueError, match="temperature 1"):
        forward_kl(s, targets, temperature=2.0)


def test_tail_mass_of_a_peaked_distribution_does_not_cancel():
    t = torch.zeros(1, 50)
    t[0, 3] = 40.0  # top-1 holds all but ~e^-36 of the mass: 1 − Σ top-k is 0 in fp32
    got = topk_targets(t, 1)
    want = torch.log_softmax(t.double(), -1)[0, torch.arange(50) != 3].logsumexp(-1)
    assert got.indices.item() == 3 and got.log_tail.item() == pytest.approx(want.item(), rel=1e-5)


# ------------------------------------------------------------------------------------ the cache


class CountingTeacher(torch.nn.Module):
    """A tiny Llama that counts the rows its forward sees."""

    def __init__(self, seed=0):
        super().__init__()
        self.model = tiny_model("llama", seed=seed)
        self.config = self.model.config
        self.rows = 0

    def forward(self, **kwargs):
        self.rows += kwargs["input_ids"].shape[0]
        return self.model(**kwargs)


def _ids(seed, b=2, l=12):
    return torch.randint(0, 256, (b, l), generator=torch.Generator().manual_seed(seed))


def test_hits_misses_and_targets(tmp_path):
    teacher = CountingTeacher()
    cache = LogitCache(teacher, 16, "cpu/no", tmp_path)
    ids = _ids(0)
    first = cache.targets(teacher, ids)
    assert teacher.rows == 2 and (cache.stats.hits, cache.stats.misses) == (0, 2)
    with torch.no_grad():
        want = topk_targets(teacher.model(input_ids=ids).logits, 16)
    for got in (first, cache.targets(teacher, ids)):
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.logprobs, want.logprobs)
        torch.testing.assert_close(got.log_tail, want.log_tail)
    assert teacher.rows == 2 and cache.stats.hits == 2  # the second call ran no teacher
    mixed = torch.stack([ids[1], _ids(1)[0]])
    cache.targets(teacher, mixed)
    assert teacher.rows == 3 and (cache.stats.hits, cache.stats.misses) == (3, 3)  # only the new row ran
    # another cache object on the same folder (another run) reads the same entries
    again = LogitCache(teacher, 16, "cpu/no", tmp_path)
    again.targets(teacher, ids)
    assert again.stats.hits == 2 and again.dir == cache.dir
    # 6k + 4 bytes per token on disk (int16 ids for a 256-token vocabulary), plus a small header
    entry = cache.entry_path(block_digest(ids[0]))
    assert 12 * (6 * 16 + 4) < entry.stat().st_size < 12 * (6 * 16 + 4) + 512
    assert load_file(entry)["indices"].dtype == torch.int16


def test_the_key_changes_with_the_teacher_its_dtype_mode_and_k(tmp_path):
    teacher = CountingTeacher()
    base = teacher_fingerprint(teacher, "cpu/no")
    assert teacher_fingerprint(copy.deepcopy(teacher), "cpu/no") == base  # same weights: same key
    changed = copy.deepcopy(teacher)
    with torch.no_grad():
        changed.model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one weight
    assert teacher_fingerprint(changed, "cpu/no") != base
    assert teacher_fingerprint(teacher, "cpu/bf16") != base
    assert teacher_fingerprint(copy.deepcopy(teacher).to(torch.bfloat16), "cpu/no") != base
    ids = _ids(0)
    LogitCache(teacher, 16, "cpu/no", tmp_path).targets(teacher, ids)
    other = LogitCache(changed, 16, "cpu/no", tmp_path)
    other.targets(changed, ids)
    assert other.stats.misses == 2  # a changed teacher never reads the old entries
    k8 = LogitCache(teacher, 8, "cpu/no", tmp_path)
    k8.targets(teacher, ids)
    assert k8.stats.misses == 2 and len({p.name for p in tmp_path.iterdir()}) == 3


def test_a_failed_write_leaves_no_entry_and_a_damaged_entry_is_recomputed(tmp_path, monkeypatch):
    import attn2ssm.paths as paths

    teacher = CountingTeacher()
    cache = LogitCache(teacher, 16, "cpu/no", tmp_path)
    ids = _ids(0)
    real_replace = os.replace

    def fail(src, dst):  # the rename fails after the temporary file was written
        raise OSError("simulated failure")

    monkeypatch.setattr(paths.os, "replace", fail)
    with pytest.raises(OSError, match="simulated"):
        cache.targets(teacher, ids)
    monkeypatch.setattr(paths.os, "replace", real_replace)
    entry = cache.entry_path(block_digest(ids[0]))
    assert not entry.exists() and not list(entry.parent.glob(".*.tmp-*"))  # a failed write leaves nothing
    # what a writer killed before its rename leaves
    (entry.parent / f".{entry.name}.tmp-999999@elsewhere").write_bytes(b"half")
    got = cache.targets(teacher, ids)
    assert cache.stats.misses == 4 and entry.exists()  # 2 from the failed call, then the same 2 again
    entry.write_bytes(entry.read_bytes()[:100])  # damaged on disk
    again = cache.targets(teacher, ids)
    assert cache.stats.misses == 5 and cache.stats.hits == 1
    torch.testing.assert_close(again.logprobs, got.logprobs)
    assert load_file(entry)["logprobs"].shape == (12, 16)  # rewritten whole


def test_right_padded_rows_are_keyed_by_their_real_tokens(tmp_path):
    teacher = CountingTeacher()
    cache = LogitCache(teacher, 16, "cpu/no", tmp_path)
    ids = _ids(2, b=2, l=10)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    padded = cache.targets(teacher, ids, mask)
    alone = cache.targets(teacher, ids[1:, :6])
    assert cache.stats.hits == 1  # the padded row's entry is the unpadded row's
    torch.testing.assert_close(padded[1, :6].logprobs, alone[0].logprobs)
    assert torch.isneginf(padded.log_tail[1, 6:]).all() and torch.isfinite(padded.logprobs).all()
    left = torch.ones_like(ids)
    left[1, :2] = 0
    with pytest.raises(ValueError, match="right padding"):
        cache.targets(teacher, ids, left)


# ----------------------------------------------------------------------------- in the trainer


def _stages(top_k=None, epochs=2, kind="kd"):
    cache = f", logit_cache: {{top_k: {top_k}}}" if top_k else ""
    return f"[{{name: kd, kind: {kind}, epochs: {epochs}, batch_size: 4, save_every: 2, optim: {{lr: 0.01}}{cache}}}]"


def _vocab(tiny_setup):
    return json.loads((tiny_setup[0] / "config.json").read_text())["vocab_size"]


def _losses(run):
    return [
        r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


def test_epochs_reuse_the_cache_and_k_equal_vocab_matches_the_teacher(
    tiny_setup, run_overrides, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    sets = dict(**{"data.max_train_tokens": 512})
    plain = distill(
        load_recipe(BASE_RECIPE, run_overrides(stages=_stages(), **sets)), tmp_path / "plain", progress=False
    )
    capsys.readouterr()
    distill(
        load_recipe(BASE_RECIPE, run_overrides(stages=_stages(_vocab(tiny_setup)), **sets)),
        tmp_path / "cached",
        progress=False,
    )
    out = capsys.readouterr().out
    n_blocks = 512 // 32
    # epoch 2 read what epoch 1 stored
    assert f"{n_blocks} blocks read, {n_blocks} computed and stored" in out
    assert _losses(tmp_path / "cached") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-4)
    assert plain["student_ppl"] > 1
    # a second run on the same teacher and blocks reads everything
    distill(
        load_recipe(BASE_RECIPE, run_overrides(stages=_stages(_vocab(tiny_setup)), **sets)),
        tmp_path / "again",
        progress=False,
    )
    assert f"{2 * n_blocks} blocks read, 0 computed" in capsys.readouterr().out
    a, b = (
        load_file(tmp_path / "cached/student/model.safetensors"),
        load_file(tmp_path / "again/student/model.safetensors"),
    )
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-6)


KILLER = r"""
import os, signal, sys
import attn2ssm.distill.trainer as T
from attn2ssm.distill.recipe import load_recipe
from tiny_models import BASE_RECIPE

out, *sets = sys.argv[1:]
saves = {"done": 0}
original_save = T.Distiller._save_checkpoint

def save_then_die(self, *args, **kwargs):
    original_save(self, *args, **kwargs)
    saves["done"] += 1
    if saves["done"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)

T.Distiller._save_checkpoint = save_then_die
T.distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
"""


def test_sigkill_then_resume_with_the_cache_matches_uninterrupted(tiny_setup, run_overrides, tmp_path):
    sets = run_overrides(stages=_stages(16, epochs=2, kind="kd_ce"), **{"data.max_train_tokens": 512})
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    env["ATTN2SSM_CACHE"] = str(tmp_path / "reference-cache")
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "attn2ssm",
            "distill",
            BASE_RECIPE,
            "--out",
            str(tmp_path / "reference"),
            "--no-progress",
            *[a for s in sets for a in ("--set", s)],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    env["ATTN2SSM_CACHE"] = str(tmp_path / "cache")
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(killed), *sets],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    stored = list((tmp_path / "cache").rglob("*.safetensors"))
    assert 0 < len(stored) <= 16  # the killed run stored whole entries only
    for path in stored:
        assert load_file(path)["logprobs"].shape == (32, 16)
    cli = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", "--out", str(killed), "--resume", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    a, b = (
        load_file(tmp_path / "reference/student/model.safetensors"),
        load_file(killed / "student/model.safetensors"),
    )
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "stage, message, fix",
    [
        (
            "{name: c, kind: ce, logit_cache: {top_k: 8}}",
            "uses no teacher logits",
            "remove stages.0.logit_cache",
        ),
        (
            "{name: c, kind: sft, data: {source: x.jsonl}, logit_cache: {top_k: 8}}",
            "uses no teacher logits",
            "kl_weight > 0",
        ),
        ("{name: c, kind: kd, logit_cache: {top_k: 0}}", "top_k=0", "top_k to e.g. 64"),
        (
            "{name: c, kind: kd_ce, temperature: 2.0, logit_cache: {top_k: 8}}",
            "temperature 1",
            "temperature: 1",
        ),
        ("{name: c, kind: kd, logit_cache: {k: 8}}", "unknown key 'k'", "top_k, dir"),
    ],
)
def test_bad_settings_are_one_line_errors(stage, message, fix):
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE_RECIPE, [f"stages=[{stage}]"])
    text = str(err.value)
    assert message in text and fix in text and "\n" not in text


def test_top_k_above_the_vocabulary_is_refused(tiny_setup, run_overrides, tmp_path):
    recipe = load_recipe(BASE_RECIPE, run_overrides(stages=_stages(_vocab(tiny_setup) + 1)))
    with pytest.raises(ConfigError, match="exceeds the teacher's vocabulary"):
        distill(recipe, tmp_path / "run", progress=False)


# ------------------------------------------------------------------- KD from a complete cache, no teacher


def _two_cached_stages():
    """Stage 0 fills the cache with every block (one epoch); stage 1 draws them again."""
    return (
        "[{name: fill, kind: kd, epochs: 1, batch_size: 4, save_every: 2, optim: {lr: 0.01}, logit_cache: {top_k: 16}},"
        " {name: reuse, kind: kd_ce, epochs: 1, batch_size: 4, save_every: 2, optim: {lr: 0.01}, logit_cache: {top_k: 16}}]"
    )


def _crash_after(monkeypatch, saves: int):
    """The run dies (like a kill) right after its ``saves``-th checkpoint."""
    import attn2ssm.distill.trainer as T

    original, done = T.Distiller._save_checkpoint, {"n": 0}

    def save_then_crash(self, *args, **kwargs):
        original(self, *args, **kwargs)
        done["n"] += 1
        if done["n"] == saves:
            raise KeyboardInterrupt("simulated kill")

    monkeypatch.setattr(T.Distiller, "_save_checkpoint", save_then_crash)


def _no_teacher_weights(monkeypatch):
    import attn2ssm.teachers as teachers

    def refuse(*args, **kwargs):
        raise AssertionError("the teacher's weights were loaded")

    monkeypatch.setattr(teachers, "load_teacher", refuse)


def test_a_resume_served_by_a_complete_cache_needs_no_teacher(
    tiny_setup, run_overrides, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    sets = run_overrides(stages=_two_cached_stages(), **{"data.max_train_tokens": 512})
    reference = distill(load_recipe(BASE_RECIPE, sets), tmp_path / "reference", progress=False)
    info = json.loads(next((tmp_path / "cache/teacher_logits").glob("*-k16/teacher.json")).read_text())
    assert len(info["sources"]) == 1 and next(iter(info["sources"].values()))["teacher"] == str(tiny_setup[0])
    with monkeypatch.context() as m:
        # stage 0 saves at steps 2, 4 (its end); stage 1 at 2: the kill lands inside stage 1
        _crash_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", progress=False)
    capsys.readouterr()
    with monkeypatch.context() as m:
        _no_teacher_weights(m)
        results = distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", resume=True, progress=False)
    out = capsys.readouterr().out
    assert "teacher weights not loaded" in out and "(all 8 blocks there)" in out  # stage 1, steps 3 and 4
    a, b = (
        load_file(tmp_path / "reference/student/model.safetensors"),
        load_file(tmp_path / "killed/student/model.safetensors"),
    )
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    # the teacher's perplexity: the value the reference measured on the same teacher and held-out text
    assert (
        results["teacher_ppl"] == reference["teacher_ppl"] and "earlier run" in results["teacher_ppl_source"]
    )
    assert results["student_ppl"] == pytest.approx(reference["student_ppl"], rel=1e-6)
    assert (tmp_path / "killed/student/tokenizer.json").exists()


def test_without_a_recorded_perplexity_the_report_says_so(run_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    sets = run_overrides(stages=_two_cached_stages(), **{"data.max_train_tokens": 512})
    with monkeypatch.context() as m:
        _crash_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", progress=False)
    with monkeypatch.context() as m:
        _no_teacher_weights(m)
        results = distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", resume=True, progress=False)
    assert (
        results["teacher_ppl"] is None
        and results["ppl_ratio"] is None
        and "never loaded the teacher" in results["teacher_ppl_source"]
    )
    assert "| teacher | – (not measured" in (tmp_path / "killed/report.md").read_text()


def test_a_missing_block_or_changed_teacher_files_load_the_teacher(
    tiny_setup, run_overrides, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    sets = run_overrides(stages=_two_cached_stages(), **{"data.max_train_tokens": 512})
    with monkeypatch.context() as m:
        _crash_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", progress=False)
    entries = sorted((tmp_path / "cache/teacher_logits").rglob("*.safetensors"))
    assert len(entries) == 16
    for entry in entries[:3]:
        entry.unlink()
    capsys.readouterr()
    distill(load_recipe(BASE_RECIPE, sets), tmp_path / "killed", resume=True, progress=False)
    out = capsys.readouterr().out
    assert "lacks" in out and "loading the teacher" in out and "teacher weights not loaded" not in out
    # touching the teacher's weights changes its source key: the run loads it (and records the new key)
    before = json.loads(next((tmp_path / "cache/teacher_logits").glob("*-k16/teacher.json")).read_text())[
        "sources"
    ]
    weights = tiny_setup[0] / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert teacher_source_key(str(tiny_setup[0]), torch.float32, "cpu/no") not in before
        assert teacher_source_key(str(tiny_setup[0]), torch.bfloat16, "cpu/no") != teacher_source_key(
            str(tiny_setup[0]), torch.float32, "cpu/no"
        )
        assert teacher_source_key(str(tiny_setup[0]), torch.float32, "cpu/bf16") != teacher_source_key(
            str(tiny_setup[0]), torch.float32, "cpu/no"
        )
        # a hub id: nothing on disk to compare
        assert teacher_source_key("someorg/some-model", torch.float32, "cpu/no") is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_teacherless_cache_refuses_a_missing_block_in_one_line(tmp_path):
    teacher = CountingTeacher()
    filled = LogitCache(teacher, 16, "cpu/no", tmp_path)
    ids = _ids(0)
    filled.targets(teacher, ids)
    found = find_cache_dir(tmp_path, 16, "no-such-key")
    assert found is None
    blind = LogitCache(None, 16, "cpu/no", tmp_path, fingerprint=filled.fingerprint)
    assert blind.dir == filled.dir and blind.has(ids[0]) and not blind.has(_ids(5)[0])
    torch.testing.assert_close(blind.targets(None, ids).logprobs, filled.targets(teacher, ids).logprobs)
    with pytest.raises(TrainingError) as err:
        blind.targets(None, torch.stack([ids[0], _ids(5)[0]]))
    text = str(err.value)
    assert (
        "1 of this batch's 2 blocks are missing" in text
        and "did not load the teacher" in text
        and "\n" not in text
    )
