"""numba's cache of a kernel that calls a function of another file follows that file's edits.

numba checks a cached function against its own source file only.  A kernel that calls a
function of another file compiles that function into its own machine code, so after an edit
of the other file (an upgrade in place) numba would load the old code.
``mpips.kernels.key_cache_on_folder`` keys every file's cache on the whole folder.  Each run
below is a fresh Python process with the cache in the folder's ``__pycache__``, as a user's
installed mpips has it.  (Without the key, the third run answers 41 from the stale cache:
numba 0.68.1, checked by hand.)
"""
import subprocess
import sys
import textwrap

DEP = textwrap.dedent("""\
    from numba import njit

    @njit(cache=True)
    def value():
        return {v}
    """)
USER = textwrap.dedent("""\
    from numba import njit
    from dep import value

    @njit(cache=True)
    def kernel(x):
        return x * 10 + value()
    """)
RUN = textwrap.dedent("""\
    import sys
    sys.path.insert(0, sys.argv[1])
    import mpips.kernels
    if sys.argv[2] == "keyed":
        assert mpips.kernels.key_cache_on_folder(sys.argv[1])
    import user
    print(user.kernel(4), user.kernel.stats.cache_hits.__len__())
    """)


def _run(folder, how):
    out = subprocess.run([sys.executable, "-c", RUN, str(folder), how], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result, hits = out.stdout.split()
    return int(result), int(hits)


def _project(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "dep.py").write_text(DEP.format(v=1))
    (folder / "user.py").write_text(USER)
    return folder


def test_a_kernel_recompiles_when_a_function_it_calls_changes_in_another_file(tmp_path):
    folder = _project(tmp_path, "keyed")
    assert _run(folder, "keyed") == (41, 0)          # compiled, cached
    assert _run(folder, "keyed") == (41, 1)          # loaded from the cache
    (folder / "dep.py").write_text(DEP.format(v=2))
    assert _run(folder, "keyed") == (42, 0)          # the edit is seen: compiled again
    assert _run(folder, "keyed") == (42, 1)

