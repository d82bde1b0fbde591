"""What a CUDA build of the native library needs beyond nvcc, and a compile check that runs without a GPU.

ggml's CUDA backend includes and links cuBLAS. A CUDA toolkit installed without it (nvcc alone, as on
our CI machines) gets it from NVIDIA's `nvidia-cublas` wheel on PyPI: fetched with pip once, its headers
and libraries unpacked into the cache and handed to CMake. Without a driver (no libcuda) the backend is
configured without CUDA virtual memory management, which is the one part that links libcuda directly.

`compile_check` configures the real CUDA build (llama.cpp's own CMake, so its flags) and compiles the
CUDA sources of every ggml op the SeKV decode graph uses, for the given GPU architectures.
"""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SekvError
from . import build

CUBLAS_WHEEL = ("nvidia-cublas", "13.10.0.20")  # CUDA 13 cuBLAS, tested with nvcc 13.0
CHECK_ARCHS = ("86", "90")  # RTX 30xx (Ampere consumer) and H100/H200 (Hopper)
# ggml-cuda sources behind the ops of sekv_graph.cpp (get_rows, mul_mat / mul_mat_id on quantized and f16
# weights, rope, rms_norm, add/mul/repeat, scale, soft_max, top_k, pool_2d, set_rows, concat, sum_rows,
# cpy/cont, silu) plus the backend itself
DECODE_GRAPH_SOURCES = ("ggml-cuda", "getrows", "mmvq", "mmvf", "mmid", "quantize", "convert", "rope", "norm",
                        "binbcast", "scale", "softmax", "top-k", "argsort", "pool2d", "set-rows", "concat",
                        "sumrows", "cpy", "unary")


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise SekvError("a CUDA build needs nvcc (the CUDA toolkit) on PATH")
    return path


def gpu_visible() -> bool:
    """An NVIDIA GPU this process could use (asked of nvidia-smi, so no CUDA library is loaded)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return False
    try:
        out = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def toolkit_root() -> Path:
    """The toolkit nvcc belongs to (nvcc may be a wrapper script, so ask nvcc itself)."""
    probe = build.cache_root() / "probe.cu"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("\n")
    out = subprocess.run([nvcc(), "--dryrun", "-c", str(probe)], capture_output=True, text=True).stderr
    found = re.search(r"^#\$ TOP=(.+)$", out, re.MULTILINE)
    if found is None:
        raise SekvError(f"could not tell where nvcc's toolkit lives from `nvcc --dryrun`:\n{out[-500:]}")
    return Path(found.group(1).strip()).resolve()


def _toolkit_has_cublas(root: Path) -> bool:
    return any((d / "cublas_v2.h").is_file() for d in [root / "include", *root.glob("targets/*/include")])


def installed_cublas() -> Path | None:
    """A cuBLAS that pip already installed (the nvidia-cublas package PyTorch's CUDA builds bring):
    the folder holding include/cublas_v2.h and lib/libcublas.so*, or None."""
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for folder in sorted(Path(base).glob("*")):
            if (folder / "include" / "cublas_v2.h").is_file() and any((folder / "lib").glob("libcublasLt.so*")):
                return folder
    return None


def cublas_from_wheel(log: build.Log) -> Path:
    """Headers (include/) and libraries (lib/) of cuBLAS from its PyPI wheel, unpacked once into the cache."""
    name, version = CUBLAS_WHEEL
    target = build.cache_root() / f"cublas-{version}"
    if (target / ".ready").is_file():
        return target
    wheels = build.cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        log(f"downloading cuBLAS ({name}=={version}, about 450 MB, pip)")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                               f"{name}=={version}"], capture_output=True, text=True)
        found = sorted(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise SekvError(f"could not download cuBLAS from PyPI ({name}=={version}); install a CUDA toolkit "
                            f"with cuBLAS instead:\n{(proc.stdout + proc.stderr)[-800:]}")
    log("unpacking cuBLAS headers and libraries")
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as wheel:
        for member in wheel.namelist():
            part = re.match(r"nvidia/cu\d+/(include|lib)/([^/]+)$", member)
            if part:
                dest = staging / part.group(1) / part.group(2)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(wheel.read(member))
    libs = sorted((staging / "lib").glob("libcublas.so*")), sorted((staging / "lib").glob("libcublasLt.so*"))
    if not ((staging / "include" / "cublas_v2.h").is_file() and all(libs)):
        raise SekvError(f"the cuBLAS wheel {found[0].name} does not hold cublas_v2.h and libcublas(Lt)")
    (staging / ".ready").write_text(version)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def cmake_flags(log: build.Log, archs: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """CMake flags of a CUDA build on this machine (cuBLAS from the wheel when the toolkit lacks it).
    archs: device code for exactly these architectures; None keeps llama.cpp's default list (PTX for
    older GPUs, cubins for the common ones)."""
    root = toolkit_root()
    flags = ["-DGGML_CUDA=ON", "-DGGML_CUDA_NCCL=OFF", f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}"]
    if archs:
        flags.append(f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(f'{a}-real' for a in archs)}")
    if not _toolkit_has_cublas(root):
        cublas = installed_cublas() or cublas_from_wheel(log)
        lib = cublas / "lib"
        flags += [f"-DCUDA_cublas_LIBRARY={sorted(lib.glob('libcublas.so*'))[0]}",
                  f"-DCUDA_cublasLt_LIBRARY={sorted(lib.glob('libcublasLt.so*'))[0]}",
                  f"-DCMAKE_CUDA_FLAGS=-I{cublas / 'include'}"]
    if not _cmake_finds_libcuda(root):  # no driver library to link: leave out the VMM pool (links libcuda)
        flags.append("-DGGML_CUDA_NO_VMM=ON")
    return tuple(flags)


def _cmake_finds_libcuda(root: Path) -> bool:
    """Whether CMake's FindCUDAToolkit will find the driver library (an unversioned libcuda.so in the
    toolkit's stubs or a system library folder); a machine without a driver has none."""
    if ctypes.util.find_library("cuda") is None:
        return False
    folders = [root / "lib64" / "stubs", root / "lib64", *root.glob("targets/*/lib/stubs"), *root.glob("targets/*/lib"),
               Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/local/nvidia/lib64")]
    return any((folder / "libcuda.so").exists() for folder in folders)


@dataclass(frozen=True)
class CheckResult:
    objects: tuple[Path, ...]
    archs: tuple[str, ...]
    build_dir: Path


def compile_check(archs: tuple[str, ...] = CHECK_ARCHS, log: build.Log = lambda _: None) -> CheckResult:
    """Compile the decode graph's CUDA sources for `archs` (no GPU needed); raises SekvError on failure.
    Incremental: a second run with the same inputs compiles nothing."""
    plan = build.BuildPlan.create(cuda=True, log=log, cuda_archs=archs)
    build_dir = build.configure(plan, build.source_tree(plan, log), plan.flags, log)
    objects = tuple(build_dir / "llama.cpp" / "ggml" / "src" / "ggml-cuda" / "CMakeFiles" / "ggml-cuda.dir" /
                    f"{name}.cu.o" for name in DECODE_GRAPH_SOURCES)
    log(f"compiling {len(objects)} CUDA sources for sm_{', sm_'.join(archs)} (minutes the first time)")
    targets = [str(o.relative_to(build_dir)) for o in objects]
    build.run_tool([build.tool_or_fail("cmake"), "--build", str(build_dir), "-j", str(os.cpu_count() or 2),
                    "--target", *targets], build_dir, "CUDA compile check")
    missing = [o.name for o in objects if not o.is_file() or o.stat().st_size == 0]
    if missing:
        raise SekvError(f"the CUDA compile check produced no object for {', '.join(missing)}")
    return CheckResult(objects, archs, build_dir)


def embedded_archs(obj: Path) -> set[str]:
    """GPU architectures an object file carries device code (cubin) for, e.g. {"86", "90"}, read from its
    fatbins (the toolkit here has no cuobjdump). A fatbin: magic 0xBA55ED50, u16 version, u16 header size,
    u64 payload size; then entries: u16 kind (2 = cubin, 1 = PTX), u16, u32 header size, u64 size, ...,
    u32 architecture at byte 28."""
    data = obj.read_bytes()
    magic = struct.pack("<I", 0xBA55ED50)
    archs: set[str] = set()
    at = data.find(magic)
    while at >= 0 and at + 16 <= len(data):
        header, size = struct.unpack_from("<HQ", data, at + 6)
        entry, end = at + header, min(at + header + size, len(data))
        while entry + 32 <= end:
            kind, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
            if kind == 2:
                archs.add(str(struct.unpack_from("<I", data, entry + 28)[0]))
            if entry_header == 0:
                break
            entry += entry_header + entry_size
        at = data.find(magic, max(end, at + 4))
    return archs
