"""Multi-query associative recall (MQAR): softmax attention vs linear attention feature maps.

Zoology-style MQAR (Arora et al. 2023): each sequence opens with ``num_kv_pairs`` key-value
pairs ``k1 v1 k2 v2 ...`` (distinct keys from the lower half of the vocabulary, tokens
1..V/2-1; distinct values from the upper half; token 0 = filler), followed by a query section in
which ``num_queries`` of those keys reappear at uniformly random positions among filler tokens.
The target at a query position is the value that key was paired with earlier; loss and accuracy
are computed at query positions only. Training batches are generated fresh every step (the same
stream for every model); validation and test sets are separate fresh samples.

Every model is the same tiny Llama (RoPE) trained FROM SCRATCH with AdamW on that loss: the
softmax baseline, and one copy per feature map with every attention layer swapped for
``linear_attention`` by ``attn2ssm.student.convert.convert`` (so all models start from the same
random q/k/v/o and the same everything else). Reported per model: test accuracy, mean attention
entropy (entropy of each query row of the attention weights, averaged over positions, heads,
layers and samples; also over MQAR query positions only; linear maps through the mixer's
quadratic weights), training time. Hedgehog expects softmax ≈ Taylor ≈ Hedgehog ≫
1+ELU / Performer / cosFormer, the failing maps with high entropy.

Defaults (chosen in CPU smoke runs; seed 0): vocab 32, 4 kv pairs, 4 queries, length 32; Llama
2 layers, hidden 64, 2 heads (head dim 32), MLP 128; 2000 steps of batch 32, AdamW lr 3e-3,
5 % warmup then cosine, 1 CPU thread. Seen in smoke runs of this config (softmax, 1+ELU,
Performer, cosFormer at 1000 steps; Taylor at 400; Hedgehog, T2R at 2000): softmax 100 %,
Taylor 100 %, Hedgehog 99 %, 1+ELU / Performer / cosFormer / T2R 23-25 % (= guessing among the
4 values in context). Harder settings (8+ kv pairs at vocab 64) left Hedgehog at chance
within 1500 steps while softmax still solved them: pass e.g. ``--vocab-size 64 --num-kv-pairs 8
--seq-len 64 --num-queries 8 --steps 20000`` for a longer run.

``--filler pad`` (default) makes token 0 the model's pad token: its embedding is zero and never
trained, but it is NOT masked (every model attends to filler positions). With ``--filler
token`` (an ordinary learned token) Hedgehog stayed at chance at seed 0 while softmax and Taylor
did not care.

Cost: Taylor (f = 1 + d + d² = 1057 features) is ~5x the others and about half the total.
On a busy 2-core machine a full default run was estimated at ~13 min; expect ~10 on an idle one.

    python benchmarks/mqar.py                        # full table -> benchmarks/results/mqar.{json,png}
    python benchmarks/mqar.py --quick                # smoke config, seconds
    python benchmarks/mqar.py --steps 500 --maps hedgehog,elu --out /tmp/mqar
    python benchmarks/mqar.py --lr 1e-3,3e-3 --map-option hedgehog:activation=exp
    python benchmarks/mqar.py --maps gated_delta,mamba2 --no-softmax   # other mixers as rows (MIXER_ROWS)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bar_chart, run_info, write_json  # noqa: E402

IGNORE = -100
DEFAULT_MAPS = ["hedgehog", "taylor", "elu", "performer", "cosformer", "t2r"]
SOFTMAX = "softmax"


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
@dataclass
class MQARConfig:
    vocab_size: int = 32
    num_kv_pairs: int = 4
    seq_len: int = 32
    num_queries: int = 4

    def validate(self) -> None:
        n_keys, n_values = self.vocab_size // 2 - 1, self.vocab_size - self.vocab_size // 2
        if self.num_kv_pairs > n_keys or self.num_kv_pairs > n_values:
            raise ValueError(
                f"{self.num_kv_pairs} kv pairs need distinct keys and values, but vocab {self.vocab_size} "
                f"has {n_keys} keys (tokens 1..{self.vocab_size // 2 - 1}) and {n_values} values"
            )
        if self.num_queries > self.num_kv_pairs:
            raise ValueError(
                f"num_queries ({self.num_queries}) must be <= num_kv_pairs ({self.num_kv_pairs})"
            )
        if self.num_queries > self.seq_len - 2 * self.num_kv_pairs:
            raise ValueError(
                f"seq_len {self.seq_len} leaves {self.seq_len - 2 * self.num_kv_pairs} positions after the "
                f"{self.num_kv_pairs} pairs, fewer than num_queries={self.num_queries}"
            )

    @property
    def key_range(self) -> tuple[int, int]:
        return 1, self.vocab_size // 2  # [lo, hi)

    @property
    def value_range(self) -> tuple[int, int]:
        return self.vocab_size // 2, self.vocab_size


def _choose(n: int, pool: int, k: int, g: torch.Generator) -> torch.Tensor:
    """(n, k) distinct indices in [0, pool) per row, uniformly."""
    return torch.rand(n, pool, generator=g).argsort(dim=1)[:, :k]


def make_mqar(num_samples: int, cfg: MQARConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both (num_samples, seq_len) int64; labels are -100 off query positions.

    Deterministic in ``seed``. Keys are distinct within a sequence (so each query has one
    answer), values too (as in Zoology); query keys are distinct pairs of that sequence.
    """
    cfg.validate()
    g = torch.Generator().manual_seed(seed)
    n, N, Q, L = num_samples, cfg.num_kv_pairs, cfg.num_queries, cfg.seq_len
    (k_lo, k_hi), (v_lo, v_hi) = cfg.key_range, cfg.value_range
    keys = _choose(n, k_hi - k_lo, N, g) + k_lo
    values = _choose(n, v_hi - v_lo, N, g) + v_lo
    context = torch.stack([keys, values], dim=2).reshape(n, 2 * N)
    pair = _choose(n, N, Q, g)  # which pairs are queried
    pos = _choose(n, L - 2 * N, Q, g) + 2 * N  # where, in the query section
    input_ids = torch.zeros(n, L, dtype=torch.long)
    input_ids[:, : 2 * N] = context
    input_ids.scatter_(1, pos, keys.gather(1, pair))
    labels = torch.full((n, L), IGNORE, dtype=torch.long)
    labels.scatter_(1, pos, values.gather(1, pair))
    return input_ids, labels


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 128
    filler: str = (
        "pad"  # "pad": token 0 = pad token (zero, frozen embedding); "token": an ordinary learned token
    )


def build_base(data: MQARConfig, mcfg: ModelConfig, seed: int):
    """A randomly initialised tiny Llama (RoPE, eager attention so weights can be returned)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=data.vocab_size,
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size,
        num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_heads,
        num_key_value_heads=mcfg.num_heads,
        max_position_embeddings=max(128, data.seq_len),
        tie_word_embeddings=False,
        # Filler token 0 as the model's pad token: nn.Embedding(padding_idx=0) keeps its embedding
        # at zero (untrained). It is NOT masked: every model still attends to filler positions.
        pad_token_id=0 if mcfg.filler == "pad" else None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


# Rows that are other mixers than a feature map's linear attention (every layer converted to it;
# the gated delta rule starts from its plain per-head decay: there is no trained teacher to calibrate on).
MIXER_ROWS = {"gated_delta": {"decay_init": "plain"}, "mamba2": {}}


def build_model(
    name: str, base_state: dict, data: MQARConfig, mcfg: ModelConfig, seed: int, map_options: dict | None
):
    """``softmax`` → the base model itself; a feature-map name → the base converted to linear attention;
    a name of ``MIXER_ROWS`` → the base converted to that mixer."""
    base = build_base(data, mcfg, seed)
    base.load_state_dict(base_state)
    if name == SOFTMAX:
        return base
    from attn2ssm.student.convert import convert

    if name in MIXER_ROWS:
        torch.manual_seed(seed + 1)
        return convert(base, [name] * mcfg.num_layers, {name: {**MIXER_ROWS[name], **(map_options or {})}})
    options = {"feature_map": name}
    if map_options:
        options["feature_map_options"] = dict(map_options)
    torch.manual_seed(seed + 1)  # random feature maps (Performer) draw from here
    model = convert(base, ["linear_attention"] * mcfg.num_layers, {"linear_attention": options})
    return model


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, use_cache=False).logits


def masked_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE
    )


# ---------------------------------------------------------------------------------------------
# Evaluation: accuracy and attention entropy
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(
    model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 256
) -> tuple[float, float]:
    """(accuracy over all query positions, mean CE at query positions)."""
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for s in range(0, len(input_ids), batch_size):
        x, y = input_ids[s : s + batch_size], labels[s : s + batch_size]
        logits = logits_of(model, x)
        m = y != IGNORE
        correct += int((logits.argmax(-1)[m] == y[m]).sum())
        total += int(m.sum())
        loss_sum += float(masked_ce(logits, y)) * int(m.sum())
    return correct / max(total, 1), loss_sum / max(total, 1)


def row_entropy(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, l, l) attention weights → ((…, l) entropies in nats, (…, l) bool "row is a distribution").

    Rows are renormalised to sum to 1 (the linear-attention op's eps leaves them at S/(S + eps)).
    A row whose weights sum to < 0.5 is *dead*: every kernel value was ~0 (ReLU-type maps such
    as cosFormer/T2R can zero a whole row), the mixer outputs ~0 there and its entropy is
    undefined, so it is flagged instead of counted as a perfectly spiky row (entropy 0).
    """
    w = weights.double().clamp_min(0)
    total = w.sum(-1, keepdim=True)
    alive = total.squeeze(-1) >= 0.5
    p = w / total.clamp_min(1e-300)
    return -(p * torch.log(p.clamp_min(1e-300))).sum(-1), alive


def attention_weights(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer (b, h, l, l) attention weights of ``model`` on ``input_ids``.

    Softmax models return them through ``output_attentions`` (eager attention); students are
    read through each mixer's quadratic form ``attention_weights(hidden_states,
    position_embeddings)`` on the exact inputs it saw, captured with forward pre-hooks.
    """
    mixers = model.mixers() if hasattr(model, "mixers") else {}
    if not mixers:
        out = model(input_ids=input_ids, use_cache=False, output_attentions=True)
        if not out.attentions or any(a is None for a in out.attentions):
            raise RuntimeError("the model returned no attention weights (needs attn_implementation='eager')")
        return list(out.attentions)
    captured: dict[int, tuple] = {}

    def hook(idx):
        def fn(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            captured[idx] = (hs, kwargs.get("position_embeddings"))

        return fn

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in mixers.items()]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [mixers[i].attention_weights(*captured[i]) for i in sorted(mixers)]


@torch.no_grad()
def entropy_stats(model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 64) -> dict:
    """Mean row entropy (nats) over all positions and over query positions only, averaged over
    rows, heads, layers and samples; dead rows (see ``row_entropy``) are left out and counted."""
    model.eval()
    sum_all = sum_q = 0.0
    n_all = n_q = n_rows = 0
    for s in range(0, len(input_ids), batch_size):
        x, y = input_ids[s : s + batch_size], labels[s : s + batch_size]
        for w in attention_weights(model, x):
            h, alive = row_entropy(w)  # (b, heads, l)
            n_rows += alive.numel()
            sum_all += float(h[alive].sum())
            n_all += int(alive.sum())
            q = (y != IGNORE)[:, None, :].expand_as(h) & alive
            sum_q += float(h[q].sum())
            n_q += int(q.sum())
    nan = float("nan")
    return {
        "entropy": sum_all / n_all if n_all else nan,
        "entropy_query": sum_q / n_q if n_q else nan,
        "dead_row_fraction": 1.0 - n_all / max(n_rows, 1),
    }


def uniform_entropy(labels: torch.Tensor) -> dict:
    """Entropy of uniform causal attention (row i over i+1 keys) with the same averaging."""
    L = labels.shape[1]
    per_pos = torch.log(torch.arange(1, L + 1, dtype=torch.float64))
    q = (labels != IGNORE).double()
    return {"entropy": float(per_pos.mean()), "entropy_query": float((q * per_pos).sum() / q.sum())}


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    eval_every: int = 250
    num_test: int = 1000
    num_val: int = 256
    num_entropy: int = 128
    seed: int = 0


def lr_lambda(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def train_one(
    model, data: MQARConfig, tc: TrainConfig, lr: float, val, desc: str, progress: bool = True
) -> dict:
    """Train ``model`` in place on freshly generated batches (same stream for every model)."""
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=tc.weight_decay, betas=(0.9, 0.98))
    warmup = max(1, int(tc.warmup_frac * tc.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, tc.steps, warmup))
    curve, status, loss_ema, done = [], "ok", None, 0
    t0, c0 = time.perf_counter(), time.process_time()
    bar = tqdm(range(tc.steps), desc=desc, disable=not progress, dynamic_ncols=True, leave=True)
    for step in bar:
        model.train()
        # Batch i is identical across models and learning rates: seed from (seed, step).
        x, y = make_mqar(tc.batch_size, data, seed=tc.seed * 1_000_003 + step)
        loss = masked_ce(logits_of(model, x), y)
        if not torch.isfinite(loss):
            status = f"diverged (non-finite loss at step {step})"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        sched.step()
        done = step + 1
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        last = step + 1 == tc.steps
        if tc.eval_every and ((step + 1) % tc.eval_every == 0 or last):
            acc, vloss = accuracy(model, *val)
            curve.append(
                {"step": step + 1, "train_loss_ema": loss_ema, "val_loss": vloss, "val_accuracy": acc}
            )
            bar.set_postfix(loss=f"{loss_ema:.3f}", val_acc=f"{acc:.3f}")
        elif step % 25 == 0:
            bar.set_postfix(loss=f"{loss_ema:.3f}")
    bar.close()
    train_time, cpu_time = time.perf_counter() - t0, time.process_time() - c0
    return {
        "status": status,
        "train_time_s": train_time,
        "train_cpu_s": cpu_time,
        "steps_done": done,
        "final_train_loss_ema": loss_ema,
        "curve": curve,
    }


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
QUICK = dict(
    data=MQARConfig(vocab_size=32, num_kv_pairs=4, seq_len=24, num_queries=4),
    model=ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
    train=TrainConfig(steps=30, batch_size=8, lr=3e-3, eval_every=0, num_test=64, num_val=32, num_entropy=16),
)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (seconds)")
    p.add_argument("--steps", type=int, help="optimizer steps per model (default 2000; quick 30)")
    p.add_argument("--maps", help=f"comma-separated feature maps (default {','.join(DEFAULT_MAPS)})")
    p.add_argument("--no-softmax", action="store_true", help="skip the softmax-attention baseline")
    p.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent / "results"),
        help="output folder for mqar.json / mqar.png (default benchmarks/results)",
    )
    p.add_argument(
        "--lr", help="learning rate, or a comma-separated sweep (best per model by validation accuracy)"
    )
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--num-kv-pairs", type=int)
    p.add_argument("--num-queries", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument(
        "--filler",
        choices=("pad", "token"),
        help="filler token 0: 'pad' = the model's pad token, zero frozen embedding (default); "
        "'token' = an ordinary learned token (harder for linear attention, see the docstring)",
    )
    p.add_argument("--num-test", type=int, help="fresh test sequences (default 1000)")
    p.add_argument(
        "--eval-every", type=int, help="validation every N steps for the learning curve (0 = only at the end)"
    )
    p.add_argument(
        "--map-option",
        action="append",
        default=[],
        metavar="MAP:KEY=VALUE",
        help="feature_map_options for one map, e.g. hedgehog:activation=softmax (repeatable)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: these models are too small to gain from more, and extra "
        "threads on a busy machine slow them down badly)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return p.parse_args(argv)


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def resolve(args):
    base = QUICK if args.quick else dict(data=MQARConfig(), model=ModelConfig(), train=TrainConfig())
    data, mcfg, tc = (copy.deepcopy(base[k]) for k in ("data", "model", "train"))
    for field, obj, attr in (
        ("vocab_size", data, "vocab_size"),
        ("num_kv_pairs", data, "num_kv_pairs"),
        ("num_queries", data, "num_queries"),
        ("seq_len", data, "seq_len"),
        ("hidden_size", mcfg, "hidden_size"),
        ("num_layers", mcfg, "num_layers"),
        ("num_heads", mcfg, "num_heads"),
        ("steps", tc, "steps"),
        ("batch_size", tc, "batch_size"),
        ("seed", tc, "seed"),
        ("num_test", tc, "num_test"),
        ("eval_every", tc, "eval_every"),
        ("filler", mcfg, "filler"),
    ):
        if getattr(args, field) is not None:
            setattr(obj, attr, getattr(args, field))
    if args.hidden_size is not None:
        mcfg.intermediate_size = 2 * mcfg.hidden_size
    data.validate()
    lrs = [float(v) for v in args.lr.split(",")] if args.lr else [tc.lr]
    maps = (
        [m.strip() for m in args.maps.split(",") if m.strip()]
        if args.maps is not None
        else list(DEFAULT_MAPS)
    )
    map_options: dict[str, dict] = {}
    for item in args.map_option:
        name, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        if not key or not _:
            raise SystemExit(f"error: --map-option {item!r} is not MAP:KEY=VALUE")
        map_options.setdefault(name, {})[key] = _parse_value(value)
    return data, mcfg, tc, lrs, maps, map_options


def run(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    data, mcfg, tc, lrs, maps, map_options = resolve(args)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, data, mcfg, tc, lrs, maps, map_options)
    finally:
        torch.set_num_threads(threads_before)  # in-process callers (tests) keep their setting


def _run(args, argv, data, mcfg, tc, lrs, maps, map_options) -> dict:
    out = Path(args.out)
    names = ([] if args.no_softmax else [SOFTMAX]) + maps
    started = time.perf_counter()

    test = make_mqar(tc.num_test, data, seed=tc.seed * 1_000_003 + 10_000_019)  # never a training batch seed
    val = make_mqar(tc.num_val, data, seed=tc.seed * 1_000_003 + 20_000_003)
    ent_set = (test[0][: tc.num_entropy], test[1][: tc.num_entropy])
    base_state = copy.deepcopy(build_base(data, mcfg, tc.seed).state_dict())

    results: dict[str, dict] = {}
    for name in names:
        entry: dict = {
            "kind": "softmax_attention"
            if name == SOFTMAX
            else name
            if name in MIXER_ROWS
            else "linear_attention"
        }
        if name != SOFTMAX and name not in MIXER_ROWS:
            entry["feature_map"] = name
            entry["feature_map_options"] = map_options.get(name, {})
        try:
            first = build_model(name, base_state, data, mcfg, tc.seed, map_options.get(name))
        except Exception as exc:  # unknown map, bad option: report it, keep the table going
            entry.update(status=f"unavailable: {type(exc).__name__}: {exc}")
            results[name] = entry
            print(f"[mqar] {name}: {entry['status']}", file=sys.stderr)
            continue
        runs = []
        for i, lr in enumerate(lrs):
            model = (
                first if i == 0 else build_model(name, base_state, data, mcfg, tc.seed, map_options.get(name))
            )
            r = train_one(
                model, data, tc, lr, val, desc=f"{name:>9} lr={lr:g}", progress=not args.no_progress
            )
            r["lr"] = lr
            r["val_accuracy"], _ = accuracy(model, *val) if r["status"] == "ok" else (float("nan"), None)
            runs.append((r, model))
        ok = [rm for rm in runs if rm[0]["status"] == "ok"]
        best, model = max(ok, key=lambda rm: rm[0]["val_accuracy"]) if ok else runs[0]
        entry.update(best)
        entry["params"] = sum(p.numel() for p in model.parameters())
        if len(lrs) > 1:
            entry["lr_sweep"] = [
                {"lr": r["lr"], "status": r["status"], "val_accuracy": r["val_accuracy"]} for r, _ in runs
            ]
        if best["status"] == "ok":
            t = time.perf_counter()
            entry["accuracy"], entry["test_loss"] = accuracy(model, *test)
            try:
                entry.update(entropy_stats(model, *ent_set))
            except Exception as exc:
                entry["entropy_error"] = f"{type(exc).__name__}: {exc}"
            entry["eval_time_s"] = time.perf_counter() - t
        results[name] = entry
        print(
            f"[mqar] {name}: acc={entry.get('accuracy', float('nan')):.4f} "
            f"entropy={entry.get('entropy', float('nan')):.3f} time={entry['train_time_s']:.1f}s",
            file=sys.stderr,
        )

    report = {
        "benchmark": "mqar",
        "description": "multi-query associative recall, models trained from scratch; accuracy at query positions "
        "on fresh test samples; entropy = mean entropy (nats) of each query row of the attention weights over "
        "positions, heads, layers and samples ('entropy_query': only MQAR query positions)",
        "settings": {
            "data": asdict(data),
            "model": {"family": "llama (RoPE, eager softmax attention)", **asdict(mcfg)},
            "train": {
                **asdict(tc),
                "lrs": lrs,
                "optimizer": "AdamW(betas=(0.9, 0.98))",
                "schedule": "linear warmup + cosine to 0",
                "data": "fresh batch per step, same stream for every model",
                "loss": "cross-entropy at query positions only",
            },
            "quick": args.quick,
            "torch_threads": torch.get_num_threads(),
            "maps": maps,
            "map_options": map_options,
            "uniform_attention_entropy": uniform_entropy(ent_set[1]),
        },
        "models": results,
        "total_time_s": time.perf_counter() - started,
        **run_info("benchmarks/mqar.py", argv),
    }
    write_json(out / "mqar.json", report)
    print(summary_table(report))
    plot(report, out / "mqar.png")
    print(f"[mqar] wrote {out / 'mqar.json'} and {out / 'mqar.png'}", file=sys.stderr)
    return report


def summary_table(report: dict) -> str:
    rows = [
        "| model | test acc % | entropy | entropy @queries | dead rows % | train s | status |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(v, scale=1.0, nd=3):
        return (
            "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{scale * v:.{nd}f}"
        )

    for name, e in report["models"].items():
        rows.append(
            f"| {name} | {f(e.get('accuracy'), 100, 1)} | {f(e.get('entropy'))} | {f(e.get('entropy_query'))} "
            f"| {f(e.get('dead_row_fraction'), 100, 1)} | {f(e.get('train_time_s'), 1, 0)} | {e.get('status')} |"
        )
    u = report["settings"]["uniform_attention_entropy"]
    rows.append(
        f"\nuniform causal attention: entropy {u['entropy']:.3f}, @queries {u['entropy_query']:.3f} (nats)"
    )
    return "\n".join(rows)


def plot(report: dict, path: Path) -> Path:
    names = list(report["models"])
    acc = [report["models"][n].get("accuracy") for n in names]
    ent = [report["models"][n].get("entropy") for n in names]
    ent_q = [report["models"][n].get("entropy_query") for n in names]
    s = report["settings"]
    d, t = s["data"], s["train"]
    title = (
        f"MQAR from scratch: vocab {d['vocab_size']}, {d['num_kv_pairs']} kv pairs, {d['num_queries']} queries, "
        f"len {d['seq_len']}; {t['steps']} steps x {t['batch_size']}, lr {','.join(f'{x:g}' for x in t['lrs'])}"
    )
    labels = []
    for n in names:
        dead = report["models"][n].get("dead_row_fraction") or 0.0
        labels.append(f"{n}\n({dead:.0%} rows dead)" if dead >= 0.01 else n)
    return bar_chart(
        path,
        labels,
        [
            {
                "values": [None if a is None else 100 * a for a in acc],
                "ylabel": "test accuracy (%)",
                "title": "accuracy at query positions",
                "fmt": "{:.1f}",
                "ylim": (0, 105),
            },
            {
                "values": ent,
                "ylabel": "mean row entropy (nats)",
                "title": "attention entropy (all positions)",
                "hline": (s["uniform_attention_entropy"]["entropy"], "uniform causal"),
            },
            {
                "values": ent_q,
                "ylabel": "mean row entropy (nats)",
                "title": "attention entropy (query positions)",
                "hline": (s["uniform_attention_entropy"]["entropy_query"], "uniform causal"),
            },
        ],
        title=title,
    )


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
