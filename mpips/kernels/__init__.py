"""The numba kernels (``@njit(cache=True)``: compiled machine code is kept between runs).

numba keeps it in the kernels' ``__pycache__``, else in ``NUMBA_CACHE_DIR`` or the user's
cache folder.  When it can write to none of them (a job run as another user than the one who
installed mpips, with no home folder), ``cache=True`` would fail at import with numba's
``RuntimeError: cannot cache function ... no locator available``; instead the kernels are
compiled without the cache, in every run, after one line saying so (:func:`cache_fallback`,
run before any kernel module is imported).

numba checks a cached kernel against its own source file only, yet a kernel that calls a
function of another kernel file compiles that function into its own machine code: after an
upgrade in place, it would run the old code of the function it calls (seen once:
``csv_parse`` kept an old ``bag_common.emit_bags``).  So every kernel file's cache is keyed
on the sources of all of them (:func:`key_cache_on_folder`): a change to any kernel file
recompiles every kernel, once.
"""
import hashlib
import os
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


_KEYED = {}                 # folder -> digest of its .py files (computed at first use)


def _folder_digest(folder):
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()


def key_cache_on_folder(folder):
    """Key numba's cache of every function defined in a ``.py`` file of ``folder`` on the
    sources of all that folder's files, not on its own file alone (see the module doc).
    Returns False where numba's cache has not the shape this wraps (then nothing changes)."""
    mixin = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    if mixin is None or not hasattr(mixin, "get_source_stamp"):
        return False
    folder = os.path.realpath(folder)
    _KEYED.setdefault(folder, None)
    if not getattr(mixin.get_source_stamp, "_mpips_keyed", False):
        own = mixin.get_source_stamp

        def get_source_stamp(self):
            stamp = own(self)
            where = os.path.dirname(os.path.realpath(getattr(self, "_py_file", "") or "."))
            if where not in _KEYED:
                return stamp
            if _KEYED[where] is None:
                _KEYED[where] = _folder_digest(where)
            return (stamp, _KEYED[where])

        get_source_stamp._mpips_keyed = True
        mixin.get_source_stamp = get_source_stamp
    return True


CACHE_OFF_NOW = cache_fallback()
key_cache_on_folder(os.path.dirname(__file__))
