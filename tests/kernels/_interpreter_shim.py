"""Triton's interpreter on a CPU for fla's kernels (test-side only; imported by this group's
conftest when ``TRITON_INTERPRET=1``):

* no autotuning benchmark: there is no GPU driver to time configs with, so every config "takes" 0
  and the first one wins;
* loop counters: fla casts ``range`` loop variables with ``.to(tl.int64)``, which compiled Triton
  allows; interpreted they are plain ints, so fla's modules get a ``range`` whose ints have ``.to``;
* scalars: the interpreter turns a scalar kernel argument into an int with ``int(array)``, which
  NumPy >= 2.3 refuses for its one-element arrays; take the one element instead.
"""

import builtins
import operator
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before Python starts"

import triton.runtime.autotuner as _autotuner  # noqa: E402
import triton.runtime.interpreter as _interpreter  # noqa: E402

_autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]

_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_lang_tensor_one_element(tensor, scope):
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


_interpreter._patch_lang_tensor = _patch_lang_tensor_one_element


class _Counter(int):
    def to(self, *args, **kwargs):
        return self


class _CountingRange:
    def __init__(self, *args):
        self.r = builtins.range(*(operator.index(a) for a in args))

    def __iter__(self):
        return map(_Counter, self.r)

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]


# the fla modules attn2ssm's adapters use (ops/fla.py), imported now so their globals get the range
import fla.modules.causal_conv1d  # noqa: E402,F401
import fla.ops.gated_delta_rule  # noqa: E402,F401
import fla.ops.simple_gla  # noqa: E402,F401

for _name, _module in list(sys.modules.items()):
    if (_name == "fla" or _name.startswith("fla.")) and _module is not None:
        _module.range = _CountingRange  # module globals shadow builtins
