"""The student: a teacher architecture with chosen attention modules swapped for mixers.

Importing this package registers ``Attn2SSMConfig`` / ``Attn2SSMForCausalLM`` / ``Attn2SSMModel``
(no LM head) and ``Attn2SSMForImageClassification`` (vision students, student/vision.py) with the
transformers Auto classes, so a saved student also loads without
``trust_remote_code`` where attn2ssm is installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.modeling import Attn2SSMForCausalLM, Attn2SSMModel
from attn2ssm.student.vision import Attn2SSMForImageClassification

AutoConfig.register(Attn2SSMConfig.model_type, Attn2SSMConfig, exist_ok=True)
AutoModel.register(Attn2SSMConfig, Attn2SSMModel, exist_ok=True)
AutoModelForCausalLM.register(Attn2SSMConfig, Attn2SSMForCausalLM, exist_ok=True)
AutoModelForImageClassification.register(Attn2SSMConfig, Attn2SSMForImageClassification, exist_ok=True)

__all__ = ["Attn2SSMConfig", "Attn2SSMForCausalLM", "Attn2SSMForImageClassification", "Attn2SSMModel"]
