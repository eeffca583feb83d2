"""Reducers on a ragged mask: token-mean, sequence-mean, Dr.GRPO; global denominators; padding hygiene."""

import pytest
import torch

from miles_k3.algo import dr_grpo_mean, masked_mean, reduce_loss, sequence_mean, token_mean

NAN = float("nan")


def ragged():
    # lengths 4, 2, 1; padding holds NaN to prove it is selected out
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, NAN, NAN], [5.0, NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    return x, mask


def test_token_mean():
    x, mask = ragged()
    # (1 + 2 + 3 + 4 + 10 + 20 + 5) / 7 = 45 / 7
    torch.testing.assert_close(token_mean(x, mask), torch.tensor(45 / 7))


def test_sequence_mean():
    x, mask = ragged()
    # per sequence: 10/4 = 2.5, 30/2 = 15, 5/1 = 5 -> (2.5 + 15 + 5) / 3 = 7.5
    torch.testing.assert_close(sequence_mean(x, mask), torch.tensor(7.5))


def test_dr_grpo():
    x, mask = ragged()
    # 45 / (B = 3 * L_max = 8) = 1.875, whatever the lengths are
    torch.testing.assert_close(dr_grpo_mean(x, mask, 8), torch.tensor(1.875))


def test_empty_row():
    x, mask = ragged()
    x = torch.cat([x, torch.full((1, 4), NAN)])
    mask = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    torch.testing.assert_close(reduce_loss(x, mask, "token_mean"), torch.tensor(45 / 7))
    torch.testing.assert_close(reduce_loss(x, mask, "sequence_mean"), torch.tensor(7.5))  # empty row not counted
    torch.testing.assert_close(reduce_loss(x, mask, "dr_grpo", max_response_len=8), torch.tensor(45 / 32))  # 4 rows


def test_all_masked_is_zero_not_nan():
    x = torch.full((2, 3), NAN)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for name in ("token_mean", "sequence_mean", "dr_grpo"):
        assert reduce_loss(x, mask, name, max_response_len=3).item() == 0.0


def test_float_mask_equals_bool_mask():
    x, mask = ragged()
    for name in ("token_mean", "sequence_mean", "dr_grpo"):
        a = reduce_loss(x, mask, name, max_response_len=8)
        b = reduce_loss(x, mask.float(), name, max_response_len=8)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "name, denom_kw",
    [
        ("token_mean", dict(num_tokens=7)),
        ("sequence_mean", dict(num_sequences=3)),
        ("dr_grpo", dict(num_sequences=3)),
    ],
)
def test_micro_batches_with_global_denominators_sum_to_full(name, denom_kw):
    x, mask = ragged()
    full = reduce_loss(x, mask, name, max_response_len=8)
    parts = [reduce_loss(x[i:j], mask[i:j], name, max_response_len=8, **denom_kw) for i, j in ((0, 1), (1, 3))]
    torch.testing.assert_close(sum(parts), full)


def test_gradients_finite_with_nan_padding():
    x, mask = ragged()
    x.requires_grad_()
    for name in ("token_mean", "sequence_mean", "dr_grpo"):
        x.grad = None
        reduce_loss(x, mask, name, max_response_len=8).backward()
        assert torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[~mask], torch.zeros(int((~mask).sum())))
    # token_mean: every valid token weighs 1/7
    x.grad = None
    reduce_loss(x, mask, "token_mean").backward()
    torch.testing.assert_close(x.grad[mask], torch.full((7,), 1 / 7))


def test_masked_mean_dims():
    x, mask = ragged()
    torch.testing.assert_close(masked_mean(x, mask, -1), torch.tensor([2.5, 15.0, 5.0]))


def test_errors():
    x, mask = ragged()
    with pytest.raises(ValueError, match="unknown reducer"):
        reduce_loss(x, mask, "mean")
    with pytest.raises(ValueError, match="max_response_len"):
        reduce_loss(x, mask, "dr_grpo")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        reduce_loss(x, mask[:, :2], "token_mean")
    with pytest.raises(ValueError, match="max_response_len"):
        dr_grpo_mean(x, mask, 0)
