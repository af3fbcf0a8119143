"""A decode plan's layers as one ``torch.compile``d function (opt-in, CPU decode mode).

With the one-token ``DecodePlan`` a pure student's step on the 2-core CPU is ~28-31 ms of
weight streaming (538 MB for the built-in teacher's students) and ~15-20 ms of ~1,000 small
eager ops and the Python around them. Compiled (inductor), the small ops become a few fused C++
loops and the Python runs once at trace time; the matmuls stay the same row-block products
(``ops/rows.rows_linear``). Measured on the built-in teacher's students: ~37-42 ms a token
instead of ~45-60 (``benchmarks/results/generate_speed.json``, ``--compile``).

What is traced is the plan's own code: the layers' norms and MLPs and each mixer's ``step``
(the same function the eager step and the mixer's forward run; tests hold them equal). No
argument tells them they are traced: decode-mode code asks ``torch.compiler.is_compiling()``.
Then the fusions are used unchecked (their storage-pointer checks cannot be traced: this step
checks them just before each call), the products run as row blocks, as many as the thread count
this step keeps on every module of the model (``_row_parts``, read by ``fusion.row_parts``), and
states come back new (no in-place update inside a graph). The cache bookkeeping (new states
stored, token counts) stays outside, in Python.

Used by the plan only when everything the trace assumed still holds: every fusion valid (checked
before each call), every mixer able to step this cache in a trace (``traceable``: no position-
aware feature map, whose step reads the token count; no hook on a mixer's tap, which a stage such
as CAB's reads outside the graph), the thread count the trace was made for. Otherwise the plan
runs its eager step. A first call traces and compiles (about a minute on the 2-core CPU; a few
seconds once inductor's on-disk cache has it); dynamo re-traces if a module it read was replaced
(e.g. fusions rebuilt after ``.to()``) and for each new batch size (shapes are static: one
compiled graph per size, up to dynamo's cap). A trace or compile failure turns the compiled step
off with the reason in ``model.compiled_step_reason`` and the step runs eagerly: nothing is lost.
"""

from __future__ import annotations

import logging
import time
import types

import torch

from attn2ssm.decode.fusion import FUSION_KEYS
from attn2ssm.decode.step import run_layer

logger = logging.getLogger(__name__)

BACKEND = "inductor"  # the default torch.compile backend (tests swap in a tracing-only one)


def traceable(mixer, layer) -> bool:
    """Can a trace run ``mixer.step`` for this cache layer? Not with a position-aware feature map
    (the trace must not read ``seen``), nor while a stage hooks the mixer's tap (the hook runs
    outside the graph)."""
    if not mixer.can_step(layer):
        return False
    maps = (getattr(mixer, "feature_map_q", None), getattr(mixer, "feature_map_k", None))
    if any(getattr(m, "uses_positions", False) for m in maps):
        return False
    tap = getattr(mixer, "bc_tap", None)
    return tap is None or not (tap._forward_hooks or tap._forward_pre_hooks)


class CompiledStep:
    """See the module docstring. ``CompiledStep.build(plan)`` → (step or None, reason)."""

    def __init__(self, plan, backend=None):
        self.plan, self.backend = plan, backend or BACKEND
        self.parts = torch.get_num_threads()
        # the row blocks of every product in the trace (see fusion.row_parts)
        for module in plan.model.modules():
            module.__dict__["_row_parts"] = self.parts
        # where fusions live (or may come back after standard_layout): checked before every call
        holders = {id(m): m for step in plan.steps for m in (step.mixer, step.mlp)}
        holders.update(
            {
                id(m): m
                for m in plan.model.modules()
                if any(m.__dict__.get(k) is not None for k in FUSION_KEYS)
            }
        )
        self.fusion_slots = [(m, key) for m in holders.values() for key in FUSION_KEYS]
        # dynamo keeps compiled entries per code object, with a cap (8): each step gets its own copy
        # of _layers' code, or a process holding several students would run out of entries
        layers = types.FunctionType(CompiledStep._layers.__code__.replace(), globals(), "_layers")
        self.fn = torch.compile(
            types.MethodType(layers, self), backend=self.backend, dynamic=False, fullgraph=True
        )
        self.compiled_once = False
        self.failed: str | None = None
        self.stepped_aside: str | None = None  # why ``ready`` last said no for a mixer

    @classmethod
    def build(cls, plan, backend=None) -> tuple[CompiledStep | None, str]:
        if plan is None:
            return None, "no decode plan"
        missing = [type(step.mixer).__name__ for step in plan.steps if step.index not in plan.stepping]
        if missing:
            return None, f"{missing[0]} has no one-token step; it decodes eagerly"
        return cls(plan, backend), ""

    # -- the traced function ---------------------------------------------------------------
    def _layers(self, x, pes: list, states: list):
        new = []
        for step, layer_states in zip(self.plan.steps, states):
            pe = None if step.rope is None else pes[step.rope]
            y, updated = step.mixer.step(step.norm_in.forward(x), pe, layer_states)
            new.append(updated)
            x = run_layer(step, x, y)
        # contiguous states: the next call's inputs then match this trace's (a conv state comes out
        # of the step as a strided view of its window; the prefill's is contiguous)
        new = [{k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in d.items()} for d in new]
        return self.plan.logits(x), new

    # -- running ---------------------------------------------------------------------------
    def ready(self, cache) -> bool:
        """Does everything the trace assumed hold for this call?"""
        if self.failed is not None or torch.get_num_threads() != self.parts:
            return False
        for module, key in self.fusion_slots:
            fusion = module.__dict__.get(key)
            if fusion is not None and not fusion.valid():
                return False
        for step in self.plan.steps:
            if not traceable(step.mixer, cache.mixer_layer(step.index)):
                # what compiled_step_status reports while the step has never run
                kind = getattr(step.mixer, "mixer_type", type(step.mixer).__name__)
                self.stepped_aside = f"layer {step.index} ({kind}) has no one-token step a trace can run here (e.g. kept softmax heads, a softmax window the context has not filled yet): the plan runs its layers eagerly"
                return False
        return True

    def __call__(self, x, pes: list, cache):
        """Logits for one token; the cache's states replaced and advanced. None if the compiled
        function failed (then and on later calls the plan runs its eager step)."""
        layers = [cache.mixer_layer(step.index) for step in self.plan.steps]
        first = not self.compiled_once
        if first:
            logger.warning(
                "compiling the decode step with torch.compile (%s): about a minute on a 2-core CPU the first time, "
                "seconds once cached",
                self.backend,
            )
            start = time.perf_counter()
        try:
            logits, new = self.fn(x, pes, [layer.states for layer in layers])
        except Exception as exc:  # noqa: BLE001 - any trace/compile failure: run eagerly from now on
            self.failed = f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self.plan.model.compiled_step_reason = self.failed
            logger.warning("compiled decode step turned off (%s); decoding eagerly", self.failed)
            return None
        if first:
            self.compiled_once = True
            logger.warning("decode step compiled in %.1f s", time.perf_counter() - start)
        for layer, updated in zip(layers, new):
            layer.states.update(updated)
            layer.advance(1)
        return logits
