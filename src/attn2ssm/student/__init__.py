"""The student: a teacher architecture with chosen attention modules swapped for mixers.

Importing this package registers ``Attn2SSMConfig`` / ``Attn2SSMForCausalLM`` with the
transformers Auto classes, so a saved student also loads without ``trust_remote_code`` where
attn2ssm is installed.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.modeling import Attn2SSMForCausalLM

AutoConfig.register(Attn2SSMConfig.model_type, Attn2SSMConfig, exist_ok=True)
AutoModelForCausalLM.register(Attn2SSMConfig, Attn2SSMForCausalLM, exist_ok=True)

__all__ = ["Attn2SSMConfig", "Attn2SSMForCausalLM"]
