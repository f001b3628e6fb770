"""torch.autograd.gradcheck of every samebits.torch op: fp64 CPU tensors run the library's truth mode
(fp64 arithmetic and accumulators), so the registered backward (samebits' own backward op) is
checked against central differences at gradcheck's default tolerances. Needs torch, not a GPU."""
import pytest

torch = pytest.importorskip("torch")

import samebits.torch as sbt  # noqa: E402


def leaf(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def test_linear():
    assert torch.autograd.gradcheck(sbt.linear, (leaf(5, 7, seed=1), leaf(3, 7, seed=2), leaf(3, seed=3)))


def test_rms_norm():
    f = lambda x, w: sbt.rms_norm(x, w, 1e-6)  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(4, 9, seed=4), leaf(9, seed=5)))


def test_token_logprobs_and_entropy():
    targets = torch.tensor([0, 10, 3, 7])
    f = lambda z: sbt.token_logprobs(z, targets)  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(4, 11, seed=6),))


def test_attention():
    f = lambda q, k, v: sbt.attention(q, k, v, [3, 5, 1])  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(9, 4, 8, seed=7), leaf(9, 2, 8, seed=8), leaf(9, 2, 8, seed=9)))


def test_swiglu():
    assert torch.autograd.gradcheck(sbt.swiglu, (leaf(6, 5, seed=10), leaf(6, 5, seed=11)))


def test_embedding():
    ids = torch.tensor([[2, 0, 2], [4, 2, 1]])
    f = lambda table: sbt.embedding(ids, table)  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(5, 6, seed=12),))
