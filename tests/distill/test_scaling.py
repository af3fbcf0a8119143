"""What makes the trainer scale, checked on a CPU: the optimizer through accelerate (fp16 loss
scaling, overflow steps skipped, the GradScaler in checkpoints), one host sync per step, kl_chunk
by device, activation checkpointing and the teacher's dtype."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
import torch
from safetensors.torch import load_file

import attn2ssm
from accelerate_launch import accelerate_launch
from attn2ssm.distill.losses import forward_kl, resolve_kl_chunk
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.stage_setup import activation_checkpointing
from attn2ssm.distill.stages import STAGE_KINDS
from attn2ssm.distill.trainer import (
    Distiller,
    TrainerState,
    distill,
    latest_checkpoint,
    resolve_teacher_dtype,
)
from attn2ssm.errors import ConfigError, TrainingError
from tiny_models import BASE_RECIPE

KD = "[{name: kd, kind: kd, tokens: 1536, batch_size: 4, save_every: 3, trainable: [all], optim: {lr: 0.01}}]"


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _ready(recipe, out, stage=0, **kwargs):
    """A Distiller with its teacher, data and student loaded and stage ``stage`` set up, as bench train does."""
    distiller = Distiller(recipe, out, progress=False, **kwargs)
    distiller._load_teacher()
    distiller._load_data()
    distiller._build_student()
    return distiller, distiller._setup_stage(stage, None)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ fp16 on a CPU


def test_fp16_on_a_cpu_runs_accelerates_loss_scaling(run_overrides, tmp_path):
    """accelerate leaves fp16 on a CPU as fp32 (no autocast, no GradScaler); the trainer installs torch's
    CPU GradScaler and autocast where accelerate installs them on CUDA, so the fp16 path really runs."""
    distiller, run = _ready(
        load_recipe(BASE_RECIPE, run_overrides(stages=KD, mixed_precision="fp16")), tmp_path / "run"
    )
    try:
        assert (
            isinstance(distiller.acc.scaler, torch.amp.GradScaler)
            and run.optimizer.scaler is distiller.acc.scaler
        )
        with distiller.acc.autocast():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    finally:
        distiller.close()


def test_an_overflow_step_is_skipped_without_moving_weights_or_schedule(run_overrides, tmp_path):
    distiller, run = _ready(
        load_recipe(BASE_RECIPE, run_overrides(stages=KD, mixed_precision="fp16")), tmp_path / "run"
    )
    try:
        scaler = distiller.acc.scaler
        first = distiller._train_step(run, 0)
        while first.skipped:  # the scale starts at 2^16 and halves on each overflow until the gradients fit
            first = distiller._train_step(run, 1)
        weights = [p.detach().clone() for p in run.params]
        lr, epoch, scale = run.scheduler.get_last_lr()[0], run.scheduler.last_epoch, scaler.get_scale()
        hook = run.params[0].register_hook(lambda g: torch.full_like(g, math.inf))  # an inf in one gradient
        try:
            result = distiller._train_step(run, 2)
        finally:
            hook.remove()
        assert result.skipped and math.isfinite(result.loss)
        assert all(torch.equal(p, w) for p, w in zip(run.params, weights))  # no weight moved
        assert run.scheduler.last_epoch == epoch and run.scheduler.get_last_lr()[0] == lr  # nor the schedule
        assert scaler.get_scale() == scale / 2  # the GradScaler backed off
        assert all(p.grad is None for p in run.params)
        after = distiller._train_step(run, 3)  # the next step trains again
        assert not after.skipped and run.scheduler.last_epoch == epoch + 1
        assert any(not torch.equal(p, w) for p, w in zip(run.params, weights))
    finally:
        distiller.close()


def test_a_skipped_step_is_logged_and_counted(run_overrides, tmp_path, monkeypatch):
    """The design: a skipped step counts as a step (its blocks were drawn: the data order stays a
    function of the step index, and --resume stays exact); its line says "skipped": true and keeps
    the lr the schedule held, since the schedule does not advance on it."""
    kind = STAGE_KINDS["kd"]
    original, calls = type(kind).loss, {"n": 0}

    def poisoned(self, student, *args, **kwargs):
        calls["n"] += 1
        loss, metrics = original(self, student, *args, **kwargs)
        if calls["n"] == 4:
            param = next(p for p in student.parameters() if p.requires_grad)
            handle = param.register_hook(lambda g: (handle.remove(), torch.full_like(g, math.inf))[1])
        return loss, metrics

    monkeypatch.setattr(type(kind), "loss", poisoned)
    out = tmp_path / "run"
    distill(load_recipe(BASE_RECIPE, run_overrides(stages=KD, mixed_precision="fp16")), out, progress=False)
    records = _records(out)
    # every step logged once, the skipped one included
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[3].get("skipped") is True and math.isfinite(records[3]["loss"])
    assert records[3]["lr"] == records[2]["lr"]  # the schedule did not advance
    assert "scaler" in torch.load(latest_checkpoint(out) / "optimizer.pt", weights_only=False)


OVERFLOW_THEN_KILL = r"""
import math, os, signal, sys, torch
import attn2ssm.distill.trainer as T
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.stage_setup import activation_checkpointing
from attn2ssm.distill.stages import STAGE_KINDS
from tiny_models import BASE_RECIPE

mode, out, *sets = sys.argv[1:]
kind = STAGE_KINDS["kd"]
original_loss, calls = type(kind).loss, {"n": 0}

def overflow_at_step_2(self, student, *args, **kwargs):
    calls["n"] += 1
    loss, metrics = original_loss(self, student, *args, **kwargs)
    if calls["n"] == 2:  # an inf in one gradient: the GradScaler skips the step and halves its scale
        param = next(p for p in student.parameters() if p.requires_grad)
        handle = param.register_hook(lambda g: (handle.remove(), torch.full_like(g, math.inf))[1])
    return loss, metrics

type(kind).loss = overflow_at_step_2
original_save = T.Distiller._save_checkpoint

def save_then_die(self, *args, **kwargs):
    original_save(self, *args, **kwargs)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)

T.Distiller._save_checkpoint = save_then_die
T.distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
"""


def test_fp16_resume_after_sigkill_matches_uninterrupted(run_overrides, tmp_path):
    """The GradScaler's scale and growth count travel in the checkpoint: a run killed after an
    overflow step resumes with the lowered scale, exactly as the uninterrupted run continued."""
    sets = run_overrides(stages=KD, mixed_precision="fp16")
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    ref = subprocess.run(
        [sys.executable, "-c", OVERFLOW_THEN_KILL, "full", str(reference), *sets],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert [r.get("skipped", False) for r in _records(reference)][:3] == [False, True, False]
    proc = subprocess.run(
        [sys.executable, "-c", OVERFLOW_THEN_KILL, "kill", str(killed), *sets],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert latest_checkpoint(killed).name == "stage0-step000003"
    cli = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", "--out", str(killed), "--resume", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    a, b = load_file(reference / "student/model.safetensors"), load_file(killed / "student/model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [(r["loss"], r.get("skipped")) for r in _records(killed)] == [
        (r["loss"], r.get("skipped")) for r in _records(reference)
    ]
    scalers = [
        torch.load(latest_checkpoint(run) / "optimizer.pt", weights_only=False)["scaler"]
        for run in (reference, killed)
    ]
    # halved at every skipped step from its initial 2^16 (the injected overflow, and any fp16 overflow
    # of the run's own: its losses differ between invocations), and so in the resumed run
    skipped = sum(bool(r.get("skipped")) for r in _records(reference))
    assert scalers[0] == scalers[1] and scalers[0]["scale"] == 2.0 ** (16 - skipped)


# ------------------------------------------------------------------------------ one host sync per step


@pytest.mark.parametrize(
    "stages",
    [
        "[{name: kd, kind: kd, tokens: 1536, batch_size: 4, grad_accum: 2, optim: {lr: 0.01}}]",
        "[{name: at, kind: attention_transfer, tokens: 1536, batch_size: 4, grad_accum: 2, trainable: [feature_maps], losses: {output_mse: 1.0}}]",
        "[{name: kdce, kind: kd_ce, tokens: 1536, batch_size: 4, clip: 0, optim: {lr: 0.01}}]",
    ],
)
def test_a_step_reads_the_device_once(stages, run_overrides, tmp_path, monkeypatch):
    """Loss, metrics, grad norm (and, with several processes, the stop signals) come back in one
    tolist(); nothing else attn2ssm or accelerate runs in the step calls item(), float(), int() or
    bool() on a tensor. (Not counted: torch.optim's reads of AdamW's step counters, which live on
    the CPU unless capturable; transformers' own check for packed sequences in each forward without
    an attention mask, masking_utils.find_packed_sequence_indices, a sync outside attn2ssm.)"""
    distiller, run = _ready(load_recipe(BASE_RECIPE, run_overrides(stages=stages)), tmp_path / "run")
    reads, ours = [], (str(Path(attn2ssm.__file__).parent), str(Path(accelerate.__file__).parent))

    def counting(name, original):
        def read(self, *args):
            if sys._getframe(1).f_code.co_filename.startswith(ours):
                reads.append(name)
            return original(self, *args)

        return read

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        results = [distiller._train_step(run, step) for step in range(2)]
    finally:
        monkeypatch.undo()
        distiller.close()
    assert reads == ["tolist", "tolist"]
    for result in results:
        assert (
            isinstance(result.loss, float)
            and all(isinstance(v, float) for v in result.metrics.values())
            and result.metrics
        )
        assert (result.grad_norm is None) == (run.cfg.clip == 0)


def test_metrics_are_the_micro_batch_mean_of_the_kinds_values(run_overrides, tmp_path):
    """grad_accum 2: the logged loss and metrics are the mean over micro-batches of what the kind returned."""
    distiller, run = _ready(
        load_recipe(
            BASE_RECIPE,
            run_overrides(stages="[{name: kd, kind: kd, tokens: 1536, batch_size: 4, grad_accum: 2}]"),
        ),
        tmp_path / "run",
    )
    seen = []
    original = run.kind.loss

    def spy(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        seen.append((loss.item(), {k: v.item() for k, v in metrics.items()}))
        return loss, metrics

    run.kind = type("Spy", (), {"loss": staticmethod(spy), "through_model_forward": True})()
    try:
        result = distiller._train_step(run, 0)
    finally:
        distiller.close()
    assert len(seen) == 2
    assert result.loss == pytest.approx((seen[0][0] + seen[1][0]) / 2, rel=1e-6)
    for k in ("kl", "ce"):
        # float64, as Python floats summed them
        assert result.metrics[k] == seen[0][1][k] / 2 + seen[1][1][k] / 2


def test_a_nan_loss_never_reaches_the_weights(run_overrides, tmp_path):
    distiller, run = _ready(load_recipe(BASE_RECIPE, run_overrides(stages=KD)), tmp_path / "run")
    try:
        distiller._train_step(run, 0)
        weights = [p.detach().clone() for p in run.params]
        state = {k: v.clone() for k, v in run.optimizer.state[run.params[0]].items()}
        original = run.kind.loss
        run.kind = type(
            "NaN",
            (),
            {
                "through_model_forward": True,
                "loss": staticmethod(lambda *a, **k: (lambda l, m: (l * math.nan, m))(*original(*a, **k))),
            },
        )()
        with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) at stage 'kd' step 2"):
            distiller._train_step(run, 1)
        assert all(torch.equal(p, w) for p, w in zip(run.params, weights))
        assert all(torch.equal(run.optimizer.state[run.params[0]][k], v) for k, v in state.items())
    finally:
        distiller.close()


# ------------------------------------------------------------------------------ kl_chunk


def test_kl_chunk_auto_by_device():
    assert resolve_kl_chunk("auto", "cpu", 49152) == 64
    # CUDA: the largest power of two whose fp32 (chunk × vocab) slab fits 256 MiB, within 64..8192
    assert resolve_kl_chunk("auto", "cuda", 49152) == 1024  # SmolLM2: 1365 rows fit
    assert resolve_kl_chunk("auto", "cuda", 128256) == 512  # Llama 3: 523
    assert resolve_kl_chunk("auto", "cuda", 32000) == 2048  # Llama 2 / Mistral: 2097
    assert resolve_kl_chunk("auto", "cuda", 262144) == 256  # Gemma 3
    assert resolve_kl_chunk("auto", "cuda", 300) == 8192 and resolve_kl_chunk("auto", "cuda", 10**9) == 64
    assert resolve_kl_chunk(37, "cuda", 128256) == 37  # an integer forces it
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 70, 11, generator=g), torch.randn(3, 70, 11, generator=g)
    torch.testing.assert_close(forward_kl(s, t, chunk_size="auto"), forward_kl(s, t, chunk_size=64))


@pytest.mark.parametrize("value", ["0", "big", "1.5", "true"])
def test_a_bad_kl_chunk_is_a_one_line_error(value):
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE_RECIPE, [f"stages=[{{name: k, kind: kd, kl_chunk: {value}}}]"])
    assert "kl_chunk" in str(err.value) and "auto" in str(err.value) and "\n" not in str(err.value)


def test_the_stage_and_its_logit_cache_get_the_resolved_chunk(run_overrides, tmp_path, monkeypatch):
    stages = "[{name: kd, kind: kd, tokens: 1536, batch_size: 4, logit_cache: {top_k: 8}}]"
    monkeypatch.setenv("ATTN2SSM_CACHE", str(tmp_path / "cache"))
    distiller, run = _ready(load_recipe(BASE_RECIPE, run_overrides(stages=stages)), tmp_path / "run")
    distiller.close()
    assert distiller.recipe.stages[0].kl_chunk == "auto"  # the recipe (what --resume reruns) keeps auto
    assert run.cfg.kl_chunk == 64 and run.logit_cache.chunk_size == 64


# ------------------------------------------------------------------------------ teacher dtype


def test_teacher_dtype_auto():
    assert resolve_teacher_dtype("auto", "cpu", "bf16") == torch.float32
    assert resolve_teacher_dtype("auto", "cuda", "bf16") == torch.bfloat16
    assert resolve_teacher_dtype("auto", "cuda", "fp16") == torch.float16
    assert resolve_teacher_dtype("auto", "cuda", "no") == torch.float32
    assert resolve_teacher_dtype("bfloat16", "cpu", "no") == torch.bfloat16


def test_a_bfloat16_teacher_beside_an_fp32_student(run_overrides, tmp_path):
    stages = (
        "[{name: at, kind: attention_transfer, tokens: 256, batch_size: 4, trainable: [feature_maps]},"
        " {name: kd, kind: kd, tokens: 256, batch_size: 4, optim: {lr: 0.01}}]"
    )
    recipe = load_recipe(
        BASE_RECIPE, run_overrides(stages=stages, teacher_dtype="bfloat16", mixed_precision="bf16")
    )
    distiller, run = _ready(recipe, tmp_path / "run")
    try:
        assert {p.dtype for p in distiller.teacher.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in distiller.student.parameters()} == {torch.float32}  # fp32 master weights
        assert math.isfinite(distiller._train_step(run, 0).loss)
        distiller._finish_stage(run, TrainerState())
        run = distiller._setup_stage(1, None)
        assert math.isfinite(distiller._train_step(run, 0).loss)
    finally:
        distiller.close()


def test_a_reduced_teacher_without_autocast_is_refused_for_layer_local_kinds(run_overrides, tmp_path):
    stages = "[{name: at, kind: attention_transfer, tokens: 256, batch_size: 4, trainable: [feature_maps]}]"
    with pytest.raises(ConfigError) as err:
        Distiller(
            load_recipe(BASE_RECIPE, run_overrides(stages=stages, teacher_dtype="bfloat16")),
            tmp_path / "run",
            progress=False,
        )
    assert (
        "bfloat16 teacher without mixed precision" in str(err.value)
        and "mixed_precision: bf16" in str(err.value)
        and "\n" not in str(err.value)
    )
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="teacher_dtype='half' is not a dtype"):
        load_recipe(BASE_RECIPE, ["teacher_dtype=half"])


# ------------------------------------------------------------------------------ activation checkpointing


def _gc_stages(on: str) -> str:
    return (
        f"[{{name: kd, kind: kd, tokens: 768, batch_size: 4, trainable: [all], save_every: 3, gradient_checkpointing: {on}, optim: {{lr: 0.01}}}},"
        f" {{name: ce, kind: ce, tokens: 384, batch_size: 4, trainable: [lora, mixers], lora: {{r: 4, alpha: 8}}, gradient_checkpointing: {on}}}]"
    )


def test_gradient_checkpointing_trains_the_same(run_overrides, tmp_path):
    for on in ("false", "true"):
        distill(load_recipe(BASE_RECIPE, run_overrides(stages=_gc_stages(on))), tmp_path / on, progress=False)
    assert [r["loss"] for r in _records(tmp_path / "true")] == pytest.approx(
        [r["loss"] for r in _records(tmp_path / "false")], rel=1e-6
    )
    a, b = (
        load_file(tmp_path / "false/student/model.safetensors"),
        load_file(tmp_path / "true/student/model.safetensors"),
    )
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)


def _saved_bytes(step) -> int:
    """Bytes autograd saves for the backward outside checkpointed regions while ``step`` runs (a
    checkpointed layer keeps its inputs only, through its own hooks, which take precedence)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total


def test_gradient_checkpointing_saves_fewer_activations_and_ends_with_its_stage(run_overrides, tmp_path):

    distiller, run = _ready(
        load_recipe(BASE_RECIPE, run_overrides(stages=_gc_stages("true"), **{"data.block_len": 128})),
        tmp_path / "run",
    )
    try:
        layers = [m for m in run.unwrapped.modules() if type(m).__name__.endswith("DecoderLayer")]
        assert layers and all(m.gradient_checkpointing for m in layers)
        batch = next(distiller._micro_batches(run, 0)[1])

        def step():
            loss, _ = run.kind.loss(run.model, distiller.teacher, batch, run.cfg)
            loss.backward()

        on = _saved_bytes(step)
        activation_checkpointing(run.unwrapped, False)
        off = _saved_bytes(step)
        assert on < off / 2, (on, off)
        activation_checkpointing(run.unwrapped, True)
        distiller._finish_stage(run, TrainerState())
        assert not any(m.gradient_checkpointing for m in layers)  # the next stage decides for itself
        # no input-grad hook left behind (reentrant-only)
        assert getattr(run.unwrapped, "_require_grads_hook", None) is None
    finally:
        distiller.close()


def test_gradient_checkpointing_with_right_padding_gives_the_same_gradients():
    """A padded batch (sft / dpo): each layer's recompute sees the padding mask its forward saw."""
    from attn2ssm.distill.losses import response_cross_entropy
    from tiny_models import tiny_student

    student = tiny_student("llama", "mamba2").train()
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 9:] = 0

    def grads():
        student.zero_grad(set_to_none=True)
        logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        total, count = response_cross_entropy(logits, ids, mask)
        (total / count).backward()
        return {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    plain = grads()
    activation_checkpointing(student, True)
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", ["attention_transfer", "hidden_alignment", "bridge_alignment"])
def test_gradient_checkpointing_on_a_layer_local_kind_is_refused(kind):
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE_RECIPE, [f"stages=[{{name: s, kind: {kind}, gradient_checkpointing: true}}]"])
    text = str(err.value)
    assert (
        "gradient_checkpointing" in text
        and "remove stages.0.gradient_checkpointing" in text
        and "\n" not in text
    )


# ------------------------------------------------------------------------------ stopping, several processes

SIGNAL_ONE_RANK = r"""
import os, runpy, signal, sys
import attn2ssm.distill.trainer as T

original_step = T.Distiller._train_step

def step(self, run, index):
    if self.acc.process_index == 1 and index == 1:  # only rank 1 is asked to stop, during its second step
        os.kill(os.getpid(), signal.SIGTERM)
    return original_step(self, run, index)

T.Distiller._train_step = step
sys.argv = ["attn2ssm", *sys.argv[1:]]
runpy.run_module("attn2ssm", run_name="__main__")
"""


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(run_overrides, tmp_path):
    """The processes agree on the stop signal through the step's own reduction (no extra sync): rank 1
    is sent SIGTERM during step 2; both finish step 2, checkpoint it and stop."""
    script = tmp_path / "signal_one_rank.py"
    script.write_text(SIGNAL_ONE_RANK)
    out = tmp_path / "run"
    launch = accelerate_launch(
        script,
        "distill",
        BASE_RECIPE,
        "--out",
        out,
        "--no-progress",
        *[a for s in run_overrides() for a in ("--set", s)],
    )
    proc = subprocess.run(
        launch, env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode != 0 and "stopped by SIGTERM at stage 1/3 step 2" in proc.stderr, proc.stderr[
        -3000:
    ]
    # not a save_every step: the stop's own checkpoint
    assert latest_checkpoint(out).name == "stage0-step000002"
    assert [r["step"] for r in _records(out)] == [1, 2]
