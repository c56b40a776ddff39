"""Print the shell exports that put NumPy, OpenBLAS and numba on their AVX2-only code paths.

    eval "$(python .ci/avx2_env.py /tmp/numba-avx2)"

What a CPU without AVX-512 (AMD Zen 3, Intel Haswell..Comet Lake) runs, on any x86-64 that
has AVX2: NumPy's AVX-512 dispatch targets off (their names differ between NumPy versions,
so they are read from NumPy), OpenBLAS's Haswell kernels (what it picks on Zen), and numba
compiling for znver3 (haswell on a non-AMD host) with that CPU's own features only.
numba then caches into the directory given (machine code for another target must not
mix with the default cache).
"""
import shlex
import sys

import llvmlite.binding as ll

try:
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
except ImportError:                                   # NumPy 1.x
    from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__


def main(cache_dir):
    avx512 = [f for f in __cpu_dispatch__
              if ("512" in f or f == "X86_V4") and __cpu_features__.get(f)]
    host = ll.get_host_cpu_name()
    env = {
        "NPY_DISABLE_CPU_FEATURES": " ".join(avx512),
        "OPENBLAS_CORETYPE": "Haswell",
        "NUMBA_CPU_NAME": "znver3" if host.startswith("znver") else "haswell",
        "NUMBA_CPU_FEATURES": "",          # empty: the named CPU's features, not the host's
        "NUMBA_CACHE_DIR": cache_dir,
    }
    for k, v in env.items():
        print(f"export {k}={shlex.quote(v)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/avx2_env.py NUMBA_CACHE_DIR")
    main(sys.argv[1])
