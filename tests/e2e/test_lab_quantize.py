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


def test_magnitude_pruning_zeroes_each_matrix_smallest_weights_and_nothing_else(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(2)
    src = tmp_path / "src"
    src.mkdir()
    w, norm = torch.randn(8, 50, generator=gen), torch.randn(50, generator=gen)
    save_file({"w": w, "norm": norm}, src / "model.safetensors")
    out = load_file(
        tinymodel.perturb_weights(src, tmp_path / "out", mode="prune", scale=0.25) / "model.safetensors"
    )
    zeroed = out["w"] == 0
    assert int(zeroed.sum()) == 100  # a quarter of 400
    assert w.abs()[zeroed].max() <= w.abs()[~zeroed].min()  # the smallest magnitudes went
    assert torch.equal(out["w"][~zeroed], w[~zeroed]) and torch.equal(out["norm"], norm)


def test_one_finetuning_step_moves_every_weight_by_at_most_lr(tmp_path):
    from safetensors.torch import load_file

    src = tinymodel.build_tiny_model(tmp_path / "src", seed=0)
    out = tinymodel.finetune_step(src, tmp_path / "out", train=[("Once upon a time", " a cat")], lr=1e-3)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and (out / "tokenizer.json").exists()
    moved = [(after[k] - before[k]).abs() for k in before]
    assert max(float(d.max()) for d in moved) <= 1e-3 * (1 + 1e-4)  # Adam's first step: |Δ| ≤ lr
    assert sum(int((d > 5e-4).sum()) for d in moved) > 0.5 * sum(d.numel() for d in moved)
    assert not (out / tinymodel.MARKER).exists()  # never mistaken for a clean build
