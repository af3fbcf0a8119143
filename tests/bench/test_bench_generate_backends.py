"""``bench generate``'s backend interface: every model is timed through ``DecodeBackend``
(``prefill``, ``decode_round``, ``plain_generate``, ``release``), the torch backend and llama.cpp's
alike, so the rounds pick no backend by its class; and what the decode table reports of a
student's compiled step comes from decode's public ``compiled_step_status``."""

import torch

from attn2ssm.bench.generate import (
    DecodeBackend,
    LlamaCppBench,
    TorchBackend,
    backend,
    build_models,
    measure_decode_interleaved,
)
from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.decode.plan import compiled_step_status
from tiny_models import tiny_model, tiny_student


class _Scripted(DecodeBackend):
    """A backend with no torch model behind it (as a GGUF has none): fixed times and tokens."""

    def __init__(self):
        self.released, self.rounds = [], 0

    def prefill(self, prompt):
        return {"seconds": 0.5, "peak_growth_mb": None, "ids": prompt, "state": "opened"}

    def decode_round(self, prefilled, new_tokens):
        assert prefilled["state"] == "opened"
        self.rounds += 1
        return {
            "seconds": [0.01] * (new_tokens - 1),
            "peak_growth_mb": None,
            "cache_mb": 2.0,
            "tokens": list(range(new_tokens)),
        }

    def release(self, prefilled):
        self.released.append(prefilled.pop("state"))


def test_any_backend_is_timed_beside_the_torch_models():
    """A backend without ``plain_generate`` gets no plain-generate check; the torch models beside
    it do; each backend's prefill is released once, after the rounds."""
    scripted = _Scripted()
    models = {**build_models(tiny_model("llama"), ["teacher"], torch.device("cpu")), "scripted": scripted}
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    rows = measure_decode_interleaved(models, ids, new_tokens=4, rounds=2, plain_check=True)
    assert scripted.rounds == 2 and scripted.released == ["opened"]
    assert rows["scripted"]["decode_ms_per_token"] == 10.0 and rows["scripted"]["cache_mb"] == 2.0
    assert "plain_generate_same_tokens" not in rows["scripted"]
    assert rows["teacher"]["plain_generate_same_tokens"] is True


def test_a_model_is_its_torch_backend_and_a_gguf_is_its_own():
    model = tiny_model("llama")
    assert isinstance(backend(model), TorchBackend) and backend(model).model is model
    gguf = LlamaCppBench("missing.gguf", threads=1, new_tokens=4)
    assert backend(gguf) is gguf and isinstance(gguf, DecodeBackend)
    assert gguf.plain_generate(torch.zeros(1, 4, dtype=torch.long), 4) is None


def test_compiled_step_status_says_why_a_student_decodes_eagerly():
    student = tiny_student("llama", "mamba2")
    assert compiled_step_status(student) == "not compiled"
    cpu_decode_layout(student)  # a plan, not compiled
    assert compiled_step_status(student) == "not compiled"
    hybrid = tiny_student("llama", "mamba2", ratio=0.5)
    cpu_decode_layout(hybrid, compile=True)
    assert compiled_step_status(hybrid).startswith("no decode plan: ")
