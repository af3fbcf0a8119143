"""Teacher-family adapters: the only code in attn2ssm that looks inside a teacher's attention.

``get_adapter(model_or_config)`` returns the adapter for a supported decoder family; see
``base.py`` for the canonical weight layout and ``common.Adapter`` for the per-family API.
"""

from attn2ssm.adapters.base import AttentionGeometry, AttentionWeights
from attn2ssm.adapters.capture import AttentionIO, capture_attention_io, capture_teacher_attention
from attn2ssm.adapters.common import Adapter, probs_from_qk
from attn2ssm.adapters.gemma import Gemma2Adapter, Gemma3Adapter, GemmaAdapter
from attn2ssm.adapters.gpt2 import GPT2Adapter
from attn2ssm.adapters.gpt_neox import GPTNeoXAdapter

# Importing the family modules registers them.
from attn2ssm.adapters.llama import LlamaAdapter  # noqa: E402  (isort: after registry)
from attn2ssm.adapters.mistral import MistralAdapter
from attn2ssm.adapters.phi import PhiAdapter
from attn2ssm.adapters.qwen2 import Qwen2Adapter
from attn2ssm.adapters.registry import (
    get_adapter,
    register_adapter,
    supported_families,
    supported_model_types,
)
from attn2ssm.adapters.vit import ViTAdapter
from attn2ssm.ops.rope import apply_rotary

__all__ = [
    "Adapter",
    "AttentionIO",
    "AttentionGeometry",
    "AttentionWeights",
    "GPT2Adapter",
    "GPTNeoXAdapter",
    "Gemma2Adapter",
    "Gemma3Adapter",
    "GemmaAdapter",
    "LlamaAdapter",
    "MistralAdapter",
    "PhiAdapter",
    "Qwen2Adapter",
    "ViTAdapter",
    "apply_rotary",
    "capture_attention_io",
    "capture_teacher_attention",
    "get_adapter",
    "probs_from_qk",
    "register_adapter",
    "supported_families",
    "supported_model_types",
]
