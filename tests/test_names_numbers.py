"""Names and numbers the user reads (issue 35, part 6).

- every mpips flag a job script uses or suggests (its submit example, the commands its
  comments show, its ARGS arrays) is one the module's parser knows;
- the TABLE line counts the examples trained (200,000 rows in batches of 1,024 are
  200,000, not 196 x 1,024 = 200,704), in one process, with --local-workers and 2x2 sync,
  and it and the SERVER line say what their bytes count.
"""
import glob
import os
import re

import pytest

from tests.conftest import ROOT, run_cmd

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags_used(text, name):
    """mpips flags in a job script: after `sbatch jobs/slurm/NAME` in its comments (with
    continuation lines), after `python -m mpips.X` in its comments, and in ARGS arrays."""
    lines = text.splitlines()
    found = []
    i = 0
    while i < len(lines):
        line = lines[i]
        chunk = None
        m = re.search(rf"sbatch jobs/slurm/{re.escape(name)}(.*)", line)
        if line.startswith("#") and m:
            chunk = m.group(1)
            while chunk.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                chunk = chunk.rstrip()[:-1] + " " + lines[i].lstrip("# ")
        m = re.search(r"python -m mpips\.\w+(.*)", line)
        if line.startswith("#") and m and chunk is None:
            chunk = m.group(1).split("`")[0]
        if re.match(r"\s*ARGS\+?=\(", line):
            chunk = line
            while ")" not in chunk and i + 1 < len(lines):
                i += 1
                chunk += " " + lines[i]
        if chunk is not None:
            found += FLAG.findall(chunk)
        i += 1
    return found


def test_job_scripts_use_only_flags_that_exist():
    from mpips import infer
    from mpips.config import build_parser
    known = {"mpips.train": set(build_parser()._option_string_actions),
             "mpips.infer": set(infer.build_parser()._option_string_actions)}
    scripts = sorted(glob.glob(os.path.join(ROOT, "jobs", "slurm", "*.sbatch")))
    assert len(scripts) >= 3
    for path in scripts:
        name = os.path.basename(path)
        module = "mpips.infer" if name.startswith("infer") else "mpips.train"
        used = _flags_used(open(path).read(), name)
        assert used, name
        unknown = sorted(set(used) - known[module])
        assert not unknown, f"{name} uses flags {module} does not have: {unknown}"
    # the check itself finds a wrong flag where the old stream.sbatch had one
    bad = "#   sbatch jobs/slurm/x.sbatch /data ck \\\n#       --save-delta-every pass\n"
    assert _flags_used(bad, "x.sbatch") == ["--save-delta-every"]


@pytest.fixture(scope="module")
def one_file(tiny_data, tmp_path_factory):
    """tiny_data's 16,000 train rows in one file."""
    out = tmp_path_factory.mktemp("table") / "train.txt"
    with open(out, "wb") as f:
        for p in sorted(glob.glob(f"{tiny_data[0]}/*")):
            f.write(open(p, "rb").read())
    return str(out)


def _table_lines(out):
    return [x for x in out.splitlines() if x.startswith("TABLE --> ")]


@pytest.mark.parametrize("extra,n", [((), None), (("--local-workers", "2"), None),
                                     (("--mode", "sync"), 4)],
                         ids=["local", "local-workers-2", "sync-2x2"])
def test_table_line_counts_examples_trained(one_file, tmp_path, extra, n):
    """16,000 rows: batch 1,024 leaves a last batch of 640 (one process; 2 workers of
    8,000-odd rows each end on a short batch too); the last TABLE line says 16,000."""
    args = ["-m", "mpips.train", "--train", one_file, "--fc", "16", "--batch-size", "1024",
            "--table-every", "4000", "--print-every", "1000", "--progress-every", "0", *extra]
    proc = run_cmd(args + ([] if n else ["--local"]), n=n, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = _table_lines(proc.stdout)
    counts = [int(re.search(r"examples: (\d+)", x).group(1)) for x in lines]
    assert counts[-1] == 16000 and counts == sorted(counts), lines
    assert all("(the whole table over its sparse rows: rows and dense weights, with "
               "optimizer state)" in x for x in lines)
    if n:
        servers = [x for x in proc.stdout.splitlines() if x.startswith("SERVER --> ")]
        assert len(servers) == 2 and all("(sparse rows with optimizer state; the dense "
                                         "slice not counted)" in x for x in servers)
