"""The fused-kernel group (``pytest -m interpret``): fla's Triton kernels against attn2ssm's PyTorch
forms. It runs in a process of its own (``make test`` starts it after the main suite):

* on a CPU under Triton's interpreter, with ``TRITON_INTERPRET=1`` set before Python starts (fla and
  triton read it at import) — the case CI runs; fp32 and fp16 (bf16 is not emulated faithfully);
* on a CUDA GPU with ``ATTN2SSM_KERNEL_TESTS=cuda`` (the device script), where bf16 runs too.

Anywhere else (the main suite's process) nothing here is collected, so that process never sees
the interpreter's settings. The interpreter needs two test-side patches (``_interpreter_shim``).
"""

import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = os.environ.get("ATTN2SSM_KERNEL_TESTS") == "cuda"

if not (INTERPRET or ON_CUDA):
    collect_ignore_glob = ["test_*.py"]
else:
    pytest.importorskip("triton", reason="the kernel group needs attn2ssm[gpu] (triton, fla-core)")
    pytest.importorskip("fla", reason="the kernel group needs attn2ssm[gpu] (triton, fla-core)")
    if INTERPRET:
        import _interpreter_shim  # noqa: F401  (before any fla kernel runs)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.interpret)


@pytest.fixture(scope="session")
def device():
    import torch

    if ON_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            False  # fp32 compared as fp32
        )
        return torch.device("cuda")
    return torch.device("cpu")
