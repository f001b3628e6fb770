"""The bindings the benchmarks drive (bench/*.py), on the CPU backend: KV-cache steps of the model
chain (Chain.kv_cache / Chain.step), samebits' device-memory statistics, the kernel-shape hook
_set_tuning, and the raw ops residual_add_forward and attention_forward_paged."""
import math

import numpy as np
import pytest

import samebits
from samebits import _core

_NP = {np.dtype(np.float32): "fp32", np.dtype(np.int32): "int32", np.dtype(np.uint8): "uint8"}


def desc(a):
    return (a.ctypes.data, _NP[a.dtype], a.shape, "cpu", a)


def sequences(n, vocab, lo=6, hi=30, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def same_bits(a, b):
    return np.asarray(a, np.float64).tobytes() == np.asarray(b, np.float64).tobytes()


def test_decode_steps_give_the_full_forwards_logprobs_bit_for_bit(chain, model):
    seqs = sequences(3, model.config["vocab_size"])
    want = chain.logprobs(seqs)  # entry i: log p(token i | tokens < i); entry 0 NaN
    prompt = 4
    cache = chain.kv_cache(len(seqs), max(len(s) for s in seqs))
    got = [[] for _ in seqs]
    # Prefill of every prompt, each scoring its next token too.
    lp = chain.step(cache, [s[:prompt] for s in seqs], next_tokens=[s[prompt] for s in seqs])
    assert lp.shape == (prompt * len(seqs),)
    for i in range(len(seqs)):
        got[i] += lp[i * prompt:(i + 1) * prompt].tolist()
        assert cache.length(i) == prompt
    # Then one token a step, the sequences that still have tokens decoding together in their slots.
    for t in range(prompt, max(len(s) for s in seqs)):
        live = [i for i, s in enumerate(seqs) if t < len(s)]
        nxt = [seqs[i][t + 1] if t + 1 < len(seqs[i]) else 0 for i in live]
        lp = chain.step(cache, [[seqs[i][t]] for i in live], next_tokens=nxt, slots=live)
        for k, i in enumerate(live):
            got[i].append(lp[k])
    for i, s in enumerate(seqs):
        assert cache.length(i) == len(s)
        assert same_bits(got[i][:len(s) - 1], want[i][1:])  # the last value scored the 0 put after the end


def test_chunked_prefill_and_the_nan_of_an_unscored_last_token(chain, model):
    (s,) = sequences(1, model.config["vocab_size"], lo=20, hi=21, seed=5)
    want = chain.logprobs([s])[0]
    cache = chain.kv_cache(2, 32)
    a = chain.step(cache, [s[:7]], slots=[1])  # slot 1; no next token: its last value is NaN
    assert math.isnan(a[-1]) and same_bits(a[:-1], want[1:7])
    b = chain.step(cache, [s[7:]], slots=[1])
    assert same_bits(b[:-1], want[8:]) and math.isnan(b[-1])
    assert cache.length(1) == 20 and cache.length(0) == 0 and cache.capacity == 32 and cache.slots == 2
    cache.reset(1)
    assert cache.length(1) == 0
    c = chain.step(cache, [s], slots=[1])  # the whole sequence again, after the reset
    assert same_bits(c[:-1], want[1:])


def test_step_refuses_bad_input(chain, model):
    vocab = model.config["vocab_size"]
    cache = chain.kv_cache(2, 8)
    with pytest.raises(samebits.Error, match="overflows"):
        chain.step(cache, [[1] * 9])
    with pytest.raises(samebits.Error, match="given twice"):
        chain.step(cache, [[1], [2]], slots=[0, 0])
    with pytest.raises(samebits.Error, match="outside"):
        chain.step(cache, [[1]], slots=[2])
    with pytest.raises(samebits.Error, match="one token per sequence"):
        chain.step(cache, [[1], [2]], next_tokens=[3])
    with pytest.raises(samebits.Error, match="outside"):
        chain.step(cache, [[1]], next_tokens=[vocab])
    with pytest.raises(samebits.Error, match="outside"):
        chain.step(cache, [[vocab]])
    with pytest.raises(samebits.Error, match="empty"):
        chain.step(cache, [[]])
    with pytest.raises(samebits.Error, match="at least 1"):
        chain.kv_cache(0, 8)
    with pytest.raises(samebits.Error, match="at least 1"):
        chain.kv_cache(1, 0)
    other = samebits.Chain(samebits.Model.builtin(tied=True), backend="cpu")
    with pytest.raises(samebits.Error, match="another model"):
        other.step(cache, [[1]])
    with pytest.raises(samebits.Error, match="outside"):
        cache.length(5)
    assert cache.length(0) == 0 and cache.length(1) == 0  # nothing was appended by a refused step


def test_device_memory_statistics():
    assert _core.device_memory_in_use("cpu") == 0
    assert _core.device_memory_peak("cpu") == 0
    assert _core.device_memory_peak("cpu", reset=True) == 0
    _core.device_memory_release("cpu")
    if samebits.cuda_available():
        base = _core.device_memory_in_use("cuda")
        assert base >= 0 and _core.device_memory_peak("cuda", reset=True) >= base
        _core.device_memory_release("cuda")
    else:
        with pytest.raises(samebits.Error):
            _core.device_memory_in_use("cuda")
    with pytest.raises(samebits.Error):
        _core.device_memory_in_use("tpu")


def test_set_tuning_hook():
    assert _core._set_tuning("norm_any_dtype", 1) == 0
    assert _core._set_tuning("norm_any_dtype", 0) == 1
    assert _core._set_tuning("gemm_tile_width", 128) == 0
    assert _core._set_tuning("gemm_tile_width", 0) == 128
    assert _core._set_tuning("lm_head_vocab_chunk", 4096) == 0
    assert _core._set_tuning("lm_head_vocab_chunk", 0) == 4096
    with pytest.raises(samebits.Error, match="not a tuning hook"):
        _core._set_tuning("tile", 1)
    with pytest.raises(samebits.Error, match="takes"):
        _core._set_tuning("gemm_tile_width", 100)
    with pytest.raises(samebits.Error, match="multiple of 256"):
        _core._set_tuning("lm_head_vocab_chunk", 300)
    for hook, env in (("fused_swiglu", "SAMEBITS_FUSED_SWIGLU"), ("narrow_decode", "SAMEBITS_NARROW_DECODE"),
                      ("persistent_prefill", "SAMEBITS_PERSISTENT_PREFILL"),
                      ("attention_overlap", "SAMEBITS_ATTENTION_OVERLAP")):  # the experiments' switches
        assert _core._set_tuning(hook, 1) == 0
        assert _core._set_tuning(hook, -1) == 1
        assert _core._set_tuning(hook, 0) == -1
        with pytest.raises(samebits.Error, match=f"takes -1 \\(never\\), 0 \\({env}\\) or 1"):
            _core._set_tuning(hook, 2)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    a = samebits.rms_norm(x, w)
    _core._set_tuning("norm_any_dtype", 1)  # a CUDA kernel choice: the CPU backend is unaffected
    try:
        assert samebits.rms_norm(x, w).tobytes() == a.tobytes()
    finally:
        _core._set_tuning("norm_any_dtype", 0)


def test_raw_residual_add():
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((3, 50)).astype(np.float32) for _ in range(2))
    y = np.empty_like(a)
    _core.raw.residual_add_forward(desc(a), desc(b), desc(y))
    assert y.tobytes() == (a + b).tobytes()  # fp32 in, fp32 out: one rounding, as NumPy's
    with pytest.raises(samebits.Error):
        _core.raw.residual_add_forward(desc(a), desc(b[:2].copy()), desc(y))


def test_raw_paged_attention_is_the_contiguous_attention():
    rng = np.random.default_rng(4)
    hq, hkv, d, page, lens = 4, 2, 16, 4, (8, 12)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)  # one new token a sequence (decode)
    k, v = (rng.standard_normal((sum(lens), hkv, d)).astype(np.float32) for _ in range(2))
    seqs = np.array([[0, 1, 0, 8], [1, 1, 8, 12]], np.int32)
    out, lse = np.empty_like(q), np.empty((len(lens), hq), np.float32)
    _core.raw.attention_forward(desc(q), desc(k), desc(v), desc(seqs), desc(out), desc(lse))
    # The same keys cut into pages of 4 rows and shuffled over the pool.
    perm = rng.permutation(sum(lens) // page)
    pool_k, pool_v = np.empty_like(k), np.empty_like(v)
    for j, p in enumerate(perm):  # page j of the packed keys at pool page p
        pool_k[p * page:(p + 1) * page] = k[j * page:(j + 1) * page]
        pool_v[p * page:(p + 1) * page] = v[j * page:(j + 1) * page]
    table = np.array([list(perm[:2]) + [0], list(perm[2:5])], np.int32)  # sequence 0 uses 2 of its 3 columns
    paged_seqs = np.array([[0, 1, 0, 8], [1, 1, 0, 12]], np.int32)
    out2, lse2 = np.empty_like(q), np.empty_like(lse)
    _core.raw.attention_forward_paged(desc(q), desc(pool_k), desc(pool_v), desc(paged_seqs), desc(out2),
                                      desc(lse2), desc(table), page_size=page)
    assert out2.tobytes() == out.tobytes() and lse2.tobytes() == lse.tobytes()
    with pytest.raises(samebits.Error, match="page_size"):
        _core.raw.attention_forward_paged(desc(q), desc(k), desc(pool_v), desc(seqs), desc(out2), desc(lse2),
                                          page_size=4)
