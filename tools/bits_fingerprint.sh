#!/usr/bin/env bash
# Fingerprints of samebits' outputs on the GPU: sha256 of the logprobs (and entropies) and of the
# weight gradients that fixed models give for fixed token sequences. Run it on two cards (an H100
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
