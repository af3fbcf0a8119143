"""Teacher forcing for the layer-local stages: what each teacher attention module sees and returns.

Layer-local distillation trains a student mixer on the *teacher's* input to that layer
(teacher forcing), so errors never compound across layers and no gradient crosses layers.
One teacher forward with hooks gives every layer's input hidden states, RoPE cos/sin and
attention output; the forward stops after the last layer that is needed, and the LM head
never runs. The capture itself is ``adapters.capture`` (CAB's bridge stage and eval's
attention-fidelity metrics read the teacher through it too); this is its distill-side name.
"""

from attn2ssm.adapters.capture import AttentionIO, capture_attention_io

__all__ = ["AttentionIO", "capture_attention_io"]
