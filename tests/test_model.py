"""The model, the data and the optimizer: in-process, no workers."""

from __future__ import annotations

import pytest
import torch

from smolnet.errors import UsageError
from smoltrain.models.data import Batches, load_corpus
from smoltrain.models.gpt import build_model, loss_sum, split_units
from smoltrain.models.optim import AdamW
from smoltrain.models.spec import get_model, with_overrides
from smoltrain.planner.placement import split_batch


def test_parameter_count_matches_the_planners_spec():
    for name in ("tiny",):
        spec = get_model(name)
        model = build_model(spec, seed=0)
        assert sum(p.numel() for p in model.parameters()) == spec.params()
    small_gpt2 = with_overrides(
        get_model("gpt2-124m"), layers=1, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=300, ctx=32
    )
    model = build_model(small_gpt2, seed=0)  # tied: the head shares the embedding
    assert sum(p.numel() for p in model.parameters()) == small_gpt2.params()


def test_initial_weights_depend_on_the_seed_only():
    spec = get_model("tiny")
    a, b, c = build_model(spec, 3), build_model(spec, 3), build_model(spec, 4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_forward_shape_and_initial_loss_near_uniform():
    spec = get_model("tiny")
    model = build_model(spec, 0)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    loss = loss_sum(logits, x, 2 * 16)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_split_units_covers_every_unit_once():
    for layers, stages in [(6, 1), (6, 2), (6, 3), (7, 3), (6, 6)]:
        ranges = split_units(layers + 2, layers, stages)
        flat = [i for r in ranges for i in r]
        assert flat == list(range(layers + 2))
        assert all(len(r) >= 1 for r in ranges)


def test_batches_are_a_function_of_seed_and_step():
    data = load_corpus()
    assert len(data) > 100_000
    b1, b2 = Batches(data, 6, 32, seed=1), Batches(data, 6, 32, seed=1)
    x1, y1 = b1.global_batch(5)
    x2, _ = b2.global_batch(5)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, b1.global_batch(6)[0])
    # slices of the global batch, whatever the split, put it back together
    parts = [b1.slice(5, lo, hi)[0] for lo, hi in split_batch(6, [2, 1, 1])]
    assert torch.equal(torch.cat(parts), x1)


def test_split_batch_proportional_and_complete():
    assert split_batch(8, [1, 1]) == [(0, 4), (4, 8)]
    assert split_batch(8, [2, 1, 1]) == [(0, 4), (4, 6), (6, 8)]
    r = split_batch(7, [100, 1, 1])
    assert r[-1][1] == 7 and all(hi > lo for lo, hi in r)
    with pytest.raises(UsageError):
        split_batch(2, [1, 1, 1])


def test_data_folder_and_missing_path(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "b.bin").write_bytes(b"\x00" * 100)
    assert load_corpus(str(tmp_path)) == b"hello world " * 100
    with pytest.raises(UsageError, match="no such file"):
        load_corpus(str(tmp_path / "nope"))


def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    p1 = torch.randn(50, requires_grad=False)
    p2 = p1.clone().requires_grad_(True)
    ours = AdamW([p1], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([p2], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(50)
        ours.step([g])
        p2.grad = g.clone()
        ref.step()
    assert torch.allclose(p1, p2.detach(), rtol=1e-6, atol=1e-7)


def test_adamw_is_layout_independent():
    """A flat shard and whole tensors get the same update (what fsdp and syncps rely on)."""
    torch.manual_seed(1)
    a, b = torch.randn(7, 5), torch.randn(13)
    flat = torch.cat([a.reshape(-1), b])
    opt1, opt2 = AdamW([a, b], lr=1e-3), AdamW([flat], lr=1e-3)
    for _ in range(3):
        ga, gb = torch.randn(7, 5), torch.randn(13)
        opt1.step([ga, gb])
        opt2.step([torch.cat([ga.reshape(-1), gb])])
    assert torch.allclose(torch.cat([a.reshape(-1), b]), flat, rtol=1e-6, atol=0)
