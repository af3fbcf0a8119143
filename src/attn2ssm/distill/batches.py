"""The batches of an optimizer step. Block (or example) order is a deterministic function of
(seed, stage, sample index): every optimizer step takes the same *global* batch of
``stage.batch_size`` items whatever the number of processes, process r of W taking its slice of each
micro-batch, so the loss curve does not depend on W and a resume continues exactly."""

from __future__ import annotations

import torch

from attn2ssm.data import block_indices


def batch_indices(
    n_items: int, seed: int, stage_idx: int, step: int, accum_i: int, cfg, world: int, rank: int
):
    """This process's items (blocks, or dataset examples) for micro-batch ``accum_i`` of step ``step``."""
    per = cfg.batch_size // (cfg.grad_accum * world)
    start = step * cfg.batch_size + accum_i * world * per + rank * per
    return block_indices(n_items, seed + 1000 * stage_idx, start, per)


def step_indices(n_items: int, seed: int, stage_idx: int, step: int, cfg) -> torch.Tensor:
    """Every process's items of optimizer step ``step`` (the global batch)."""
    return block_indices(n_items, seed + 1000 * stage_idx, step * cfg.batch_size, cfg.batch_size)


def micro_batches(run, step: int, blocks, seed: int, acc, with_step: bool = False):
    """``(tokens of the global batch, this process's micro-batches of optimizer step step)`` of a
    stage (``StageRun``): corpus ``blocks``, or the stage's own dataset, right-padded, with
    ``mean_loss_tokens`` (loss tokens of the global batch ÷ micro-batches ÷ processes, the same on
    every process). ``with_step``: the batches carry ``step`` / ``steps`` (image stages: losses with a
    schedule of their own, vision_cab's align_until)."""
    cfg, world, rank = run.cfg, acc.num_processes, acc.process_index
    if run.dataset is None:
        batches = (
            {
                "input_ids": blocks[
                    batch_indices(len(blocks), seed, run.index, step, a, cfg, world, rank)
                ].to(acc.device)
            }
            for a in range(cfg.grad_accum)
        )
        return cfg.batch_size * run.seq_len, batches
    global_idx = step_indices(run.n_items, seed, run.index, step, cfg).tolist()
    mean_loss_tokens = run.dataset.loss_tokens(global_idx) / (cfg.grad_accum * world)

    def collate(a: int) -> dict:
        idx = batch_indices(run.n_items, seed, run.index, step, a, cfg, world, rank).tolist()
        batch = {k: v.to(acc.device) for k, v in run.dataset.collate(idx).items()}
        batch["mean_loss_tokens"] = mean_loss_tokens
        if with_step:
            batch["step"], batch["steps"] = step, run.steps
        return batch

    return run.dataset.tokens(global_idx), (collate(a) for a in range(cfg.grad_accum))


def metric(value, device) -> torch.Tensor:
    """A metric as a float64 0-d tensor on ``device`` (a kind's detached tensor; a Python number from
    an older kind), without a copy that would wait for the device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)
