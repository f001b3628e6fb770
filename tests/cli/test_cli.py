"""The `samebits` command as a user (or a hostile input) meets it: every failure class ends with a
message naming the problem and a non-zero exit code, never a signal, never exit 0 with the output
lost. SAMEBITS_CLI names the binary (CTest sets it)."""
import json
import os
import resource
import shutil
import signal
import subprocess

import pytest

CLI = os.environ.get("SAMEBITS_CLI", "build/samebits")


def run(*args, input=None, env=None, preexec_fn=None, timeout=300):
    e = dict(os.environ)
    e.pop("OMP_WAIT_POLICY", None)
    e.update(env or {})
    p = subprocess.run([CLI, *map(str, args)], input=input, capture_output=True, text=True, env=e,
                       preexec_fn=preexec_fn, timeout=timeout)
    assert p.returncode >= 0, f"killed by {signal.Signals(-p.returncode).name}: {p.stderr[-2000:]}"
    return p


def fails(p, code, *words):
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    for w in words:
        assert w in p.stderr, (w, p.stderr[-2000:])
    assert len(p.stderr) < 2000, "an error message must quote a bounded part of a bad value"


def nested(depth):
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    assert run("export-model", d).returncode == 0
    return d


def edited_model(tmp_path, model_dir, edit):
    d = tmp_path / "edited"
    shutil.copytree(model_dir, d)
    c = json.loads((d / "config.json").read_text())
    text = edit(c)
    (d / "config.json").write_text(text if isinstance(text, str) else json.dumps(c))
    return d


SEQS = '{"tokens": [1, 2, 3, 4]}\n{"tokens": [7, 8, 9], "loss_mask": [1, 1, 0]}\n'


# ---------------------------------------------------------------- crashes
def test_deep_nesting_in_an_input_line_is_an_error_not_a_signal():
    line = '{"tokens": ' + nested(100000) + "}\n"
    fails(run("logprobs", "--input", "-", input=line), 2, "line 1", "nests deeper than 64 levels")


def test_deep_nesting_in_config_json_is_an_error_not_a_signal(tmp_path, model_dir):
    def edit(c):
        return json.dumps(c).replace('"hidden_act": "silu"', '"hidden_act": ' + nested(100000))
    d = edited_model(tmp_path, model_dir, edit)
    fails(run("logprobs", "--model", d, "--input", "-", input=SEQS), 2, "config.json", "nests deeper than 64 levels")


def test_a_huge_bad_value_is_quoted_in_part(tmp_path, model_dir):
    d = edited_model(tmp_path, model_dir, lambda c: c.update(num_hidden_layers="x" * 20000))
    fails(run("inspect", "--model", d), 2, "num_hidden_layers", "must be an integer", "a string of 20000 bytes")


def test_file_system_failures_are_errors_not_aborts(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    fails(run("export-model", f / "sub"), 2, "cannot create the directory")
    fails(run("verify", "--op", "linear", "-q", "--status-dir", f / "status"), 2, "cannot create the directory")


def test_out_of_host_memory_is_named_not_an_abort(tmp_path):
    def limit():  # 1.5 GB of address space: the qwen3-8b-shaped model needs 2.9 GB of weights
        resource.setrlimit(resource.RLIMIT_AS, (1500 << 20, 1500 << 20))
    p = run("export-model", "--shape", "qwen3-8b", tmp_path / "big", preexec_fn=limit)
    fails(p, 3, "out of memory while generating a qwen3-8b-shaped model")


# ---------------------------------------------------------------- output lost
@pytest.mark.parametrize("where", ["missing_dir", "dev_full", "a_directory"])
def test_logprobs_output_that_cannot_be_written_fails(tmp_path, where):
    out = {"missing_dir": tmp_path / "no" / "out.jsonl", "dev_full": "/dev/full", "a_directory": tmp_path}[where]
    if where == "dev_full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    p = run("logprobs", "--input", "-", "--output", out, input=SEQS)
    fails(p, 2, str(out))
    assert any(w in p.stderr for w in ("does not exist", "No space left", "is a directory"))


def test_logprobs_to_a_full_standard_output_fails():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "w") as full:
        p = subprocess.run([CLI, "logprobs", "--input", "-"], input=SEQS, stdout=full, stderr=subprocess.PIPE, text=True)
    assert p.returncode == 2 and "standard output" in p.stderr, p.stderr


def test_input_that_is_a_directory_fails(tmp_path):
    fails(run("logprobs", "--input", tmp_path), 2, "is a directory")
    fails(run("grads", "--input", tmp_path, "--output", tmp_path / "g.safetensors"), 2, "is a directory")


def test_verify_status_dir_is_written_or_fails(tmp_path):
    p = run("verify", "--backend", "cpu", "--op", "rope", "--no-chain", "-q", "--status-dir", tmp_path / "s")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "s" / "cpu.md").stat().st_size > 0 and (tmp_path / "s" / "cpu.json").stat().st_size > 0


def test_grads_output_is_checked_before_the_work(tmp_path):
    fails(run("grads", "--input", "-", "--output", tmp_path / "no" / "g.safetensors", input=SEQS), 2, "does not exist")


# ---------------------------------------------------------------- checked up front, named
def test_a_sequence_past_max_position_is_refused_naming_the_line(tmp_path, model_dir):
    d = edited_model(tmp_path, model_dir, lambda c: c.update(max_position_embeddings=16))
    lines = SEQS + '{"tokens": [' + ", ".join(["5"] * 40) + "]}\n"
    fails(run("logprobs", "--model", d, "--input", "-", input=lines), 2, "line 3", "40 tokens",
          "max_position_embeddings (16)")


def test_a_nan_weight_is_named(tmp_path, model_dir):
    d = tmp_path / "nan"
    shutil.copytree(model_dir, d)
    raw = bytearray((d / "model.safetensors").read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    begin = header["model.norm.weight"]["data_offsets"][0]
    raw[8 + n + begin + 6:8 + n + begin + 8] = (0x7fc0).to_bytes(2, "little")  # bf16 NaN at index 3
    (d / "model.safetensors").write_bytes(bytes(raw))
    fails(run("logprobs", "--model", d, "--input", "-", input=SEQS), 2, "'model.norm.weight'", "non-finite",
          "flat index 3")


def test_config_sizes_must_be_integers(tmp_path, model_dir):
    d = edited_model(tmp_path, model_dir, lambda c: c.update(hidden_size=64.9))
    fails(run("inspect", "--model", d), 2, "hidden_size", "must be an integer, got 64.9")


def test_model_type_must_agree_with_architectures(tmp_path, model_dir):
    d = edited_model(tmp_path, model_dir, lambda c: c.update(model_type="mistral"))
    fails(run("inspect", "--model", d), 2, "'mistral' disagrees with architectures")


def test_grads_and_activations_refuse_empty_input_alike(tmp_path):
    for cmd in ("grads", "activations"):
        out = tmp_path / f"{cmd}.safetensors"
        fails(run(cmd, "--input", "-", "--output", out, input="\n\n"), 2, "holds no sequences")
        assert not out.exists()


def test_export_layers_without_shape_is_refused(tmp_path):
    fails(run("export-model", tmp_path / "m", "--layers", "3"), 2, "--layers applies to --shape qwen3-8b only")


def test_inspect_counts_the_builtin_models_parameters():
    p = run("inspect")
    assert p.returncode == 0, p.stderr
    assert "0.000 G" not in p.stdout and "488000 (488.0 K) parameters" in p.stdout, p.stdout


def test_grads_and_activations_default_to_the_builtin_model(tmp_path):
    for cmd in ("grads", "activations"):
        p = run(cmd, "--input", "-", "--output", tmp_path / f"{cmd}.safetensors", input=SEQS)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / f"{cmd}.safetensors").stat().st_size > 0


def test_grads_with_recompute_or_kept_logits_write_the_same_bits(tmp_path):
    # --lm-head-keep-mb: the LM head's logits kept for the backward (on a GPU: three vocab GEMMs)
    extras = ([], ["--recompute"], ["--recompute", "--micro-batch", "1"], ["--lm-head-keep-mb", "1"],
              ["--lm-head-keep-mb", "1", "--recompute", "--micro-batch", "1"])
    for i, extra in enumerate(extras):
        p = run("grads", "--input", "-", "--output", tmp_path / f"g{i}.safetensors", *extra, input=SEQS)
        assert p.returncode == 0, p.stderr
    want = (tmp_path / "g0.safetensors").read_bytes()
    for i, extra in enumerate(extras[1:], 1):
        assert (tmp_path / f"g{i}.safetensors").read_bytes() == want, extra
    bad = run("grads", "--input", "-", "--output", tmp_path / "x.safetensors", "--lm-head-keep-mb", "-1", input=SEQS)
    assert bad.returncode != 0 and "lm-head-keep-mb" in bad.stderr, bad.stderr


# ---------------------------------------------------------------- CLI behaviour
def test_progress_only_when_asked_off_a_terminal():
    quiet = run("logprobs", "--input", "-", input=SEQS)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = run("logprobs", "--input", "-", "--progress", input=SEQS)
    assert loud.returncode == 0 and "2/2 sequences, 7/7 tokens" in loud.stderr and "tokens/s" in loud.stderr, loud.stderr
    assert loud.stdout == quiet.stdout
    g = run("grads", "--input", "-", "--output", "/dev/null", "--progress", input=SEQS)
    assert "grads: 2/2 sequences" in g.stderr, g.stderr
    fails(run("logprobs", "--input", "-", "-q", "--progress", input=SEQS), 2, "excludes")


def test_openmp_threads_do_not_spin_unless_the_user_says_so():
    assert "OMP_WAIT_POLICY=passive" in run("version").stdout
    assert "OMP_WAIT_POLICY=active" in run("version", env={"OMP_WAIT_POLICY": "active"}).stdout


def test_argument_errors_are_readable():
    p = run("grads", "--micro-batch", "0", "--input", "-", "--output", "x")
    fails(p, 2, "--micro-batch: must be at least 1, got 0")
    assert "1797693" not in p.stderr
    fails(run("frobnicate"), 2, "unknown command 'frobnicate'", "commands: verify, logprobs")
    fails(run(), 2, "a command is required")
    fails(run("logprobs", "--input", "-", "--backend", "tpu"), 2, "--backend")


def test_bad_lines_still_name_the_line():
    fails(run("logprobs", "--input", "-", input=SEQS + '{"tokens": [1, 99999]}\n'), 2, "line 3",
          "token id 99999 is outside the vocab [0, 2560)")
    fails(run("logprobs", "--input", "-", input='{"tokens": [1, 2], "loss_mask": [1, 7]}\n'), 2,
          "loss_mask entries must be 0 or 1, got 7")


# ---------------------------------------------------------------- generate
def test_generate_reports_the_trainers_logprobs_and_fails_bad_prompts_alone():
    lines = ('{"tokens": [1, 2, 3], "n": 2, "seed": 5}\n{"tokens": []}\n'
             '{"tokens": [7, 8, 9, 10], "temperature": 0, "max_new_tokens": 4}\n{"tokens": [1], "top_p": 2}\nnot json\n')
    p = run("generate", "--input", "-", "--max-new-tokens", "5", input=lines)
    assert p.returncode == 2 and "3 of 5 prompts failed" in p.stderr, p.stderr
    out = [json.loads(l) for l in p.stdout.splitlines()]
    assert [(o["prompt"], o.get("sample")) for o in out] == [(0, 0), (0, 1), (1, None), (2, 0), (3, None), (4, None)]
    assert "is empty" in out[2]["error"] and "top_p" in out[4]["error"] and "not valid JSON" in out[5]["error"]
    good = [o for o in out if "tokens" in o]
    prompts = {0: [1, 2, 3], 2: [7, 8, 9, 10]}
    rescore = "".join(json.dumps({"tokens": prompts[o["prompt"]] + o["tokens"]}) + "\n" for o in good)
    scored = [json.loads(l)["logprobs"] for l in run("logprobs", "--input", "-", input=rescore).stdout.splitlines()]
    for o, s in zip(good, scored):
        assert o["logprobs"] == s[len(prompts[o["prompt"]]):], (o, s)
    assert len(good[2]["tokens"]) == 4 and good[0]["finish_reason"] == "length"


def test_generate_with_or_without_cuda_graphs_gives_the_same_lines():
    lines = '{"tokens": [1, 2, 3], "n": 3, "seed": 5}\n{"tokens": [7, 8, 9, 10], "temperature": 0.7}\n'
    with_graphs = run("generate", "--input", "-", "--max-new-tokens", "6", input=lines)
    without = run("generate", "--input", "-", "--max-new-tokens", "6", "--no-cuda-graphs", input=lines)
    assert with_graphs.returncode == 0 and without.returncode == 0, (with_graphs.stderr, without.stderr)
    assert with_graphs.stdout == without.stdout and len(with_graphs.stdout.splitlines()) == 4


def test_generate_writes_sampling_logprobs_when_asked():
    lines = '{"tokens": [1, 2, 3], "n": 2, "seed": 5, "top_k": 20}\n{"tokens": [4, 5], "temperature": 0}\n'
    plain = run("generate", "--input", "-", "--max-new-tokens", "4", input=lines)
    asked = run("generate", "--input", "-", "--max-new-tokens", "4", "--sampling-logprobs", input=lines)
    assert plain.returncode == 0 and asked.returncode == 0, (plain.stderr, asked.stderr)
    p_lines = [json.loads(l) for l in plain.stdout.splitlines()]
    a_lines = [json.loads(l) for l in asked.stdout.splitlines()]
    assert all("sampling_logprobs" not in o for o in p_lines)
    for p, a in zip(p_lines, a_lines):
        s = a.pop("sampling_logprobs")
        assert a == p and len(s) == len(p["tokens"]) and all(x <= 0 for x in s)
    greedy = json.loads(asked.stdout.splitlines()[2])
    assert greedy["tokens"] and greedy["sampling_logprobs"] == [0.0] * len(greedy["tokens"])
    assert any(x < 0 for x in json.loads(asked.stdout.splitlines()[0])["sampling_logprobs"])


def test_generate_progress_and_output_file(tmp_path):
    out = tmp_path / "g.jsonl"
    p = run("generate", "--input", "-", "--output", out, "--progress", input='{"tokens": [1, 2]}\n')
    assert p.returncode == 0 and "tokens/s" in p.stderr, p.stderr
    assert json.loads(out.read_text())["finish_reason"] == "length"
    fails(run("generate", "--input", "-", "--output", tmp_path / "no" / "g.jsonl", input='{"tokens": [1]}\n'), 2,
          "does not exist")
