"""Dataset kinds on the stage's own chat data: ``sft`` (cross-entropy on the assistant tokens, plus an
optional KL to the teacher) and ``dpo`` (distilled DPO against preference pairs, the teacher as the
reference policy: Mamba in the Llama's stage 3)."""

from __future__ import annotations

import torch

from attn2ssm.distill.losses import dpo_loss, forward_kl, response_cross_entropy, sequence_logps
from attn2ssm.distill.stages.base import StageKind
from attn2ssm.distill.stages.lm import teacher_targets


def _token_scale(batch: dict, count: torch.Tensor) -> torch.Tensor:
    """Per-real-token normalisation over the whole optimizer step: the trainer passes the mean
    number of loss tokens per micro-batch and process (``mean_loss_tokens``), so
    sum / mean_loss_tokens, averaged over micro-batches and processes, is sum / total tokens."""
    mean = batch.get("mean_loss_tokens")
    return count.clamp_min(1) if mean is None else count.new_tensor(float(mean))


class SFTStage(StageKind):
    """Supervised finetuning on chat data: next-token CE on the assistant tokens only (the stage's
    ``data``, rendered with the teacher's chat template), per assistant token; plus
    ``kl_weight``·KL(teacher ‖ student) on the same positions (Mamba in the Llama's "with_distill" SFT)."""

    name = "sft"
    uses_teacher = True  # for the optional KL term
    caches_teacher_logits = True
    loss_defaults = {"kl_weight": 0.0}
    data_formats = ("auto", "messages", "prompt_completion")

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        s_logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ce_sum, count = response_cross_entropy(s_logits, ids, loss_mask)
        norm = _token_scale(batch, count)
        loss = ce_sum / norm
        metrics = {"ce": loss.detach()}
        if opts["kl_weight"]:
            t_logits = teacher_targets(teacher, ids, mask, batch)
            # position t predicts token t+1: score the positions whose next token is the assistant's
            kl = forward_kl(
                s_logits[:, :-1],
                t_logits[:, :-1],
                loss_mask[:, 1:],
                temperature=cfg.temperature,
                chunk_size=cfg.kl_chunk,
            )
            kl = kl * (count.clamp_min(1) / norm)  # forward_kl normalises by this batch's count
            loss = loss + opts["kl_weight"] * kl
            metrics["kl"] = kl.detach()
        return loss, metrics


class DPOStage(StageKind):
    """Distilled DPO (Mamba in the Llama, Eq. 4): preference pairs, the frozen teacher as the reference
    policy. Sequence log-probs are summed over reply tokens only; β = 0.01 by default. Metrics:
    implicit rewards β·(log π_θ − log π_T) of chosen and rejected replies, their margin, and the
    reward accuracy (share of pairs with chosen reward > rejected reward)."""

    name = "dpo"
    uses_teacher = True
    loss_defaults = {"beta": 0.01}
    data_formats = ("auto", "preference")

    def loss(self, student, teacher, batch, cfg):
        opts = self.options(cfg)
        ids, mask, loss_mask = _stack_pairs(batch)
        n = batch["chosen_input_ids"].shape[0]
        with torch.no_grad():
            ref = sequence_logps(
                teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, loss_mask
            )
        policy = sequence_logps(
            student(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids, loss_mask
        )
        loss = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], opts["beta"])
        with torch.no_grad():
            rewards = opts["beta"] * (policy - ref)
            chosen, rejected = rewards[:n], rewards[n:]
            metrics = {
                "reward_chosen": chosen.mean().detach(),
                "reward_rejected": rejected.mean().detach(),
                "reward_margin": (chosen - rejected).mean().detach(),
                "reward_accuracy": (chosen > rejected).float().mean().detach(),
                "logp_chosen": policy[:n].mean().detach(),
                "logp_rejected": policy[n:].mean().detach(),
            }
        return loss, metrics


def _stack_pairs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded batch, so each model runs once."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    out = []
    for key in ("input_ids", "attention_mask", "loss_mask"):
        parts = [
            torch.nn.functional.pad(batch[f"{side}_{key}"], (0, width - batch[f"{side}_{key}"].shape[1]))
            for side in ("chosen", "rejected")
        ]
        out.append(torch.cat(parts))
    return tuple(out)
