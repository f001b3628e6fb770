#!/usr/bin/env bash
# Fingerprints of samebits' outputs on the GPU: sha256 of the logprobs (and entropies), of the
# weight gradients and of the engine's rollouts that fixed models give for fixed token sequences. Run it on two cards (an H100
# and an H200) and compare the lines: the same lines mean the same bits.
#
#   tools/bits_fingerprint.sh BUILD/samebits [WORKDIR]
set -euo pipefail
bin=$1
work=${2:-/tmp/samebits_fingerprint}
mkdir -p "$work"
"$bin" export-model "$work/builtin" > /dev/null 2>&1
"$bin" export-model "$work/builtin-tied" --tied > /dev/null 2>&1
"$bin" export-model "$work/qwen3-8b-1layer" --shape qwen3-8b --layers 1 > /dev/null 2>&1
# Sequences of 1 ... 300 tokens from a fixed generator (an LCG), for each vocab.
seqs() {
  python3 - "$1" <<'PY'
import json, sys
vocab, x = int(sys.argv[1]), 12345
for n in (1, 2, 7, 64, 100, 129, 300, 33):
    toks = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        toks.append((x >> 33) % vocab)
    print(json.dumps({"tokens": toks}))
PY
}
seqs 2560 > "$work/small.jsonl"
seqs 151936 > "$work/large.jsonl"
for m in builtin builtin-tied qwen3-8b-1layer; do
  input="$work/small.jsonl"
  [ "$m" = qwen3-8b-1layer ] && input="$work/large.jsonl"
  lp=$("$bin" logprobs --model "$work/$m" --input "$input" --entropy --backend cuda | sha256sum | cut -c1-16)
  "$bin" grads --model "$work/$m" --input "$input" --output "$work/$m.grads.safetensors" --backend cuda 2> /dev/null
  gr=$(sha256sum "$work/$m.grads.safetensors" | cut -c1-16)
  rm -f "$work/$m.grads.safetensors"
  echo "$m logprobs+entropy $lp gradients $gr"
done
# Rollouts: the engine's tokens and logprobs (sampling on the GPU: greedy, temperature, top-k,
# top-p, min-p, two samples sharing a prompt) for the first prompts of each input.
with_settings() {
  python3 - "$1" <<'PY'
import json, sys
settings = [{"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 7}, {"temperature": 0.8, "top_k": 40, "seed": 1},
            {"temperature": 1.2, "top_p": 0.9, "seed": 2}, {"temperature": 1.0, "min_p": 0.05, "seed": 3}]
for line, s in zip(open(sys.argv[1]), settings):
    row = json.loads(line)
    row["tokens"] = row["tokens"][:40]
    row.update(s, max_new_tokens=12)
    print(json.dumps(row))
PY
}
with_settings "$work/small.jsonl" > "$work/small-prompts.jsonl"
with_settings "$work/large.jsonl" > "$work/large-prompts.jsonl"
for m in builtin builtin-tied qwen3-8b-1layer; do
  input="$work/small-prompts.jsonl"
  [ "$m" = qwen3-8b-1layer ] && input="$work/large-prompts.jsonl"
  ro=$("$bin" generate --model "$work/$m" --input "$input" --backend cuda -q | sha256sum | cut -c1-16)
  echo "$m rollouts $ro"
done
