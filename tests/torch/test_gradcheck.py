"""torch.autograd.gradcheck of every samebits.torch op: fp64 CPU tensors run the library's truth mode
(fp64 arithmetic and accumulators), so the registered backward (samebits' own backward op) is
checked against central differences at gradcheck's default tolerances. Needs torch, not a GPU."""
import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("samebits.torch needs torch >= 2.4 (torch.library.custom_op); test_torch_ops_autograd.py "
                "gradchecks the C++ dispatcher ops", allow_module_level=True)

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


def test_rope():
    pos = torch.tensor([0, 3, 9, 511, 2])
    f = lambda x: sbt.rope(x, pos, theta=10000.0)  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(5, 2, 8, seed=13),))
    llama = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64}
    g = lambda x: sbt.rope(x, pos, theta=500000.0, rope_scaling=llama)  # noqa: E731
    assert torch.autograd.gradcheck(g, (leaf(5, 2, 8, seed=14),))


def test_qk_norm_alone_and_fused_with_rope():
    pos = torch.tensor([4, 0, 77])
    plain = lambda x, w: sbt.qk_norm(x, w, 1e-6)  # noqa: E731
    fused = lambda x, w: sbt.qk_norm(x, w, 1e-6, pos, 10000.0)  # noqa: E731
    for f, seed in ((plain, 15), (fused, 17)):
        assert torch.autograd.gradcheck(f, (leaf(3, 2, 8, seed=seed), leaf(8, seed=seed + 1)))


def test_lm_head_logprobs():
    targets = torch.tensor([0, 12, -100, 5])  # -100: not scored
    f = lambda h, w: sbt.lm_head_logprobs(h, w, targets)  # noqa: E731
    assert torch.autograd.gradcheck(f, (leaf(4, 6, seed=19), leaf(13, 6, seed=20)))


def test_add_rms_norm_with_gradients_on_both_outputs():
    def f(x, r, w):
        y, s = sbt.add_rms_norm(x, r, w, 1e-6)
        return y, s * 0.5  # both outputs carry a gradient
    assert torch.autograd.gradcheck(f, (leaf(4, 9, seed=21), leaf(4, 9, seed=22), leaf(9, seed=23)))
