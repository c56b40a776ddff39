"""The numba kernels (``@njit(cache=True)``: compiled machine code is kept between runs).

numba keeps it in the kernels' ``__pycache__``, else in ``NUMBA_CACHE_DIR`` or the user's
cache folder.  When it can write to none of them (a job run as another user than the one who
installed mpips, with no home folder), ``cache=True`` would fail at import with numba's
``RuntimeError: cannot cache function ... no locator available``; instead the kernels are
compiled without the cache, in every run, after one line saying so (:func:`cache_fallback`,
run before any kernel module is imported).
"""
import sys

from numba.core import caching, dispatcher

CACHE_OFF = ("mpips: warning: numba finds no folder it can write its cache of compiled "
             "kernels to ({where}/__pycache__, NUMBA_CACHE_DIR, the user's cache folder): "
             "compiling them without the cache, in every run (give NUMBA_CACHE_DIR a "
             "writable folder to keep them)")


def _probe():
    """A function of this folder: where numba would cache the kernels."""


def cache_fallback(err=None):
    """If numba can cache no function of this folder, compile every kernel without the
    cache (numba's ``Dispatcher.enable_caching`` made a no-op for this process) and say so
    once on ``err`` (default stderr); returns whether the cache is off."""
    try:
        caching.FunctionCache(_probe)
        return False
    except RuntimeError:
        dispatcher.Dispatcher.enable_caching = lambda self: None
        where = __file__.rsplit("/", 1)[0]
        print(CACHE_OFF.format(where=where), file=err or sys.stderr, flush=True)
        return True


CACHE_OFF_NOW = cache_fallback()
