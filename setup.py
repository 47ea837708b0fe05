"""Build the CPU kernels (csrc/cpu) as the CPython extension s2moe._cpu; everything else is in
pyproject.toml. Plain setuptools `Extension`: the build needs only a C compiler and Python's headers
(no NumPy headers, CMake or extra build dependency), and `pip install -e .` builds it in place.

SIMD code is compiled per function (`target("avx2,fma,f16c")`) and chosen at run time, so one
build runs on any x86-64 CPU; other CPUs (aarch64: Jetson) get the portable path. A failed build
is not fatal: s2moe then runs on the NumPy reference path and says so once.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = [os.path.join("csrc", "cpu", f) for f in ("module.c", "ops.c", "attend.c", "dot.c", "dot512.c", "kquant.c", "kquant_avx2.c", "kquant_amx.c", "pool.c", "aio.c", "step.c", "predict.c", "pass.c")]


VNNI_PROBE = (
    "#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 16) || "
    "(!defined(__clang__) && __GNUC__ >= 11))\n#include <immintrin.h>\n"
    '__attribute__((target("avx2,avxvnni"))) __m256i s2moe_probe(__m256i a, __m256i b) '
    "{ return _mm256_dpbusd_avx_epi32(a, a, b); }\n#endif\nint s2moe_probe_unused;\n"
)
AMX_PROBE = (
    "#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || "
    "(!defined(__clang__) && __GNUC__ >= 11))\n#include <immintrin.h>\n"
    '__attribute__((target("amx-tile,amx-int8"))) void s2moe_probe(const void *c, const void *a) '
    "{ _tile_loadconfig(c); _tile_loadd(1, a, 64); _tile_dpbusd(0, 1, 2); _tile_release(); }\n"
    "#endif\nint s2moe_probe_unused;\n"
)


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler: the runtime falls back to NumPy
            print(f"warning: the s2moe CPU kernels were not built ({exc}); s2moe will use NumPy", file=sys.stderr)

    def build_extension(self, ext):
        # the compiler may know AVX-VNNI or AMX while the assembler does not (binutils < 2.36)
        if not self._assembles(VNNI_PROBE):
            ext.define_macros.append(("S2MOE_NO_VNNI", "1"))
        if not self._assembles(AMX_PROBE):
            ext.define_macros.append(("S2MOE_NO_AMX", "1"))
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: building {ext.name} failed ({exc}); s2moe will use NumPy", file=sys.stderr)

    def _assembles(self, probe: str) -> bool:
        """Whether this toolchain builds the probe's instructions (csrc/cpu/simd.h uses them where so)."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "probe.c")
            with open(path, "w") as f:
                f.write(probe)
            try:
                self.compiler.compile([path], output_dir=tmp, extra_postargs=["-O2"])
                return True
            except Exception:
                return False


setup(
    ext_modules=[
        Extension(
            "s2moe._cpu",
            sources=SOURCES,
            depends=[os.path.join("csrc", "cpu", f) for f in ("aio.h", "dot.h", "kquant.h", "kquant_unpack.h", "ops.h", "pool.h", "pybuf.h", "quant.h", "pass.h", "predict.h", "simd.h", "step.h")],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-Wall", "-Wno-unknown-pragmas"],
            extra_link_args=["-pthread"],
            libraries=["m"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
