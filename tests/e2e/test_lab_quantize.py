"""The weight round trips the detection tests and benchmark serve as silently changed deployments (torch,
which the end-to-end suite has with vLLM)."""

from canaryd.lab import tinymodel


def test_int4_round_trip_has_at_most_15_levels_per_group_and_bounded_error():
    import torch

    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(1))  # 70: a padded last group
    y = tinymodel._round_trip_int4(x)
    assert y.shape == x.shape
    for row_x, row_y in zip(x, y, strict=True):
        for start in range(0, 70, 32):
            gx, gy = row_x[start : start + 32], row_y[start : start + 32]
            step = gx.abs().max() / 7
            assert len(set(gy.tolist())) <= 15
            assert (gx - gy).abs().max() <= step / 2 + 1e-6
    assert not torch.equal(x, y)  # a round trip that changed nothing would test nothing
