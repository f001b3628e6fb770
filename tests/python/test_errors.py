"""Every failure through the Python door is a Python exception with the library's message, never a
crash of the interpreter: samebits.Error for what the library refuses (naming the thing at fault),
MemoryError for exhausted host memory, RuntimeError (asking for a report) for a bug."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import samebits


@pytest.mark.parametrize("kind,exc,words", [
    ("error", samebits.Error, "a samebits::Error"),
    ("filesystem", samebits.Error, "file system error"),
    ("bad_alloc", MemoryError, "out of host memory"),
    ("out_of_range", RuntimeError, "internal error"),
    ("runtime", RuntimeError, "please report it"),
])
def test_one_handler_maps_every_exception_class(kind, exc, words):
    with pytest.raises(exc, match=words):
        samebits._core._raise_for_test(kind)


def test_deeply_nested_config_is_an_error_not_a_dead_interpreter():
    # A child interpreter: on today's main the parent would die with SIGSEGV.
    with tempfile.TemporaryDirectory() as d:
        samebits.Model.builtin().save(d)
        text = open(os.path.join(d, "config.json")).read()
        text = text.replace('"hidden_act": "silu"', '"hidden_act": ' + "[" * 100000 + "]" * 100000)
        open(os.path.join(d, "config.json"), "w").write(text)
        code = ("import samebits\ntry:\n    samebits.Model.load(%r)\nexcept samebits.Error as e:\n"
                "    print('refused:', e)\n" % d)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
        assert "nests deeper than 64 levels" in p.stdout


def test_loss_mask_must_be_zeros_and_ones():
    logits = np.zeros((3, 8), np.float32)
    targets = np.array([1, 2, 3], np.int32)
    samebits.token_logprobs(logits, targets, np.array([1, 0, 1], np.uint8))
    with pytest.raises(samebits.Error, match="loss_mask.*value 7 at index 1 is not 0 or 1"):
        samebits.token_logprobs(logits, targets, np.array([1, 7, 1], np.uint8))


def test_grads_host_of_an_unknown_name_is_a_samebits_error():
    chain = samebits.Chain(samebits.Model.builtin(), "cpu")
    g = chain.backward(chain.forward([[1, 2, 3]]), np.ones(2))
    with pytest.raises(samebits.Error, match="no such weight gradient"):
        g.host("unknown")


def test_model_save_to_a_bad_path_is_a_samebits_error():
    with tempfile.NamedTemporaryFile() as f:
        with pytest.raises(samebits.Error, match="cannot create the directory"):
            samebits.Model.builtin().save(os.path.join(f.name, "sub"))


def test_backward_refuses_a_forward_of_another_model():
    a, b = samebits.Model.builtin(seed=1), samebits.Model.builtin(seed=2)  # same shape
    ca, cb = samebits.Chain(a, "cpu"), samebits.Chain(b, "cpu")
    f = ca.forward([[1, 2, 3, 4]])
    with pytest.raises(samebits.Error, match="another model"):
        cb.backward(f, np.ones(3))
    ca.backward(f, np.ones(3))  # its own chain takes it


def test_sequences_past_max_position_are_refused_up_front():
    with tempfile.TemporaryDirectory() as d:
        samebits.Model.builtin().save(d)
        c = json.load(open(os.path.join(d, "config.json")))
        c["max_position_embeddings"] = 8
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
        chain = samebits.Chain(samebits.Model.load(d), "cpu")
        with pytest.raises(samebits.Error, match="sequence 1 has 9 tokens, more than the model's max_position_embeddings"):
            chain.logprobs([[1, 2], list(range(9))])
