"""``Attn2SSMForImageClassification``: a ViT/DeiT image classifier with its attention swapped for
bidirectional Mamba mixers — CAB's Vision Mamba (Vim) student, built the attn2ssm way.

As for language students, the wrapped model (``self.base``) is the teacher family's own
``ViTForImageClassification`` / ``DeiTForImageClassification`` built from ``config.base_config``
by transformers (patch embedding, position embeddings, class token, LayerNorms, MLPs, classifier),
and each layer's ``attention`` module is a mixer (``bimamba``). Differences from the paper's Vim
(recorded choices): the block keeps the teacher's MLP after the mixer (a Vim block has none), and
the class token stays at index 0 of the residual stream; the mixer scans it in the middle
(``cls_position: middle``), so the classifier still reads token 0.

``build_vision_student`` makes a fresh student for a teacher: every weight drawn anew, as the
paper's vision students are trained from scratch (CAB §4.1); ``depth`` and ``layer_map`` give
a student of another depth (a 24-layer Vim from a 12-layer DeiT), ``config.teacher_layers``
records which teacher layer each student layer is aligned to (Eq. 7).

Saved with ``save_pretrained``: safetensors, config with ``auto_map`` (AutoConfig +
AutoModelForImageClassification) and the flattened modeling code, so
``AutoModelForImageClassification.from_pretrained(dir, trust_remote_code=True)`` works where
attn2ssm is not installed. Keep imports to torch, transformers and attn2ssm modules of that kind.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForImageClassification, PreTrainedModel

from attn2ssm.student.configuration import Attn2SSMConfig
from attn2ssm.student.modeling import Attn2SSMPreTrainedModel

VISION_AUTO_CLASS = "AutoModelForImageClassification"


class Attn2SSMForImageClassification(Attn2SSMPreTrainedModel):
    main_input_name = "pixel_values"

    def __init__(self, config: Attn2SSMConfig):
        super().__init__(config)
        base_config = config.build_base_config()
        self.base = AutoModelForImageClassification.from_config(
            base_config, attn_implementation=config.base_attn_implementation, dtype=torch.get_default_dtype()
        )
        self._swap_in_mixers()
        self._finish_init()

    def get_input_embeddings(self):
        return None

    def forward(self, pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs):
        """As the family's ``ForImageClassification.forward`` (logits (b, num_labels), loss with ``labels``)."""
        self.mixer_context.padding_mask = None
        return self.base(pixel_values=pixel_values, labels=labels, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """HF save plus the flattened modeling code and an ``auto_map`` for image classification."""
        from attn2ssm.student.remote_code import flat_name, write_remote_code

        self.config.auto_map = {
            "AutoConfig": f"{flat_name('attn2ssm.student.configuration')}.Attn2SSMConfig",
            VISION_AUTO_CLASS: f"{flat_name('attn2ssm.student.vision')}.Attn2SSMForImageClassification",
        }
        PreTrainedModel.save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(
                save_directory, roots=("attn2ssm.student.configuration", "attn2ssm.student.vision")
            )
