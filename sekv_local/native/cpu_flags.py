"""llama.cpp's CPU build flags for the machine it is built on (stdlib only: install.sh runs it as a script
before sekv-local is installed: `python3 sekv_local/native/cpu_flags.py` prints them).

Why not llama.cpp's own GGML_NATIVE: on some Xeons it enables AMX and the first llama_decode then
segfaults. Why not a fixed list: forcing AVX-512 on a CPU without it (e.g. an AMD EPYC with AVX2 only)
dies with "Illegal instruction" at the first kernel. So every x86 instruction-set option is set
explicitly from the CPU's own feature flags, and AMX stays off.
"""

from __future__ import annotations

import platform
from pathlib import Path

#: CMake option -> the /proc/cpuinfo flag that must be present to turn it on
X86_OPTIONS = (
    ("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
    ("GGML_BMI2", "bmi2"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"),
    ("GGML_AVX512_VNNI", "avx512_vnni"), ("GGML_AVX512_BF16", "avx512_bf16"), ("GGML_AVX512_VBMI", "avx512vbmi"),
)
#: never on, whatever the CPU says (see the module docstring)
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_features(cpuinfo: str | None = None) -> set[str]:
    """Feature flags of the first CPU in /proc/cpuinfo (empty where there is none: not Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cmake_cpu_flags(machine: str | None = None, features: set[str] | None = None) -> tuple[str, ...]:
    """-D options for a CPU build on this machine: x86 ISA options from its features; elsewhere
    llama.cpp's native detection (the AMX crash is x86-only)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "i386"):
        return ("-DGGML_NATIVE=ON",)
    have = cpu_features() if features is None else features
    chosen = [f"-D{option}={'ON' if flag in have else 'OFF'}" for option, flag in X86_OPTIONS]
    return ("-DGGML_NATIVE=OFF", *chosen, *(f"-D{option}=OFF" for option in ALWAYS_OFF))


if __name__ == "__main__":
    print(" ".join(cmake_cpu_flags()))
