"""The optimizers of models/optim.py: AdamW's update is torch.optim.AdamW's (weight decay,
bias correction), the same whatever the layout (whole tensors, one flat buffer, flat shards),
whatever the gradient's strides, and its state a plain state dict that resumes the same run."""

import subprocess
import sys

import pytest
import torch

from smoltrain.models.optim import SGD, AdamW


def _grads(n: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(7, 5, generator=g), torch.randn(13, generator=g)] for _ in range(n)]


def test_adamw_is_torch_adamw_with_decay_and_bias_correction():
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(13)
    ref = [torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())]
    ours = AdamW([a, b], lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for ga, gb in _grads(6, 1):
        ours.step([ga, gb])
        ref[0].grad, ref[1].grad = ga.clone(), gb.clone()
        torch_opt.step()
    for p, r in zip((a, b), ref):
        assert torch.allclose(p, r.detach(), rtol=1e-6, atol=1e-7)
    assert ours.step_count == 6


def test_adamw_same_update_whole_flat_and_sharded_and_strided():
    """dp's whole tensors, the parameter server's flat buffer, fsdp's flat shards, and a
    gradient handed over transposed (not contiguous): one update, within float rounding."""
    torch.manual_seed(2)
    a, b = torch.randn(7, 5), torch.randn(13)
    flat = torch.cat([a.reshape(-1), b])
    shards = [flat[:20].clone(), flat[20:].clone()]
    at = a.clone()  # the same values, its gradient handed over strided
    whole, one = AdamW([a, b], lr=1e-3, weight_decay=0.01), AdamW([flat], lr=1e-3, weight_decay=0.01)
    sharded, strided = AdamW(shards, lr=1e-3, weight_decay=0.01), AdamW([at], lr=1e-3, weight_decay=0.01)
    for ga, gb in _grads(3, 3):
        whole.step([ga, gb])
        g = torch.cat([ga.reshape(-1), gb])
        one.step([g])
        sharded.step([g[:20], g[20:]])
        strided.step([ga.t().contiguous().t()])  # values of ga, strides of a transpose
    want = torch.cat([a.reshape(-1), b])
    assert torch.allclose(flat, want, rtol=1e-6, atol=0)
    assert torch.allclose(torch.cat(shards), want, rtol=1e-6, atol=0)
    assert torch.allclose(at, a, rtol=1e-6, atol=0)


def test_adamw_state_is_a_state_dict_that_resumes():
    torch.manual_seed(4)
    p, q = torch.randn(7, 5), torch.randn(13)
    p2, q2 = p.clone(), q.clone()
    grads = _grads(4, 5)
    first = AdamW([p, q], lr=1e-2, weight_decay=0.1)
    for g in grads:
        first.step(g)
    second = AdamW([p2, q2], lr=1e-2, weight_decay=0.1)
    for g in grads[:2]:
        second.step(g)
    state = {k: v.clone() for k, v in second.state_tensors().items()}
    assert sorted(state) == ["opt.0.m", "opt.0.v", "opt.1.m", "opt.1.v", "opt.step"]
    assert state["opt.step"].tolist() == [2]
    resumed = AdamW([p2, q2], lr=1e-2, weight_decay=0.1)
    resumed.load_state_tensors(state)
    for g in grads[2:]:
        resumed.step(g)
    assert torch.equal(p, p2) and torch.equal(q, q2)


def test_adamw_refuses_a_strided_parameter():
    with pytest.raises(ValueError, match="contiguous"):
        AdamW([torch.zeros(3, 4).t()])


def test_sgd_steps_against_the_gradient():
    p = torch.tensor([1.0, -1.0])
    SGD([p], lr=0.5).step([torch.tensor([2.0, -2.0])])
    assert p.tolist() == [0.0, 0.0]


FAULTS = """
import resource, sys, torch
from smoltrain import host
torch.set_num_threads(1)
kept = host.keep_freed_memory() if sys.argv[1] == "keep" else None
def step():  # a step's gradients and activations (113 MB): allocated, then all freed
    return [torch.ones(n << 18) for n in (64, 3, 40, 3, 3)]
step(), step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_training_process_keeps_the_memory_it_frees():
    """host.keep_freed_memory (run.worker, calibration): a step's freed gradients come back
    without the kernel faulting their pages in again (28928 pages of 4 KB for 113 MB)."""

    def faults(arg):
        out = subprocess.run([sys.executable, "-c", FAULTS, arg], capture_output=True, text=True, check=True)
        kept, n = out.stdout.split()
        return kept, int(n)

    plain = faults("plain")[1]
    assert plain > 20000  # glibc hands the 64 and 40 MB back to the kernel
    kept, n = faults("keep")
    assert kept == "True" and n < plain / 4
