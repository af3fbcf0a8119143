"""A student in decode mode: how ``attn2ssm.decode`` attaches itself to the model.

The student's own class (``attn2ssm.student.modeling``) knows nothing of decoding tricks. Decode
mode swaps the model's class for a subclass with one of the mixins below (``attach_student``;
``undo_cpu_decode_layout`` puts the class back), keeping its name, module and everything else:

- ``forward`` hands a one-token call to the model's ``DecodePlan`` (plan.py, kept in the model's
  ``__dict__`` under ``_decode_plan``) when the plan says it can take it, and otherwise calls the
  student's own ``forward`` with the same arguments;
- ``save_pretrained`` writes inside ``standard_layout``: each fused parameter gets its own storage
  while the checkpoint is written (what it holds: plain independent tensors, the state dict of a
  student never put in decode mode), and is fused again afterwards.
"""

from __future__ import annotations

from attn2ssm.decode.fusion import decode_class, standard_layout
from attn2ssm.hf_compat import pick_cache


class DecodeSaving:
    """Mixed into a student's class: ``save_pretrained`` writes independent tensors."""

    def save_pretrained(self, *args, **kwargs):
        with standard_layout(self):
            return super().save_pretrained(*args, **kwargs)


class DecodeCausalLM(DecodeSaving):
    """Mixed into ``Attn2SSMForCausalLM``: one-token calls the decode plan can take go to it. The
    parameters are ``Attn2SSMForCausalLM.forward``'s, in its order (``generate`` reads them)."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        past_key_values=None,
        **kwargs,
    ):
        plan = self.__dict__.get("_decode_plan")
        if plan is not None:
            picked = pick_cache(cache, past_key_values)
            if plan.takes(
                input_ids, attention_mask, picked, inputs_embeds, labels, use_cache, logits_to_keep, kwargs
            ):
                return plan(input_ids, position_ids, kwargs.get("cache_position"), picked)
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            past_key_values=past_key_values,
            **kwargs,
        )


def attach_student(model, causal_lm: bool) -> bool:
    """Give ``model`` (a student, or the same classes loaded as remote code) its decode-mode class:
    ``causal_lm`` (an ``Attn2SSMForCausalLM``: its forward may use a plan) or a saving one. True if
    it changed."""
    cls = type(model)
    if "_decode_base" in cls.__dict__:
        return False
    model.__class__ = decode_class(DecodeCausalLM if causal_lm else DecodeSaving, cls, same_name=True)
    return True
