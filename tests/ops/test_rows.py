"""Few-row products over row blocks of the weight (``ops/rows.py``): every route gives
``F.linear``'s result, the memoised one included."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.ops.rows import MAX_ROWS, MEMO_KEY, block_linear, block_product, linear, row_blocks, rows_linear


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
def test_block_matmul_equals_f_linear(threads, rows):
    """Every route (blocks over 2 threads, out not divisible by 3 threads, 5 rows, autograd on)
    gives F.linear's result."""
    g = torch.Generator().manual_seed(rows)
    # 98: blocks for 2 threads, not for 3
    w, b = torch.randn(98, 40, generator=g), torch.randn(98, generator=g)
    x = torch.randn(rows, 1, 40, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(linear(x[:, 0], w), F.linear(x[:, 0], w), rtol=1e-5, atol=1e-5)
        wg = w.clone().requires_grad_()
        linear(x, wg, b).sum().backward()
        torch.testing.assert_close(wg.grad, torch.ones(98, 1) * x.reshape(-1, 40).sum(0))  # d Σy / dW
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("parts", [1, 2, 7])
def test_rows_linear_and_the_memoised_block_linear_equal_f_linear(parts):
    g = torch.Generator().manual_seed(parts)
    # 98 = 2·49: blocks for 2 and 7 parts
    w, b = torch.randn(98, 40, generator=g), torch.randn(98, generator=g)
    x = torch.randn(1, 1, 40, generator=g)
    torch.testing.assert_close(rows_linear(x, w, b, parts), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        memo: dict = {}
        with torch.no_grad():
            for _ in range(2):  # the second call reads the kept view
                torch.testing.assert_close(
                    block_linear(x, w, b, memo), F.linear(x, w, b), rtol=1e-5, atol=1e-5
                )
        assert memo[MEMO_KEY][:2] == (w.data_ptr(), 2)
        w2 = w * 2  # another storage: a new view, not the stale one
        with torch.no_grad():
            torch.testing.assert_close(block_linear(x, w2, b, memo), F.linear(x, w2, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(1, 3, 40), (1, 8, 40), (8, 40), (2, 4, 40)])
def test_block_route_takes_a_verify_forwards_rows_and_equals_f_linear(shape):
    """A speculative verify forward (K + 1 <= MAX_ROWS tokens) takes the row-block route."""
    g = torch.Generator().manual_seed(len(shape))
    w, b = torch.randn(98, 40, generator=g), torch.randn(98, generator=g)
    x = torch.randn(*shape, generator=g)
    assert x.numel() // 40 <= MAX_ROWS
    torch.testing.assert_close(rows_linear(x, w, b, 2), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    blocks = row_blocks(w, 2)
    torch.testing.assert_close(
        block_product(x, blocks, b, x.numel() // 40), F.linear(x, w, b), rtol=1e-5, atol=1e-5
    )
