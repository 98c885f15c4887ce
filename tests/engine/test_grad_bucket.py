"""The reduce bucket (``comm.flagged_grad_bucket``): each gradient at the start of its slot,
zeros past its end and for a gradient this rank did not compute, one has-gradient flag
per slot after the values, whatever memory the bucket was allocated over."""

from __future__ import annotations

import torch

from torchtitan_dmuon.engine.comm import flagged_grad_bucket


def test_a_bucket_holds_the_gradients_zero_padding_and_flags():
    grads = [torch.arange(1.0, 7.0).reshape(2, 3), None, torch.full((4,), -2.0)]
    numels = [8, 5, 4]
    for _ in range(3):  # over freed buckets' memory, refilled with garbage below
        bucket = flagged_grad_bucket(grads, numels, torch.float32, torch.device("cpu"))
        expected = torch.cat([
            torch.arange(1.0, 7.0), torch.zeros(2), torch.zeros(5), torch.full((4,), -2.0),
            torch.tensor([1.0, 0.0, 1.0]),
        ])  # fmt: skip
        assert torch.equal(bucket, expected)
        bucket.fill_(float("nan"))
        del bucket
