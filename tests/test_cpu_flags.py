"""llama.cpp's CPU build flags follow the CPU: AVX-512 only where the CPU has it, AMX never."""

import subprocess
import sys
from pathlib import Path

from sekv_local.native import cpu_flags
from sekv_local.native.cpu_flags import cmake_cpu_flags, cpu_features

# the first lines of /proc/cpuinfo on two machines this project runs on (flags shortened to the ISA ones)
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni vaes
"""
XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512_vnni avx512_bf16 avx512vbmi avx_vnni amx_tile amx_int8 amx_bf16
"""


def options(flags: tuple[str, ...]) -> dict[str, str]:
    return dict(f[2:].split("=") for f in flags)


def test_avx2_only_cpu_gets_no_avx512():
    got = options(cmake_cpu_flags("x86_64", cpu_features(EPYC_AVX2)))
    assert got["GGML_NATIVE"] == "OFF"
    assert {got[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")} == {"ON"}
    assert {got[k] for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI",
                             "GGML_AVX_VNNI")} == {"OFF"}


def test_amx_cpu_gets_avx512_but_never_amx():
    got = options(cmake_cpu_flags("x86_64", cpu_features(XEON_AMX)))
    assert {got[k] for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI",
                             "GGML_AVX_VNNI")} == {"ON"}
    assert {got[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")} == {"OFF"}


def test_other_architectures_use_llama_cpp_detection():
    assert cmake_cpu_flags("aarch64", set()) == ("-DGGML_NATIVE=ON",)


def test_no_cpuinfo_means_no_features():
    assert cpu_features("") == set()
    assert options(cmake_cpu_flags("x86_64", set()))["GGML_AVX2"] == "OFF"


def test_script_prints_what_the_native_build_uses():
    """install.sh runs the module as a script with the system python, before sekv-local is installed."""
    from sekv_local.native.build import CPU_FLAGS

    out = subprocess.run([sys.executable, "-I", str(Path(cpu_flags.__file__))], capture_output=True, text=True,
                         check=True).stdout.split()
    assert tuple(out) == cmake_cpu_flags()
    assert CPU_FLAGS[:len(out)] == tuple(out)
