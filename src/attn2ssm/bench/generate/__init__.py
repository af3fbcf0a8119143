"""``attn2ssm bench generate``: decode speed, prefill time and memory against context length, and
(``--spec``) speculative decoding with the student as the target (acceptance, tokens per target
forward, speedup over the target's own plain greedy decode) for each drafter and K.

What is measured, per model and context length L:
- prefill: time from calling ``generate`` to the first new token (one forward over L tokens);
- decode: per-token times of ``new_tokens`` greedy tokens after it, stamped by a streamer inside
  ``model.generate`` (HF's own loop, KV cache for the teacher, our cache for students). Every
  model prefills once; then ``rounds`` rounds decode from copies of the prefilled caches, the
  models taking turns within a round, so a slow spell of a shared machine hits all of them. The
  rate is 1 / the median per-token time (quartiles and every time are kept in the JSON);
- memory: the bytes held by the cache after decoding (KV grows with L, a recurrent state does
  not), and peak memory growth during decode (CUDA: max_memory_allocated; CPU: the process's
  peak RSS, reset before decoding through /proc/self/clear_refs).
Students are converted from the teacher without training: speed and memory do not depend on the
weights (``NAME=DIR`` times a trained one). Besides the plain conversions (``STUDENTS``), the
long-context recipes' students (``RECIPE_STUDENTS``) are built by the recipe's own code, their
teacher-dependent choices fixed (``recipe_student``): ``linear_hybrid25`` keeps whole attention
layers, ``retrieval_heads`` a few softmax KV groups inside linear-attention layers. On CPU every model, teacher included, gets ``cpu_decode_layout`` (one-row matmuls over
row blocks of the weight on every core, gate/up and mixer input projections fused, fused
RMSNorm) unless ``cpu_layout`` is off; pure students of a Llama-structured teacher also decode
through their one-token ``DecodePlan`` there (HF's per-layer plumbing skipped), with
``compile_students`` (``--compile``) as one ``torch.compile``d function (compiled before any
timing), while the teacher runs HF's own forward with its KV cache (the reference the issue names).
Hybrids with attention layers (``hybrid25``, ``linear_hybrid25``) have no plan and decode through
HF's forward; a student whose linear attention has a softmax window or kept softmax heads
(``retrieval_heads``) has a plan but no one-token step, so the plan runs each layer's forward over
the one token, eagerly (``compiled_decode_step`` in the JSON says why).

Speculative decoding (``run_spec_bench``, Mamba in the Llama §4): the target is a student (a pure
Mamba-2 and a 25 % hybrid; trained ones with ``NAME=DIR``), the drafters prompt lookup ("ngram",
no model) and any ``--draft`` models (a shallow student). Target and draft models prefill the
prompt once; the target's plain greedy decode (one token per forward, its fast decode path) and
speculative decoding for each drafter and K start from copies of those caches, taking turns in
each round, so every variant decodes the same text from the same state. Two tasks: the corpus' own
text, and a passage the prompt asks to repeat (where lookup shines).

``backend="llama.cpp"`` measures the same rows where users run small models: each model is a GGUF in
``llama_cpp.Llama`` (export/llamacpp.py), ``threads`` threads, flash attention on (llama.cpp's own CLI picks
it on CPU), the default f16 KV cache. The teacher's GGUF comes from its HF checkpoint through
llama.cpp's converter and the students' through ``attn2ssm export --format gguf``
(export/gguf.py), each at every type in ``quants`` (teacher and students at the same type:
``teacher@q8_0`` is the reference of ``mamba2@q8_0``). Students are untrained conversions built
with ``LLAMA_CPP_STUDENT_OPTIONS``, what a GGUF export needs (``gdn``, a pure gated delta-rule
student, runs as llama.cpp's ``qwen35``). Prefill = feeding the L prompt tokens
and taking the first token; a round restores llama.cpp's saved context state (KV cells and recurrent
states) after the prefill and decodes one token at a time; the cache column is that state's size
after decoding (llama_state_get_size, which also holds one row of logits).

The package, one job a module (each imports only those before it):
- ``models``: the settings, the students the benchmark builds, the prompt text;
- ``timing``: the backend interface (``DecodeBackend``: ``prefill``, ``decode_round``; the torch
  backend here), memory and clocks, the interleaved rounds and the rows by context;
- ``speculative``: ``--spec``;
- ``llama_cpp``: ``--backend llama.cpp`` (``LlamaCppBench``, a ``DecodeBackend``);
- ``speed``: ``run_generate_bench`` (the torch decode table, or the two above), its plot and table.
"""

from attn2ssm.bench.generate.llama_cpp import LlamaCppBench, build_gguf_models, run_llama_cpp_bench
from attn2ssm.bench.generate.models import (
    BUILTIN_KEPT_GROUPS,
    BUILTIN_KEPT_LAYERS,
    LLAMA_CPP_STUDENT_OPTIONS,
    LLAMA_CPP_STUDENTS,
    RECIPE_STUDENTS,
    STUDENTS,
    BenchSettings,
    build_models,
    parse_format,
    prompt_ids,
    recipe_student,
)
from attn2ssm.bench.generate.speculative import (
    COPY_INSTRUCTION,
    COPY_PASSAGE,
    COPY_PRIMER,
    copy_prompt,
    format_spec_bench,
    measure_speculative,
    plot_spec_bench,
    run_spec_bench,
)
from attn2ssm.bench.generate.speed import format_generate_bench, plot_generate_bench, run_generate_bench
from attn2ssm.bench.generate.timing import (
    DecodeBackend,
    TorchBackend,
    backend,
    cache_bytes,
    decode_by_context,
    decode_round,
    decode_row,
    measure_decode,
    measure_decode_interleaved,
    plain_generate,
    prefill,
    quantile,
    reference_name,
    stream_rate,
    warm_up,
)

__all__ = [
    "BUILTIN_KEPT_GROUPS",
    "BUILTIN_KEPT_LAYERS",
    "BenchSettings",
    "COPY_INSTRUCTION",
    "COPY_PASSAGE",
    "COPY_PRIMER",
    "DecodeBackend",
    "LLAMA_CPP_STUDENTS",
    "LLAMA_CPP_STUDENT_OPTIONS",
    "LlamaCppBench",
    "RECIPE_STUDENTS",
    "STUDENTS",
    "TorchBackend",
    "backend",
    "build_gguf_models",
    "build_models",
    "cache_bytes",
    "copy_prompt",
    "decode_by_context",
    "decode_round",
    "decode_row",
    "format_generate_bench",
    "format_spec_bench",
    "measure_decode",
    "measure_decode_interleaved",
    "measure_speculative",
    "parse_format",
    "plain_generate",
    "plot_generate_bench",
    "plot_spec_bench",
    "prefill",
    "prompt_ids",
    "quantile",
    "recipe_student",
    "reference_name",
    "run_generate_bench",
    "run_llama_cpp_bench",
    "run_spec_bench",
    "stream_rate",
    "warm_up",
]
