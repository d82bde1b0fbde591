"""Builds the native library: llama.cpp from the pinned llama-cpp-python sdist + our patches and sources.

Inputs (the sdist, `native/patches/*.patch`, `native/src/*`, `native/CMakeLists.txt`, compiler flags,
compiler version) are hashed; the built library is cached under that key, so a second build with the
same inputs is a copy-free lookup. The CMake build directory is kept per (llama.cpp version, flags) so
that a change to our sources recompiles only our files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import SekvError
from .cpu_flags import cmake_cpu_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LIBRARY_NAME = "libsekv_native.so"
# this CPU's instruction sets, AMX off (native/cpu_flags.py says why)
CPU_FLAGS = cmake_cpu_flags() + ("-DGGML_OPENMP=OFF",)
ENV_LIBRARY = "SEKV_NATIVE_LIBRARY"  # use this prebuilt library instead of building

Log = Callable[[str], None]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sekv-local" / "native"


def native_dir() -> Path:
    """`native/` of the source checkout (the package is installed editable from it)."""
    here = Path(__file__).resolve().parents[2] / "native"
    if not (here / "CMakeLists.txt").is_file():
        raise SekvError(f"the native sources are not at {here}: the native engine needs a source checkout "
                        f"of sekv-local (pip install -e .)")
    return here


@dataclass(frozen=True)
class BuildPlan:
    cuda: bool
    flags: tuple[str, ...]
    sources: tuple[Path, ...]
    patches: tuple[Path, ...]

    @classmethod
    def create(cls, cuda: bool = False, log: Log = lambda _: None,
               cuda_archs: tuple[str, ...] | None = None) -> "BuildPlan":
        """The plan for this checkout; with cuda, the CUDA flags for this machine's toolkit (which may
        fetch cuBLAS, see native/cuda.py) and device code for cuda_archs (None: llama.cpp's list)."""
        root = native_dir()
        sources = tuple(sorted([root / "CMakeLists.txt", *(root / "src").glob("*.*")]))
        patches = tuple(sorted((root / "patches").glob("*.patch")))
        if cuda:
            from .cuda import cmake_flags

            flags = CPU_FLAGS + cmake_flags(log, cuda_archs)
        else:
            flags = CPU_FLAGS
        return cls(cuda, flags, sources, patches)

    def source_key(self) -> str:
        """Hash of what the llama.cpp tree depends on: version and patches."""
        h = hashlib.sha256(LLAMA_CPP_PYTHON_VERSION.encode())
        for p in self.patches:
            h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()[:16]

    def key(self) -> str:
        """Hash of every build input: the library cached under it is reused as is."""
        h = hashlib.sha256(self.source_key().encode())
        h.update(" ".join(self.flags).encode())
        h.update(_compiler_version().encode())
        for p in self.sources:
            h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()[:16]

    def library_path(self) -> Path:
        return cache_root() / "lib" / self.key() / LIBRARY_NAME


def _tool(name: str) -> str | None:
    """A build tool on PATH or next to this Python (pip's cmake / ninja wheels install there)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def _compiler_version() -> str:
    try:
        return subprocess.run(["c++", "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "no c++"


def tool_or_fail(name: str) -> str:
    found = _tool(name)
    if found is None:
        raise SekvError(f"building the native engine needs {name} (e.g. `pip install cmake ninja`)")
    return found


def run_tool(cmd: list[str], cwd: Path, what: str) -> None:
    """Run a build step; on failure raise with the tail of its output."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise SekvError(f"{what} failed ({' '.join(cmd[:3])} ...):\n{tail}")


def _sdist(log: Log) -> Path:
    """The pinned llama-cpp-python source distribution, through pip (cached)."""
    folder = cache_root() / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} source distribution (pip)")
    run_tool([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(folder),
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], folder, "pip download")
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"))
    if not found:
        raise SekvError(f"pip did not produce the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist in {folder}")
    return found[0]


ENV_SOURCE = "SEKV_LLAMA_CPP_DIR"  # an already extracted and patched llama.cpp tree (machines without PyPI)


def source_tree(plan: BuildPlan, log: Log) -> Path:
    """vendor/llama.cpp of the sdist with our patches applied (one tree per patch set), or $SEKV_LLAMA_CPP_DIR."""
    given = os.environ.get(ENV_SOURCE)
    if given:
        if not (Path(given) / "ggml" / "CMakeLists.txt").is_file():
            raise SekvError(f"{ENV_SOURCE}={given} is not a llama.cpp source tree")
        return Path(given)
    tree = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{plan.source_key()}"
    if (tree / ".sekv-ready").is_file():
        return tree
    sdist = _sdist(log)
    staging = tree.with_name(tree.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log("extracting llama.cpp from the sdist")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(staging, members=[m for m in members if m.name], filter="data")
    for patch in plan.patches:
        log(f"applying {patch.name}")
        run_tool(["patch", "-p1", "--forward", "--quiet", "-i", str(patch)], staging, f"patch {patch.name}")
    (staging / ".sekv-ready").write_text(plan.source_key())
    shutil.rmtree(tree, ignore_errors=True)
    staging.rename(tree)
    return tree


def configure(plan: BuildPlan, tree: Path, flags: tuple[str, ...], log: Log) -> Path:
    """Configure (or reuse) the CMake build directory for these flags; returns it. One directory per
    (llama.cpp version, patches, flags, source checkout), so our source edits recompile only our files;
    CMake refuses a build directory made for another checkout, hence the checkout in the key."""
    cmake = tool_or_fail("cmake")
    flags_key = hashlib.sha256((plan.source_key() + str(tree) + str(native_dir()) + " ".join(flags)).encode()).hexdigest()[:16]
    build_dir = cache_root() / f"build-{flags_key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    ninja = _tool("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    log(f"configuring ({'CPU + CUDA' if '-DGGML_CUDA=ON' in flags else 'CPU'}) in {build_dir}")
    run_tool([cmake, *generator, str(native_dir()), f"-DLLAMA_CPP_DIR={tree}", "-DCMAKE_BUILD_TYPE=Release",
              *flags], build_dir, "cmake configure")
    return build_dir


def build(cuda: bool = False, log: Log = lambda _: None, force: bool = False,
          cuda_archs: tuple[str, ...] | None = None) -> Path:
    """Build (or find in the cache) the native library; returns its path."""
    plan = BuildPlan.create(cuda, log, cuda_archs)
    target = plan.library_path()
    if target.is_file() and not force:
        return target
    if shutil.which("c++") is None:
        raise SekvError("building the native engine needs a C++ compiler (e.g. `apt install g++`)")
    tree = source_tree(plan, log)
    build_dir = configure(plan, tree, plan.flags, log)
    log("compiling llama.cpp and sekv-native (a few minutes the first time"
        + (", much longer with CUDA" if cuda else "") + ")")
    run_tool([tool_or_fail("cmake"), "--build", str(build_dir), "--target", "sekv_native", "-j",
              str(os.cpu_count() or 2)], build_dir, "cmake build")
    built = build_dir / LIBRARY_NAME
    if not built.is_file():
        raise SekvError(f"the build finished without producing {built}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.rename(target)
    return target


def library_path(auto_build: bool = True, log: Log = lambda _: None, cuda: bool = False) -> Path:
    """The library to load: $SEKV_NATIVE_LIBRARY, the cached build for the current inputs, or a new build
    (cuda: the build with ggml's CUDA backend)."""
    env = os.environ.get(ENV_LIBRARY)
    if env:
        if not Path(env).is_file():
            raise SekvError(f"{ENV_LIBRARY}={env} does not exist")
        return Path(env)
    path = BuildPlan.create(cuda=cuda, log=log).library_path()
    if path.is_file():
        return path
    if not auto_build:
        raise SekvError(f"the native engine is not built yet: run `sekv-local native build{' --cuda' if cuda else ''}`")
    return build(cuda=cuda, log=log)
