"""The generation engine through Python: completions whose logprobs are the trainer's (Chain.logprobs
of prompt + completion) bit for bit, the same bits whatever else is generated, NumPy's view of the
truncation sets, and bad prompts failing alone."""
import numpy as np
import pytest

import samebits


def prompts(n, seed=1, vocab=2560):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_generated_logprobs_are_the_chains_bit_for_bit(model, chain):
    engine = samebits.Engine(model, "cpu")
    ps = prompts(6)
    out = engine.generate(ps, samebits.SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=3))
    assert [len(o) for o in out] == [2] * 6
    full = [p + c.tokens for p, cs in zip(ps, out) for c in cs]
    scored = chain.logprobs(full)
    k = 0
    for p, cs in zip(ps, out):
        for c in cs:
            assert c.finish_reason == "length" and len(c.tokens) == 8
            want = scored[k][len(p):]
            assert np.array_equal(c.logprobs.view(np.uint64), want.view(np.uint64)), (c.logprobs, want)
            k += 1


def test_a_prompts_bits_do_not_depend_on_the_others(model):
    target = prompts(1, seed=7)[0]
    params = samebits.SamplingParams(n=3, temperature=0.8, top_k=50, max_new_tokens=10, seed=11)
    alone = samebits.Engine(model, "cpu").generate([target], params)[0]
    crowd = prompts(20, seed=8) + [target] + prompts(5, seed=9)
    among = samebits.Engine(model, "cpu", max_batch_tokens=7).generate(crowd, params)[20]
    for a, b in zip(alone, among):
        assert a.tokens == b.tokens
        assert np.array_equal(a.logprobs.view(np.uint64), b.logprobs.view(np.uint64))
        assert np.array_equal(a.sampling_logprobs.view(np.uint64), b.sampling_logprobs.view(np.uint64))


def test_sampling_logprobs_are_the_drawn_distributions(model):
    """Each token's sampling logprob: log p under the distribution it was drawn from. At temperature
    1 with no cut that is the model's own softmax, so it equals the trainer's logprob to fp32
    rounding; a cut renormalises over fewer tokens, so it can only be higher; greedy's are 0.
    (tests/cpu/test_engine.cpp checks it against the fp64 truncated distribution.)"""
    ps = prompts(3, seed=31)
    plain = samebits.Engine(model, "cpu").generate(ps, samebits.SamplingParams(n=2, max_new_tokens=5, seed=13))
    cut = samebits.Engine(model, "cpu").generate(ps, samebits.SamplingParams(n=2, top_k=20, max_new_tokens=5, seed=13))
    gaps = []
    for cs_plain, cs_cut in zip(plain, cut):
        for a, b in zip(cs_plain, cs_cut):
            assert len(a.sampling_logprobs) == len(a.tokens) == 5
            assert np.allclose(a.sampling_logprobs, a.logprobs, rtol=0, atol=1e-4), (a.sampling_logprobs, a.logprobs)
            assert (b.sampling_logprobs >= b.logprobs - 1e-5).all() and (b.sampling_logprobs <= 0).all()
            gaps.extend(b.sampling_logprobs - b.logprobs)
    assert max(gaps) > 1e-3, "top-k 20 of 2560 ids never moved a token's probability: the test checks nothing"
    greedy = samebits.Engine(model, "cpu").generate(ps, samebits.SamplingParams(temperature=0, max_new_tokens=3))
    assert all((c.sampling_logprobs == 0).all() and len(c.sampling_logprobs) == 3 for cs in greedy for c in cs)


def rule_mass(w, ids):
    """The rule's mass of w over ids: lane l sums ids l, l + 1024, ... in turn (fp32), the 1024 lane
    sums meet in a pairwise tree."""
    lanes = np.zeros(1024, dtype=np.float32)
    for i in sorted(ids):
        lanes[i % 1024] = np.float32(lanes[i % 1024] + w[i])
    while len(lanes) > 1:
        lanes = (lanes[0::2] + lanes[1::2]).astype(np.float32)
    return lanes[0]


def reference_candidates(logits, temperature, top_k, top_p, min_p):
    """NumPy's reading of samebits/sampling.hpp (fp32 weights; NumPy's exp in place of the rule's
    polynomial, which differs in the last bit: a cut exactly at such a bit would show here)."""
    z = logits.astype(np.float32)
    order = [int(i) for i in np.lexsort((np.arange(len(z)), -z.astype(np.float64)))]  # logit descending, id ascending
    if top_k > 0:
        order = order[:top_k]
    inv_t = np.float32(1.0 / temperature)
    w = np.exp(((z - z[order[0]]) * inv_t).astype(np.float64)).astype(np.float32)
    if top_p < 1:
        goal = np.float32(top_p * float(rule_mass(w, order)))
        keep = 0
        while keep < len(order):
            first = keep
            while keep < len(order) and z[order[keep]] == z[order[first]]:  # a group of equal logits goes together
                keep += 1
            if rule_mass(w, order[:keep]) >= goal:
                break
        order = order[:keep]
    if min_p > 0:
        order = [i for i in order if float(w[i]) >= min_p]
    return sorted(order)


def test_truncation_sets_match_numpy():
    rng = np.random.default_rng(5)
    for _ in range(200):
        v = int(rng.integers(1, 300))
        logits = (rng.standard_normal(v) * 3).astype(np.float32).astype(np.float64)
        if v > 4:
            logits[3] = logits[1]  # a tie
        t = float(rng.uniform(0.3, 2.0))
        k = int(rng.integers(1, v + 1)) if rng.random() < 0.5 else 0
        p = float(rng.uniform(0.05, 1.0)) if rng.random() < 0.5 else 1.0
        mp = float(rng.uniform(0.0, 0.5)) if rng.random() < 0.5 else 0.0
        params = samebits.SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp)
        got = samebits._core.sampling_candidates(logits.tolist(), params)
        assert got == reference_candidates(logits, t, k, p, mp)
        assert samebits._core.sample_token(logits.tolist(), params, 0, 5) in got


def test_bad_prompts_fail_alone(model):
    engine = samebits.Engine(model, "cpu", max_context=64)
    out = engine.generate([[1, 2], [], [1, 99999], [3, 4]],
                          [samebits.SamplingParams(max_new_tokens=4)] * 3 + [samebits.SamplingParams(max_new_tokens=100)])
    assert out[0][0].finish_reason == "length"
    assert out[1][0].finish_reason == "error" and "is empty" in out[1][0].error
    assert "outside the vocab" in out[2][0].error
    assert "more than a slot holds (64" in out[3][0].error
    with pytest.raises(samebits.Error, match="one per prompt"):
        engine.generate([[1], [2]], [samebits.SamplingParams()])


def test_preemption_under_a_small_kv_pool_changes_no_bit(model):
    target = prompts(1, seed=7)[0]
    params = samebits.SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4)
    alone = samebits.Engine(model, "cpu").generate([target], params)[0]
    tight = samebits.Engine(model, "cpu", page_size=8, kv_pages=16, max_batch_tokens=16)
    crowd = prompts(8, seed=12) + [target] + prompts(8, seed=13)
    out = tight.generate(crowd, params)
    assert tight.preemptions > 0
    for a, b in zip(alone, out[8]):
        assert a.tokens == b.tokens and np.array_equal(a.logprobs.view(np.uint64), b.logprobs.view(np.uint64))


def same(a, b):
    """Two completions, bit for bit: tokens, logprobs (raw bytes), why they ended."""
    return (a.tokens == b.tokens and a.logprobs.tobytes() == b.logprobs.tobytes()
            and a.sampling_logprobs.tobytes() == b.sampling_logprobs.tobytes()
            and a.finish_reason == b.finish_reason and a.error == b.error)


def test_submit_step_run_gives_generates_completions_bit_for_bit(model):
    ps = prompts(5, seed=21)
    params = [samebits.SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6 + i, seed=5) for i in range(5)]
    want = samebits.Engine(model, "cpu", max_batch_tokens=16).generate(ps, params)
    engine = samebits.Engine(model, "cpu", max_batch_tokens=16)
    assert (engine.steps, engine.generated) == (0, 0)
    assert [engine.submit(p, q) for p, q in zip(ps, params)] == list(range(5))
    steps = 0
    while engine.step():
        steps += 1
    assert not engine.step() and engine.steps == steps > 0
    got = engine.run()
    assert [(c.request, c.sample) for c in got] == [(i, j) for i in range(5) for j in range(2)]
    for c in got:
        assert same(c, want[c.request][c.sample])
    assert engine.generated == sum(len(c.tokens) for c in got) == sum(2 * (6 + i) for i in range(5))
    assert engine.run() == []  # each completion is returned once


def test_run_steps_to_the_end_and_requests_arrive_while_others_decode(model):
    ps = prompts(4, seed=22)
    params = samebits.SamplingParams(n=3, temperature=0.7, top_k=40, max_new_tokens=9, seed=8)
    want = samebits.Engine(model, "cpu").generate(ps, params)
    engine = samebits.Engine(model, "cpu")
    engine.submit(ps[0], params)
    for _ in range(4):  # the first request decodes when the others arrive
        assert engine.step()
    for p in ps[1:]:
        engine.submit(p, params)
    got = engine.run()
    assert len(got) == 12 and all(same(c, want[c.request][c.sample]) for c in got)
    assert engine.steps > 9


def test_a_bad_submit_is_an_error_completion_and_generate_keeps_the_others(model):
    engine = samebits.Engine(model, "cpu", max_context=64)
    good = engine.submit([1, 2, 3], samebits.SamplingParams(max_new_tokens=4))
    bad = engine.submit([5, 2**40], samebits.SamplingParams(max_new_tokens=4))
    assert (good, bad) == (0, 1)
    # generate runs every queued request to the end; the submitted ones' completions wait for run()
    out = engine.generate([[7, 8]], samebits.SamplingParams(n=2, max_new_tokens=3))
    assert [(c.request, c.sample, len(c.tokens)) for c in out[0]] == [(2, 0, 3), (2, 1, 3)]
    got = engine.run()
    assert [(c.request, c.finish_reason) for c in got] == [(0, "length"), (1, "error")]
    assert "request 1" in got[1].error and "outside the vocab" in got[1].error and got[1].tokens == []
    assert engine.run() == [] and "request=0" in repr(got[0])


def test_cuda_graphs_on_or_off_give_the_same_bits(model):
    """On a GPU the decode steps replay CUDA graphs by default (one per batch-size bucket); off, every
    step runs eagerly: the same tokens and logprobs. On the CPU the option is accepted and unused."""
    backend = "cuda" if samebits.cuda_available() else "cpu"
    ps = prompts(11, seed=21)
    params = samebits.SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=9, seed=4)
    runs = {}
    for graphs in (True, False):
        engine = samebits.Engine(model, backend, page_size=16, cuda_graphs=graphs)
        runs[graphs] = engine.generate(ps, params)
        assert engine.graphs_off_reason == "", engine.graphs_off_reason  # a failed capture: eager from then on
        if not graphs or backend == "cpu":
            assert engine.graph_steps == 0 and engine.captured_graphs == 0
    for a, b in zip(sum(runs[True], []), sum(runs[False], [])):
        assert a.tokens == b.tokens
        assert np.array_equal(a.logprobs.view(np.uint64), b.logprobs.view(np.uint64))


def test_overlapped_steps_on_or_off_give_the_same_bits(model):
    """overlap_steps (the default) launches a step before the previous one's draws are applied:
    the same tokens and logprobs as steps that wait for their draws, and step() still runs all."""
    backend = "cuda" if samebits.cuda_available() else "cpu"
    ps = prompts(9, seed=23)
    params = samebits.SamplingParams(n=3, temperature=1.0, max_new_tokens=11, seed=8, stop_token_ids=list(range(0, 2560, 29)))
    runs = {}
    for overlap in (True, False):
        engine = samebits.Engine(model, backend, page_size=16, overlap_steps=overlap)
        runs[overlap] = engine.generate(ps, params)
        assert (engine.overlapped_steps > 0) == overlap
    for a, b in zip(sum(runs[True], []), sum(runs[False], [])):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert np.array_equal(a.logprobs.view(np.uint64), b.logprobs.view(np.uint64))


def test_a_forward_without_kept_activations_scores_the_same_bits(model, chain):
    """Chain.forward(keep=False) (Chain::score): the kept forward's logp / entropy bits; no backward."""
    seqs = prompts(4, seed=41)
    kept, scored = chain.forward(seqs), chain.forward(seqs, keep=False)
    assert np.array_equal(kept.logp.view(np.uint64), scored.logp.view(np.uint64))
    assert np.array_equal(kept.entropy.view(np.uint64), scored.entropy.view(np.uint64))
    with pytest.raises(samebits.Error, match="kept no activations"):
        chain.backward(scored, np.ones(len(scored.logp)))
