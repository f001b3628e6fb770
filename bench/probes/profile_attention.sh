#!/usr/bin/env bash
# Nsight Compute profile of one samebits attention forward launch and of torch's default SDPA kernel
# on the same shape (bench/probes/attention_once.py), on the GPU machine: the summary sections of each,
# then samebits' warp stalls by source line (the top lines).
# Usage: bench/probes/profile_attention.sh BUILD_DIR OUT_DIR prefill|decode A B [attention_once options]
#   e.g. bench/probes/profile_attention.sh build-gpu "$OUT" prefill 1024 16
#        bench/probes/profile_attention.sh build-gpu "$OUT" decode 1 16384
set -uo pipefail
build=$1 out=$2 kind=$3 a=$4 b=$5
shift 5
tag="attention-$kind-$a-$b"
run=(python3 bench/probes/attention_once.py "$build" "$kind" "$a" "$b" --calls 3 "$@")
export PYTHONPATH=$build/python
# The 3rd call of ours and of torch's (two warm each; torch's by cuDNN's / flash's kernel names).
ncu --set full --import-source yes --launch-skip 2 --launch-count 1 -k regex:'attention_forward_sm90' \
  -o "$out/ncu-$tag-ours" -f "${run[@]}" > "$out/ncu-$tag-ours.log" 2>&1
ncu --set full --launch-skip 2 --launch-count 1 -k regex:'cudnn|flash|fmha|sdpa' \
  -o "$out/ncu-$tag-torch" -f "${run[@]}" > "$out/ncu-$tag-torch.log" 2>&1
for f in ours torch; do
  echo "== $f ($tag)"
  ncu --import "$out/ncu-$tag-$f.ncu-rep" --page details --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis 2>&1 |
    grep -vE "^\s*$|----|OPT|Section:|^\s+(Metric Name|This |are |the |of |a |on |is |to |with |cycles|instructions|warp)" |
    head -80
done
echo "== ours: the source lines with the most warp stall samples"
ncu --import "$out/ncu-$tag-ours.ncu-rep" --page source --csv --print-source cuda 2>/dev/null |
  python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if not rows: sys.exit()
head = rows[0]
col = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
src = next((i for i, h in enumerate(head) if h.strip() == "Source"), 1)
if col is None: print("no stall column:", head[:8]); sys.exit()
def num(x):
    try: return float(x)
    except ValueError: return 0.0
total = sum(num(r[col]) for r in rows[1:]) or 1.0
for r in sorted(rows[1:], key=lambda r: -num(r[col]))[:40]:
    print(f"{100 * num(r[col]) / total:5.1f}%  {r[0]:>5}  {r[src].strip()[:150]}")
'
