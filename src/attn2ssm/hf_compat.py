"""Where the student meets the parts of transformers that move between releases.

Everything version-dependent lives here, so a new transformers release is mended in one file
(and ``attn2ssm upgrade DIR`` refreshes the copy inside a saved checkpoint).

transformers 5.24 renamed the cache argument of every model, decoder layer and attention module,
of ``generate``'s model kwargs and of the output classes from ``past_key_values`` to ``cache``
(``deprecate_kwarg`` keeps the old name working for callers until 5.40, but a module that is
*called by* a decoder layer receives only the new name). Our mixers used to read
``kwargs["past_key_values"]``; under 5.24 they got nothing and decoded every token without its
recurrent state, silently. Since then:

- the student's ``forward`` takes the cache under either name and hands it to its mixers through
  the ``MixerContext`` it shares with them, so a mixer never depends on what a decoder layer
  calls the argument (an explicit cache argument, under any of ``CACHE_NAMES``, still wins:
  our own callers pass one);
- the student calls its wrapped model, builds outputs and fills ``generate``'s kwargs with
  ``CACHE_KWARG``, the name this transformers uses;
- after every cached forward the student checks that each mixer layer consumed the new tokens,
  so a future rename fails loudly instead of decoding statelessly.

This file is copied into every saved checkpoint with the rest of the modeling code: the range
below is the one that code was tested with, and loading it under another release warns once.
"""

from __future__ import annotations

import inspect
import logging

import transformers
from transformers import GenerationMixin

# transformers releases the test suite passed on (>= first, < second); pyproject's range matches.
TESTED_TRANSFORMERS = ("5.23", "5.25")

# Names a cache argument has had in transformers' attention call signatures (GPT-NeoX: layer_past).
CACHE_NAMES = ("cache", "past_key_values", "layer_past")

# What this transformers calls the cache in model kwargs and output classes.
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

logger = logging.getLogger("attn2ssm")


def _release(version: str) -> tuple[int, ...]:
    """'5.24.0.dev0' → (5, 24, 0): the numeric release part, enough to compare with the range."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def untested_transformers(version: str = transformers.__version__) -> str | None:
    """A one-line warning when ``version`` is outside ``TESTED_TRANSFORMERS``, else None."""
    low, high = TESTED_TRANSFORMERS
    if _release(low) <= _release(version) < _release(high):
        return None
    return (
        f"attn2ssm student code was tested with transformers >={low},<{high}; this is {version} "
        f"(if generation looks wrong, install a tested release or run `attn2ssm upgrade DIR` on the checkpoint)"
    )


def warn_if_untested() -> None:
    message = untested_transformers()
    if message is not None:
        logger.warning(message)


def pick_cache(cache, past_key_values):
    """The cache a caller passed as ``cache=`` (transformers >= 5.24) or ``past_key_values=``."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once, as cache= or as past_key_values=, not both")
    return cache if cache is not None else past_key_values


def explicit_cache(kwargs: dict):
    """A cache handed to an attention module under any name it has had, else None."""
    for name in CACHE_NAMES:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def output_cache(output):
    """The cache a model output carries (``.cache`` from 5.24 on, ``.past_key_values`` before)."""
    return getattr(output, CACHE_KWARG, None)


# transformers 5.24 binds these functions of a Gated DeltaNet model's modeling module (Qwen3.5,
# Qwen3-Next, OLMo-Hybrid) to flash-linear-attention's (or causal-conv1d's) kernels at import
# whenever that package imports, whatever the device; fla's kernels are Triton's and cannot run on
# a CPU (fla installed there, a forward fails: "RuntimeError: 0 active drivers").
KERNELIZED = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def cpu_runs_reference_kernels(model) -> list[str]:
    """Make ``model``'s modeling module run its own PyTorch reference form of each ``KERNELIZED``
    function (what transformers' kernel wrapper was made from) for CPU tensors, and what
    transformers bound for tensors elsewhere. For every model of that class in the process, once;
    a no-op for a class without such functions. Returns the names routed now."""
    import sys

    module = sys.modules.get(type(model).__module__)
    routed = []
    for name in KERNELIZED:
        bound = getattr(module, name, None)
        if bound is None or getattr(bound, "_cpu_reference", False) or inspect.unwrap(bound) is bound:
            continue
        setattr(module, name, _cpu_reference(bound))
        routed.append(name)
    return routed


def _cpu_reference(bound):
    """``bound`` (a transformers kernel wrapper), with CPU tensors sent to the reference it wraps."""
    import functools

    import torch

    reference = inspect.unwrap(bound)
    params = inspect.signature(reference).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(reference)
    def routed(*args, **kwargs):
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        packed = kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None
        if first is None or first.device.type != "cpu" or packed:  # packed: transformers' own message
            return bound(*args, **kwargs)
        return reference(*args, **{k: v for k, v in kwargs.items() if any_keyword or k in params})

    routed._cpu_reference = True
    return routed


warn_if_untested()
