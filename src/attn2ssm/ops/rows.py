"""Few-row matmuls over row blocks of the weight: one-token decode products that use every core.

Decoding one token multiplies a (1, in) row by every weight matrix, so it is bound by how fast the
weights stream from memory. PyTorch's CPU backend (MKL) runs such a one-row product on ONE core:
~10-13 GB/s on the 2-core machine this project is measured on, where a plain reduction streams
~27 GB/s. Computing it as a batched matmul over ``p`` row blocks of the weight (p = the number of
threads) spreads the blocks over the cores: 1.3-2x faster for every weight shape of the built-in
teacher with the matrix in cache, ~1.5x when a whole model's weights stream from memory (13 vs
8-9 GB/s). The weight is only viewed as (p, out/p, in): same storage, same values, same layout.

Pure functions of tensors (and of a dict the caller owns, ``block_linear``'s memo). Who uses them
and when is ``attn2ssm.decode``'s business (its ``DecodeLinear``, the mixers' fused projections).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to 8 rows (a speculative verify forward of K <= 7 drafts): the row-block product is faster than
# F.linear at every row count measured. A whole model's weights (90 products of the built-in
# teacher's layer shapes + its 49152x576 head, 520 MB fp32, streamed from memory), quiet 2-core CPU,
# medians of 5: F.linear 45-62 ms at 2-8 rows (8-12 GB/s: MKL packs the weight), row blocks 27-36 ms;
# at 16 rows 49 vs 43 ms, where prefill-sized GEMMs take over.
MAX_ROWS = 8
MEMO_KEY = "_blocks"  # where ``block_linear`` keeps a weight's row-block view in its memo


def row_blocks(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """(parts, in, out/parts) view of ``weight``'s row blocks: same storage."""
    return weight.view(parts, weight.shape[0] // parts, weight.shape[1]).transpose(1, 2)


def block_product(
    x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``blocks = row_blocks(W, parts)`` and ``rows`` rows of x."""
    parts, width, part = blocks.shape
    y = torch.bmm(x.reshape(1, rows, width).expand(parts, rows, width), blocks)  # (parts, rows, out/parts)
    y = y.transpose(0, 1).reshape(*x.shape[:-1], parts * part)
    return y if bias is None else y + bias


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``parts`` row blocks of ``weight`` when ``x`` has at most
    MAX_ROWS rows (and the blocks divide evenly), else ``F.linear``. No thread-count, autograd
    or device checks: the caller made them (``linear``) or fixed ``parts`` (a traced step)."""
    out, width = weight.shape
    rows = x.numel() // width if width else 0
    if parts < 2 or rows == 0 or rows > MAX_ROWS or out % parts or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    return block_product(x, row_blocks(weight, parts), bias, rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for at most MAX_ROWS rows on CPU without autograd, computed
    as a batched matmul over row blocks of ``weight`` so that every thread streams a block."""
    if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return rows_linear(x, weight, bias, torch.get_num_threads())


def block_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, memo: dict
) -> torch.Tensor:
    """``linear`` with the weight's row-block view kept in ``memo`` (e.g. a module's ``__dict__``)
    for the weight's storage and the thread count: a decode step makes ~150 of these products,
    and the fewer small ops around each the better. Eager code only (storage pointers cannot be
    traced: a traced step calls ``rows_linear`` with its fixed block count)."""
    rows = x.numel() // weight.shape[1]
    if rows > MAX_ROWS or rows == 0 or torch.is_grad_enabled() or x.device.type != "cpu":
        return linear(x, weight, bias)
    parts, ptr = torch.get_num_threads(), weight.data_ptr()
    kept = memo.get(MEMO_KEY)
    if kept is None or kept[0] != ptr or kept[1] != parts:
        if parts < 2 or weight.shape[0] % parts or not weight.is_contiguous():
            return F.linear(x, weight, bias)
        kept = memo[MEMO_KEY] = (ptr, parts, row_blocks(weight, parts))
    return block_product(x, kept[2], bias, rows)
