"""The Python bindings on the CPU backend: bitwise invariance through the Python API, accuracy of
the ops against an fp64 NumPy reference, and clear exceptions for bad input."""
import json
import math
import os
import tempfile

import numpy as np
import pytest

import samebits


def seqs(n, vocab, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def test_version_and_backends():
    assert samebits.version() == "0.1.0"
    assert "cpu" in samebits.backends()
    assert isinstance(samebits.cuda_available(), bool)


def test_model_config_and_round_trip(model):
    c = model.config
    assert c["architecture"] == "qwen3" and c["num_layers"] == 2 and c["head_dim"] == 64
    with tempfile.TemporaryDirectory() as d:
        model.save(d)
        again = samebits.Model.load(d)
        assert again.config == c
        s = seqs(3, c["vocab_size"])
        a = samebits.Chain(model, "cpu").logprobs(s)
        b = samebits.Chain(again, "cpu").logprobs(s)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_config_of_json_reads_a_config_as_the_chain_does():
    # samebits.hf.patch reads a transformers config through this (the chain's own parser): eps, the
    # architecture's QK-norm, RoPE theta and Llama-3 scaling (transformers 4 and 5 spellings).
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
    q = samebits._core.config_of_json(json.dumps(dict(base, model_type="qwen3", head_dim=32, rope_theta=1e6)))
    assert q["qk_norm"] and q["rope_scaling"] is None and q["rope_theta"] == 1e6 and q["rms_norm_eps"] == 1e-5
    assert q["head_dim"] == 32
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    for spelling in ({"rope_theta": 5e5, "rope_scaling": scaling}, {"rope_parameters": dict(scaling, rope_theta=5e5)}):
        ll = samebits._core.config_of_json(json.dumps(dict(base, model_type="llama", **spelling)))
        assert not ll["qk_norm"] and ll["rope_theta"] == 5e5 and ll["rope_scaling"] == scaling
        assert ll["head_dim"] == 16
    with pytest.raises(samebits.Error, match="attention_bias"):
        samebits._core.config_of_json(json.dumps(dict(base, model_type="qwen3", attention_bias=True)))
    with pytest.raises(samebits.Error, match="rope_type"):
        samebits._core.config_of_json(json.dumps(dict(base, model_type="llama", rope_scaling={"rope_type": "yarn"})))


def test_a_sequence_has_the_same_bits_alone_and_in_any_batch(chain, model):
    vocab = model.config["vocab_size"]
    batch = seqs(12, vocab)
    target = batch[5]
    alone = chain.logprobs([target])[0]
    assert math.isnan(alone[0]) and np.isfinite(alone[1:]).all()
    for others in (batch, batch[::-1], [target] * 3, batch[:6]):
        got = chain.logprobs(others)
        where = [i for i, s in enumerate(others) if s == target]
        assert where
        for i in where:
            assert got[i].tobytes() == alone.tobytes()  # raw bits (NaN included), not allclose


def test_logprobs_with_entropy_are_probabilities(chain, model):
    s = seqs(2, model.config["vocab_size"])
    lp, ent = chain.logprobs(s, entropy=True)
    for a, e, q in zip(lp, ent, s):
        assert len(a) == len(q) == len(e)
        assert (a[1:] <= 0).all() and (e[1:] >= 0).all()
        assert (e[1:] <= math.log(model.config["vocab_size"]) + 1e-6).all()


def test_gradients_are_the_same_bits_for_any_micro_batch(chain, model):
    s = seqs(5, model.config["vocab_size"], seed=9)
    whole = chain.gradients(s, micro_batch=16)
    for mb in (1, 2, 3):
        part = chain.gradients(s, micro_batch=mb)
        assert part.keys() == whole.keys()
        for name in whole:
            assert part[name].dtype == np.float32
            assert part[name].tobytes() == whole[name].tobytes(), (mb, name)
    assert any(np.abs(g).max() > 0 for g in whole.values())


def test_kept_forward_and_backward_are_the_chains_logprobs_and_gradients(chain, model):
    s = seqs(4, model.config["vocab_size"], seed=11)
    f = chain.forward(s)
    assert f.lengths == [len(q) for q in s]
    flat = np.concatenate([a[1:] for a in chain.logprobs(s)])
    assert f.logp.tobytes() == flat.tobytes()
    assert f.entropy.shape == f.logp.shape and (f.entropy >= 0).all()
    ones = chain.backward(f, np.ones(len(flat)))
    whole = chain.gradients(s)
    assert sorted(ones.names()) == sorted(whole)
    assert all(ones.host(n).tobytes() == whole[n].tobytes() for n in whole)
    # Σ 2·logp: every op is linear in dlogp and a power of two commutes with rounding.
    twice = chain.backward(f, np.full(len(flat), 2.0))
    assert all((2 * ones.host(n)).tobytes() == twice.host(n).tobytes() for n in whole)
    # Two micro-batches' backward calls into one Grads = the whole batch's gradient, bit for bit.
    f1, f2 = chain.forward(s[:2]), chain.forward(s[2:])
    acc = chain.backward(f1, np.ones(len(f1.logp)))
    chain.backward(f2, np.ones(len(f2.logp)), grads=acc)
    assert all(acc.host(n).tobytes() == whole[n].tobytes() for n in whole)
    # A weighted loss: only sequence 1's tokens (others 0) = that sequence's gradient alone.
    w = np.zeros(len(flat))
    start = sum(len(q) - 1 for q in s[:1])
    w[start:start + len(s[1]) - 1] = 1.0
    alone = chain.gradients([s[1]])
    only = chain.backward(f, w)
    assert all(np.allclose(only.host(n), alone[n], rtol=0, atol=1e-6) for n in alone)
    with pytest.raises(samebits.Error, match="dlogp"):
        chain.backward(f, np.ones(len(flat) + 1))
    bad = np.ones(len(flat))
    bad[3] = np.nan
    with pytest.raises(samebits.Error, match="not finite"):
        chain.backward(f, bad)
    with pytest.raises(samebits.Error, match="CPU memory"):
        ones.cuda_array_interface("model.norm.weight")


def six_layer_model():
    """The built-in shape with 6 layers: layers 2k and 2k + 1 are those of the built-in model of seed 100 + k."""
    import json
    weights, config = {}, None
    for k in range(3):
        with tempfile.TemporaryDirectory() as d:
            samebits.Model.builtin(seed=100 + k).save(d)
            with open(os.path.join(d, "config.json")) as f:
                config = json.load(f)
            for name, w in read_safetensors(os.path.join(d, "model.safetensors")).items():
                if name.startswith("model.layers."):
                    l = int(name.split(".")[2])
                    weights[name.replace(f"layers.{l}.", f"layers.{2 * k + l}.", 1)] = w
                elif k == 0:
                    weights[name] = w
    config["num_hidden_layers"] = 6
    tensors = {n: (a.ctypes.data, dt, a.shape, "cpu", a) for n, (a, dt) in weights.items()}
    m = samebits.Model.from_tensors(json.dumps(config), tensors)
    assert m.config["num_layers"] == 6
    return m


def test_a_recomputing_forward_gives_the_kept_forwards_logprobs_and_gradient_bits(model):
    """Chain.forward(recompute=True) keeps each layer's input alone and backward() reruns the layer:
    the same logp / entropy / gradient bits as a forward that keeps everything, on a deeper model too."""
    for m in (model, six_layer_model()):
        chain = samebits.Chain(m, backend="cpu")
        s = seqs(3, m.config["vocab_size"], seed=13)
        kept, rerun = chain.forward(s), chain.forward(s, recompute=True)
        assert kept.logp.tobytes() == rerun.logp.tobytes()
        assert kept.entropy.tobytes() == rerun.entropy.tobytes()
        dlogp = np.random.default_rng(2).uniform(-1, 1, len(kept.logp))
        a, b = chain.backward(kept, dlogp), chain.backward(rerun, dlogp)
        assert sorted(a.names()) == sorted(b.names())
        for n in a.names():
            assert a.host(n).tobytes() == b.host(n).tobytes(), n
        assert any(np.abs(a.host(n)).max() > 0 for n in a.names())
        whole, split = chain.gradients(s), chain.gradients(s, micro_batch=1, recompute=True)
        assert all(split[n].tobytes() == whole[n].tobytes() for n in whole)
    with pytest.raises(samebits.Error, match="recompute"):
        samebits.Chain(model, backend="cpu").forward([[1, 2, 3]], keep=False, recompute=True)


def test_linear_matches_an_fp64_reference_and_is_batch_invariant():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 96)).astype(np.float32)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    y = samebits.linear(x, w, b)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    assert y.dtype == np.float32 and y.shape == (37, 24)
    assert np.abs(y - ref).max() <= 1e-4 * (1 + np.abs(ref).max())
    one = samebits.linear(np.ascontiguousarray(x[7:8]), w, b)
    assert one.tobytes() == y[7:8].tobytes()  # a row's bits do not depend on M


def test_rms_norm_matches_an_fp64_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    y = samebits.rms_norm(x, w, eps=1e-6)
    xd = x.astype(np.float64)
    ref = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + 1e-6) * w
    assert np.abs(y - ref).max() <= 1e-5


def test_token_logprobs_match_an_fp64_reference():
    rng = np.random.default_rng(2)
    logits = (3 * rng.standard_normal((6, 1000))).astype(np.float32)
    targets = rng.integers(0, 1000, 6).astype(np.int32)
    logp, entropy = samebits.token_logprobs(logits, targets)
    ld = logits.astype(np.float64)
    lse = np.log(np.exp(ld - ld.max(-1, keepdims=True)).sum(-1)) + ld.max(-1)
    ref = ld[np.arange(6), targets] - lse
    p = np.exp(ld - lse[:, None])
    assert np.abs(logp - ref).max() <= 1e-5
    assert np.abs(entropy - (-(p * np.log(p)).sum(-1))).max() <= 1e-4
    masked, _ = samebits.token_logprobs(logits, targets, np.array([1, 0, 1, 1, 1, 1], dtype=np.uint8))
    assert masked[1] == 0 and masked[0] == logp[0]


@pytest.mark.parametrize("call, words", [
    (lambda: samebits.linear(np.zeros((4, 8), np.float64), np.zeros((2, 8), np.float32)), "dtype"),
    (lambda: samebits.linear(np.zeros((8, 4), np.float32).T, np.zeros((2, 8), np.float32)), "contiguous"),
    (lambda: samebits.linear(np.zeros((4, 8), np.float32), np.zeros((2, 7), np.float32)), "linear"),
    (lambda: samebits.rms_norm(np.zeros((4, 8), np.float32), np.zeros(9, np.float32)), "rms"),
    (lambda: samebits.token_logprobs(np.zeros((2, 5), np.float32), np.array([0, 5], np.int32)), "target"),
    (lambda: samebits.Chain(samebits.Model.builtin(), "tpu"), "backend"),
    (lambda: samebits.Chain(samebits.Model.builtin(), "cpu").logprobs([]), "empty"),
    (lambda: samebits.Chain(samebits.Model.builtin(), "cpu").logprobs([[1, 2], []]), "empty"),
    (lambda: samebits.Chain(samebits.Model.builtin(), "cpu").logprobs([[1, 10**6]]), "outside"),
    (lambda: samebits.Chain(samebits.Model.builtin(), "cpu").gradients([[1, 2]], micro_batch=0), "micro_batch"),
    (lambda: samebits.Model.load("/nonexistent/samebits-model"), "nonexistent"),
    (lambda: samebits.linear(np.full((2, 4), np.nan, np.float32), np.ones((3, 4), np.float32)), "nan"),
    (lambda: samebits.rms_norm(np.ones((0, 4), np.float32), np.ones(4, np.float32)), "empty"),
])
def test_bad_input_raises_a_clear_error(call, words):
    with pytest.raises(samebits.Error) as e:
        call()
    assert words in str(e.value).lower()
    assert isinstance(e.value, ValueError)


def test_cuda_backend_when_no_gpu_is_a_clear_error():
    if samebits.cuda_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(samebits.Error, match="(?i)cuda"):  # "CUDA backend not built" / "no CUDA device"
        samebits.Chain(samebits.Model.builtin(), "cuda")


def test_the_chain_keeps_its_model_alive():
    c = samebits.Chain(samebits.Model.builtin(tied=True), "cpu")  # the Model has no other reference
    import gc
    gc.collect()
    assert np.isfinite(c.logprobs([[1, 2, 3]])[0][1:]).all()


def test_malformed_model_directory_is_a_clear_error():
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write("{not json")
        with pytest.raises(samebits.Error):
            samebits.Model.load(d)


def desc(a, dtype="fp32", device="cpu"):
    return (a.ctypes.data, dtype, a.shape, device)


def test_raw_ops_on_described_memory_equal_the_array_ops():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 32)).astype(np.float32)
    w = rng.standard_normal((5, 32)).astype(np.float32)
    y = np.empty((9, 5), np.float32)
    samebits._core.raw.linear_forward(desc(x), desc(w), None, desc(y), 0)
    assert y.tobytes() == samebits.linear(x, w).tobytes()
    dy = rng.standard_normal((9, 5)).astype(np.float32)
    dx, dw = np.empty_like(x), np.zeros_like(w)
    samebits._core.raw.linear_backward_input(desc(dy), desc(w), desc(dx), 0)
    samebits._core.raw.linear_backward_weight(desc(dy), desc(x), desc(dw), None, 0)
    assert np.abs(dx - dy.astype(np.float64) @ w).max() <= 1e-4
    assert np.abs(dw - dy.T.astype(np.float64) @ x).max() <= 1e-4
    with pytest.raises(samebits.Error, match="dtype"):
        samebits._core.raw.linear_forward(desc(x, "fp8"), desc(w), None, desc(y), 0)
    with pytest.raises(samebits.Error, match="device"):
        samebits._core.raw.linear_forward(desc(x, device="mps"), desc(w), None, desc(y), 0)
    with pytest.raises(samebits.Error, match="pointer"):
        samebits._core.raw.linear_forward((x.ctypes.data, "fp32"), desc(w), None, desc(y), 0)
    with pytest.raises(samebits.Error, match="null"):
        samebits._core.raw.linear_forward((0, "fp32", x.shape, "cpu"), desc(w), None, desc(y), 0)
    with pytest.raises(samebits.Error, match="negative"):
        samebits._core.raw.linear_forward((x.ctypes.data, "fp32", (9, -32), "cpu"), desc(w), None, desc(y), 0)


def read_safetensors(path):
    """{name: (raw little-endian array, dtype name)} with NumPy only (bf16 as uint16 bits)."""
    import json
    import struct
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        kind = {"BF16": (np.uint16, "bf16"), "F16": (np.float16, "fp16"), "F32": (np.float32, "fp32")}[e["dtype"]]
        out[name] = (np.frombuffer(blob[8 + n + begin:8 + n + end], dtype=kind[0]).reshape(e["shape"]).copy(), kind[1])
    return out


def test_a_model_over_weights_in_memory_gives_the_loaded_models_bits():
    with tempfile.TemporaryDirectory() as d:
        samebits.Model.builtin(tied=True).save(d)
        with open(os.path.join(d, "config.json")) as f:
            config = f.read()
        weights = read_safetensors(os.path.join(d, "model.safetensors"))
        tensors = {n: (a.ctypes.data, dt, a.shape, "cpu", a) for n, (a, dt) in weights.items()}
        in_memory = samebits.Model.from_tensors(config, tensors)
        del tensors, weights  # the model keeps the arrays alive
        s = seqs(4, in_memory.config["vocab_size"], seed=5)
        a = samebits.Chain(in_memory, "cpu")
        b = samebits.Chain(samebits.Model.load(d), "cpu")
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a.logprobs(s), b.logprobs(s)))
        ga, gb = a.gradients(s), b.gradients(s)
        assert all(ga[n].tobytes() == gb[n].tobytes() for n in gb)
        weights = read_safetensors(os.path.join(d, "model.safetensors"))
        bad = {n: (a.ctypes.data, dt, a.shape, "cpu", a) for n, (a, dt) in weights.items()}
        name = "model.norm.weight"
        bad[name] = (weights[name][0].ctypes.data, "bf16", (7,), "cpu", weights[name][0])
        with pytest.raises(samebits.Error, match="shape"):
            samebits.Model.from_tensors(config, bad)
        del bad[name]
        with pytest.raises(samebits.Error, match="missing"):
            samebits.Model.from_tensors(config, bad)
        # Weights described as GPU memory: only a cuda chain reads them; nothing dereferences them here.
        on_gpu = {n: (a.ctypes.data, dt, a.shape, "cuda", a) for n, (a, dt) in weights.items()}
        gpu_model = samebits.Model.from_tensors(config, on_gpu)
        assert gpu_model.device == "cuda" and in_memory.device == "cpu"
        with pytest.raises(samebits.Error, match="GPU memory"):
            samebits.Chain(gpu_model, "cpu")
        with pytest.raises(samebits.Error, match="GPU memory"):
            gpu_model.save(d)
        mixed = dict(on_gpu, **{name: (weights[name][0].ctypes.data, "bf16", weights[name][0].shape, "cpu",
                                       weights[name][0])})
        with pytest.raises(samebits.Error, match="one device"):
            samebits.Model.from_tensors(config, mixed)


def test_raw_attention_embedding_swiglu_against_fp64():
    raw = samebits._core.raw
    rng = np.random.default_rng(6)
    lens, hq, hkv, d = (5, 9), 4, 2, 16
    t = sum(lens)
    q, k, v, dout = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hkv, hkv, hq))
    seqs = np.array([[0, 5, 0, 5], [5, 9, 5, 9]], np.int32)
    out, lse = np.empty_like(q), np.empty((t, hq), np.float32)
    raw.attention_forward(desc(q), desc(k), desc(v), desc(seqs, "int32"), desc(out), desc(lse), stream=0)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    raw.attention_backward(q=desc(q), k=desc(k), v=desc(v), seqs=desc(seqs, "int32"), out=desc(out), lse=desc(lse),
                           dout=desc(dout), dq=desc(dq), dk=desc(dk), dv=desc(dv))
    ro, rdq, rdk, rdv = (np.zeros(a.shape) for a in (q, q, k, v))
    for start, n in ((0, 5), (5, 9)):
        for h in range(hq):
            g = h // (hq // hkv)
            Q, K, V, dO = (a[start:start + n, hh].astype(np.float64) for a, hh in ((q, h), (k, g), (v, g), (dout, h)))
            s = Q @ K.T / np.sqrt(d) + np.triu(np.full((n, n), -np.inf), 1)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            o = p @ V
            ds = p * (dO @ V.T - (dO * o).sum(1, keepdims=True))
            ro[start:start + n, h] = o
            rdq[start:start + n, h] = ds @ K / np.sqrt(d)
            rdk[start:start + n, g] += ds.T @ Q / np.sqrt(d)
            rdv[start:start + n, g] += p.T @ dO
    for got, want in ((out, ro), (dq, rdq), (dk, rdk), (dv, rdv)):
        assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max())

    table = rng.standard_normal((10, 8)).astype(np.float32)
    ids = np.array([3, 0, 3, 9], np.int32)
    y = np.empty((4, 8), np.float32)
    raw.embedding_forward(desc(ids, "int32"), desc(table), desc(y))
    assert y.tobytes() == table[ids].tobytes()
    dy = rng.standard_normal((4, 8)).astype(np.float32)
    dtable = np.zeros_like(table)
    raw.embedding_backward(desc(ids, "int32"), desc(dy), None, desc(dtable))
    want = np.zeros((10, 8))
    np.add.at(want, ids, dy.astype(np.float64))
    assert np.abs(dtable - want).max() <= 1e-6

    gate, up = (rng.standard_normal((3, 7)).astype(np.float32) for _ in range(2))
    y, dg, du = np.empty_like(gate), np.empty_like(gate), np.empty_like(gate)
    raw.swiglu_forward(desc(gate), desc(up), desc(y))
    dy = rng.standard_normal((3, 7)).astype(np.float32)
    raw.swiglu_backward(desc(dy), desc(gate), desc(up), desc(dg), desc(du))
    gd = gate.astype(np.float64)
    sig = 1 / (1 + np.exp(-gd))
    assert np.abs(y - gd * sig * up).max() <= 1e-5
    assert np.abs(du - dy * gd * sig).max() <= 1e-5
    assert np.abs(dg - dy * up * sig * (1 + gd * (1 - sig))).max() <= 1e-5


def test_raw_rope_qk_norm_and_lm_head_against_fp64_and_their_definitions():
    raw = samebits._core.raw
    rng = np.random.default_rng(7)
    t, h, d, theta = 6, 3, 16, 10000.0
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    pos = np.array([0, 1, 2, 7, 300, 4095], np.int32)
    y = np.empty_like(x)
    raw.rope_forward(desc(x), desc(pos, "int32"), desc(y), rope={"theta": theta})
    inv = (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)  # fp32(1 / θ^(2i/D))
    ang = (pos[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)  # fp32 angle, as HF computes it
    cos, sin = np.concatenate([np.cos(ang)] * 2, 1)[:, None], np.concatenate([np.sin(ang)] * 2, 1)[:, None]
    xd = x.astype(np.float64)
    rot = np.concatenate([-xd[..., d // 2:], xd[..., :d // 2]], -1)
    assert np.abs(y - (xd * cos + rot * sin)).max() <= 1e-5
    back = np.empty_like(x)
    raw.rope_backward(desc(y), desc(pos, "int32"), desc(back), rope={"theta": theta})  # the inverse rotation
    assert np.abs(back - x).max() <= 1e-5
    with pytest.raises(samebits.Error, match="not a RoPE setting"):
        raw.rope_forward(desc(x), desc(pos, "int32"), desc(y), rope={"tehta": 1.0})

    # QK-norm fused with RoPE = QK-norm, then RoPE, bit for bit (forward and backward).
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    fused, normed, rope_after = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    rstd = np.empty((t, h), np.float32)
    raw.qk_norm_forward(desc(x), desc(w), desc(fused), desc(rstd), desc(pos, "int32"), eps=1e-6, rope={"theta": theta})
    raw.qk_norm_forward(desc(x), desc(w), desc(normed), None, eps=1e-6)
    raw.rope_forward(desc(normed), desc(pos, "int32"), desc(rope_after), rope={"theta": theta})
    assert fused.tobytes() == rope_after.tobytes()
    ref = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert np.abs(normed - ref).max() <= 1e-5
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx_f, dw_f = np.empty_like(x), np.zeros(d, np.float32)
    raw.qk_norm_backward(desc(dy), desc(x), desc(w), desc(rstd), desc(dx_f), desc(dw_f), desc(pos, "int32"),
                         eps=1e-6, rope={"theta": theta})
    dy_back = np.empty_like(x)
    raw.rope_backward(desc(dy), desc(pos, "int32"), desc(dy_back), rope={"theta": theta})
    dx_u, dw_u = np.empty_like(x), np.zeros(d, np.float32)
    raw.qk_norm_backward(desc(dy_back), desc(x), desc(w), desc(rstd), desc(dx_u), desc(dw_u), None, eps=1e-6)
    assert dx_f.tobytes() == dx_u.tobytes() and dw_f.tobytes() == dw_u.tobytes()

    # The fused LM head → logprob = an fp32 linear, then the selected logprob, bit for bit.
    hidden = rng.standard_normal((5, 32)).astype(np.float32)
    head = (rng.standard_normal((3000, 32)) / 6).astype(np.float32)
    targets = np.array([0, 2999, 17, -100, 1234], np.int32)
    mask = np.ones(5, np.uint8)
    logp, ent, lse = (np.empty(5, np.float32) for _ in range(3))
    raw.lm_head_logprob_forward(desc(hidden), desc(head), desc(targets, "int32"), desc(mask, "uint8"), desc(logp),
                                desc(ent), desc(lse))
    logits = np.empty((5, 3000), np.float32)
    raw.linear_forward(desc(hidden), desc(head), None, desc(logits))
    logp2, ent2 = np.empty(5, np.float32), np.empty(5, np.float32)
    raw.logprob_forward(desc(logits), desc(targets, "int32"), desc(mask, "uint8"), desc(logp2), desc(ent2), None)
    assert logp.tobytes() == logp2.tobytes() and ent.tobytes() == ent2.tobytes()
    assert logp[3] == 0 and ent[3] == 0  # -100: not scored
    z = hidden.astype(np.float64) @ head.astype(np.float64).T
    zl = z - z.max(1, keepdims=True)
    lp = zl - np.log(np.exp(zl).sum(1, keepdims=True))
    assert np.abs(logp[[0, 1, 2, 4]] - lp[[0, 1, 2, 4], targets[[0, 1, 2, 4]]]).max() <= 1e-4
    dh, dw = np.empty_like(hidden), np.zeros_like(head)
    dlogp = np.ones(5, np.float32)
    raw.lm_head_logprob_backward(desc(hidden), desc(head), desc(targets, "int32"), desc(mask, "uint8"), desc(lse),
                                 desc(dlogp), None, desc(dh), desc(dw))
    p = np.exp(lp)
    dz = -p
    for i in (0, 1, 2, 4):
        dz[i, targets[i]] += 1
    dz[3] = 0
    assert np.abs(dh - dz @ head.astype(np.float64)).max() <= 1e-4
    assert np.abs(dw - dz.T @ hidden.astype(np.float64)).max() <= 1e-4


def test_raw_op_argument_errors():
    raw = samebits._core.raw
    x = np.ones((2, 4), np.float32)
    with pytest.raises(samebits.Error, match="not an argument"):
        raw.linear_forward(desc(x), desc(x), None, desc(x), bogus=1)
    with pytest.raises(samebits.Error, match="twice"):
        raw.linear_forward(desc(x), desc(x), None, desc(x), x=desc(x))
    with pytest.raises(samebits.Error, match="positional"):
        raw.linear_forward(desc(x), desc(x), None, desc(x), 0, 0)
