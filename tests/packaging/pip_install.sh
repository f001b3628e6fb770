#!/usr/bin/env bash
# `pip install .` as a user does it, offline: a fresh venv over Debian's python3 (NumPy from
# python3-numpy via --system-site-packages), Debian's setuptools / wheel / pybind11, no index. Then,
# from a directory outside the repository, import samebits, score a sequence with the built-in model,
# and check that the extension loaded the libsamebits installed beside it. Run by .ci/run.
#   tests/packaging/pip_install.sh            (SAMEBITS_CUDA=OFF skips the CUDA backend)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-/usr/bin/python3}   # not a pyenv shim: Debian's numpy and pybind11 belong to this one
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m venv --system-site-packages "$work/venv"
start=$SECONDS
"$work/venv/bin/pip" install --no-build-isolation --no-index --no-cache-dir . >"$work/pip.log" 2>&1 || {
  tail -40 "$work/pip.log"; echo "pip_install: pip install . failed" >&2; exit 1; }
echo "pip_install: built and installed in $((SECONDS - start)) s"

cd "$work"
"$work/venv/bin/python" - <<'PY'
import os, sys
import samebits
pkg = os.path.dirname(samebits.__file__)
assert pkg.startswith(sys.prefix), f"samebits imported from {pkg}, not the venv {sys.prefix}"
logp = samebits.Chain(samebits.Model.builtin()).logprobs([[1, 2, 3]])
print("pip_install: samebits", samebits.version(), "from", pkg, "->", logp[0].tolist())
assert len(logp) == 1 and len(logp[0]) == 3 and all(x < 0 for x in logp[0][1:]), logp
libs = {l.split()[-1] for l in open("/proc/self/maps") if "libsamebits" in l}
assert libs and all(os.path.dirname(p) == pkg for p in libs), f"libsamebits loaded from {libs}"
for py in ("torch/__init__.py", "torch/ops.py", "torch/enable.py", "torch/_common.py", "hf.py"):
    assert os.path.exists(os.path.join(pkg, py)), f"the package lacks samebits/{py}"
PY
echo "pip_install: ok"
