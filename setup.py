"""Builds samebits' extension with CMake for `pip install .` (the metadata is in pyproject.toml).

CMake configures this repository (no tests; the CUDA backend when nvcc is found, unless
SAMEBITS_CUDA=OFF) for the running interpreter and builds the one target samebits_python. Its
_core*.so and libsamebits.so.X.Y go side by side into the wheel's samebits/: the extension's RPATH
is $ORIGIN (SAMEBITS_PYTHON_WHEEL=ON), so it loads that copy of the library and never a build
tree's. A shared library rather than a static link keeps one build of the library, the one that
`cmake --install` ships and the tests run.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD = "build-pip"  # setuptools' own directory; build/ is CMake's (./dev)


def project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(samebits VERSION ([0-9.]+)", text).group(1)


def pybind11_cmake_dir():
    """pybind11's CMake package: the pip / python3-pybind11 module's, else CMake's own search
    (Debian's pybind11-dev puts it in /usr/lib/cmake/pybind11)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], check=True,
                             capture_output=True, text=True).stdout.strip()
        return out or None
    except (OSError, subprocess.CalledProcessError):
        return None


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = Path(self.build_temp).resolve() / "cmake"
        args = ["-DCMAKE_BUILD_TYPE=Release", "-DSAMEBITS_TESTS=OFF", "-DSAMEBITS_PYTHON=ON",
                "-DSAMEBITS_PYTHON_WHEEL=ON", f"-DPython3_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        cuda = os.environ.get("SAMEBITS_CUDA", "ON").upper()
        if cuda in ("0", "OFF", "NO", "FALSE"):
            args.append("-DSAMEBITS_CUDA=OFF")
        else:
            args.append("-DSAMEBITS_CUDA=ON")
            if not shutil.which("nvcc") and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
                args.append("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")  # as ./dev finds it
        cmake_dir = pybind11_cmake_dir()
        if cmake_dir:
            args.append(f"-Dpybind11_DIR={cmake_dir}")
        listing = build / "python-wheel-files.txt"
        if listing.exists():
            listing.unlink()
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *args], check=True)
        if not listing.exists():
            sys.exit("samebits: CMake found no pybind11 or no Python headers for "
                     f"{sys.executable} (Debian: pybind11-dev, python3-dev)")
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build), "--target", "samebits_python", "-j", jobs], check=True)

        core, lib = listing.read_text().split()
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(core, target)
        shutil.copy(lib, target.parent / Path(lib).name)  # the soname file: what _core loads


os.makedirs(ROOT / BUILD, exist_ok=True)
setup(
    version=project_version(),
    ext_modules=[Extension("samebits._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": BUILD}, "egg_info": {"egg_base": BUILD}},
)
