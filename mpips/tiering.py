"""The --table-memory / --table-dir options of the disk tier (docs/disk-tier.md): the size's
form, the tier's parent directory and its check.  ``mpips.config`` validates with them at
start; ``mpips.tables.disk`` makes its folders with ``check_dir``."""
import errno
import importlib.util
import os
import tempfile

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    """'4G', '512M', '1.5G', '100000K' or a number of bytes -> bytes (binary units);
    ValueError (one line, the forms it takes) otherwise."""
    raw = str(text).strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (raw[:-1], raw[-1]) if raw[-1:] in SIZE_UNITS else (raw, "")
    try:
        value = float(num) * SIZE_UNITS[unit]
    except ValueError:
        value = -1
    if not value >= 1:
        raise ValueError(f"--table-memory must be a size like 4G, 512M or 1000000 (bytes); "
                         f"got {text!r}")
    return int(value)


def tier_dir(table_dir=""):
    """The disk tier's parent directory: --table-dir, else $SLURM_TMPDIR, $TMPDIR or /tmp
    (the node's local temporary directory)."""
    return (table_dir or os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR")
            or "/tmp")


def check_dir(path):
    """The absolute path of ``path``, made if missing; OSError (one line, the remedy) when a
    folder cannot be made in it."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".mpips-probe-", dir=path))
    except OSError as e:
        raise OSError(e.errno or errno.EACCES,
                      f"--table-dir {path}: not a writable directory ({e.strerror or e}); "
                      f"give a writable local directory") from None
    return path


def check_tier(table_memory, table_dir):
    """ValueError (one line, the fix) unless the tier's options are usable: a size, the
    engine installed, a writable directory."""
    if table_dir and not table_memory:
        raise ValueError("--table-dir is where --table-memory's disk tier lives: give "
                         "--table-memory SIZE too (or drop --table-dir)")
    if not table_memory:
        return
    parse_size(table_memory)
    if importlib.util.find_spec("lmdb") is None:
        raise ValueError("--table-memory needs the lmdb package: pip install 'mpips[disk]' "
                         "(or pip install lmdb)")
    try:
        check_dir(tier_dir(table_dir))
    except OSError as e:
        raise ValueError(e.strerror) from None
