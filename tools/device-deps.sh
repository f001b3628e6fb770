#!/usr/bin/env bash
# Copies the Debian-packaged build dependencies into .deps/ (git-ignored) so that a machine with
# no package registry (the GPU machine) can build samebits: carry .deps with the working tree.
# CMake falls back to .deps when a package is not installed (header-only nlohmann-json and CLI11,
# fmt in header-only mode, GoogleTest from source, pybind11 for the Python package).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/include
cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/fmt .deps/include/
cp -r /usr/src/googletest .deps/googletest
# pybind11 (headers + its CMake package; the package finds its headers at ../../../include)
cp -r /usr/include/pybind11 .deps/include/
mkdir -p .deps/lib/cmake && cp -r /usr/lib/cmake/pybind11 .deps/lib/cmake/
du -sh .deps
