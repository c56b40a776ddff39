"""Check the docs: links resolve, and every shell command runs as written, in small.

    python tools/check_docs.py                # both parts; the commands take minutes
    python tools/check_docs.py --links        # only the links (what tests/test_docs.py runs)
    python tools/check_docs.py --commands [--only FILE] [--timeout S] [--keep]

Links: every relative link and image in README.md and docs/**/*.md must name a file (or
folder) of the repository, and its #anchor a heading of that file (GitHub's slugs); file
paths (`mpips/...py`, `bench/...`) and module names (`mpips.job.warmup`) quoted in code
spans must exist.

Commands: the ```sh blocks of the same files, one command a logical line (continuations
joined, comments dropped), run in document order with bash in a scratch folder per page, so
that a command can use what an earlier one of the page wrote (data, a checkpoint, a
metrics file). "In small": sizes are cut (--rows, --test-rows, --synth-rows, --epochs,
--rounds, ...), absolute data paths (/tmp/X, /data/criteo/...) point into the scratch
folder, where a small synthetic Criteo set stands in for /data/criteo, and the main job
gets a small embedded set. Commands that cannot run here are listed as skipped with the
reason (installs, Slurm submissions, torch benchmarks without the `bench` extra, commands
with `...` placeholders). Exit code 1 if a command fails or a link is broken.
"""
import argparse
import ast
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------- pages
def doc_files(root=ROOT):
    """README.md and every docs/**/*.md, as paths relative to root, sorted."""
    out = ["README.md"]
    for dirpath, _, files in os.walk(os.path.join(root, "docs")):
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in files if f.endswith(".md")]
    return sorted(out)


FENCE = re.compile(r"^\s*(```|~~~)")


def split_fences(text):
    """[(line number, line, fence info or None)]: info is the fence's language for lines
    inside a fenced block ('' when none), None for prose lines."""
    out, info = [], None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m:
            if info is None:
                info = line.strip()[3:].strip()
            else:
                info = None
            continue
        out.append((n, line, info))
    return out


def slug(heading):
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to -."""
    h = heading.strip().lower()
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)          # a link in a heading: its text
    h = re.sub(r"[^\w\- ]", "", h)                           # keeps letters, digits, _, -, space
    return h.replace(" ", "-")


def anchors(text):
    """The anchors a page defines: one per heading (duplicates get -1, -2, ...)."""
    seen, out = {}, set()
    for _, line, info in split_fences(text):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if info is None and m:
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
PATH = re.compile(r"^(?:mpips|bench|data_prep|tests|jobs|tools|\.ci)/[\w./-]*[\w/]$")
GENERATED = ("bench/out",)                  # written by the benchmarks, not in the repo
MODULE = re.compile(r"^(?:mpips|data_prep)(?:\.\w+)+$")


def top_names(path):
    """Names a module defines or imports at its top level (for `mpips.x.NAME` mentions)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_problem(name, root):
    """None if the dotted name is a module of the repo or a top-level name of one."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        base = os.path.join(root, *parts[:k])
        for f in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(f):
                rest = parts[k:]
                if not rest:
                    return None
                if len(rest) == 1 and rest[0] in top_names(f):
                    return None
                if len(rest) >= 2 and os.path.isfile(f) and rest[0] in top_names(f):
                    return None                      # Class.method: the class is enough
                return f"{'.'.join(parts[:k])} has no {'.'.join(rest)}"
    return f"no module {name}"


def check_links(root=ROOT, files=None):
    """[(page, line, target, problem)] for every broken link or quoted path of the pages."""
    problems = []
    cache = {}

    def page_anchors(path):
        if path not in cache:
            cache[path] = anchors(open(path, encoding="utf-8").read())
        return cache[path]

    for page in files or doc_files(root):
        text = open(os.path.join(root, page), encoding="utf-8").read()
        here = os.path.dirname(os.path.join(root, page))
        for n, line, info in split_fences(text):
            if info is not None:
                continue
            prose = CODE_SPAN.sub("", line)
            for m in LINK.finditer(prose):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
                    continue
                path, _, frag = target.partition("#")
                full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(root, page)
                if not os.path.exists(full):
                    problems.append((page, n, target, "no such file"))
                    continue
                if not os.path.realpath(full).startswith(os.path.realpath(root)):
                    problems.append((page, n, target, "outside the repository"))
                elif frag and full.endswith(".md") and frag not in page_anchors(full):
                    problems.append((page, n, target, f"no heading with anchor #{frag}"))
            for span in CODE_SPAN.findall(line):
                s = span.strip("`").strip()
                tok = s.split()[0] if s.split() else ""
                tok = tok.split("::")[0].rstrip(",;:")
                if tok.startswith(GENERATED):
                    continue
                if PATH.match(tok) and not any(c in tok for c in "*<>{}"):
                    if not os.path.exists(os.path.join(root, tok)):
                        problems.append((page, n, tok, "no such file"))
                elif s == tok and MODULE.match(tok):
                    p = module_problem(tok, root)
                    if p:
                        problems.append((page, n, tok, p))
    return problems


# -------------------------------------------------------------------------------- commands
SHELL_LANGS = {"sh", "bash", "shell"}


def strip_comment(line):
    """The line without a trailing shell comment (a # after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(text):
    """[(line number, command)] of a page's ```sh blocks: continuations joined, comments
    and blank lines dropped."""
    out, buf, start = [], [], None
    for n, line, info in split_fences(text):
        if info not in SHELL_LANGS:
            continue
        code = strip_comment(line)
        if not code.strip() and not buf:
            continue
        if start is None:
            start = n
        if code.endswith("\\"):
            buf.append(code[:-1].strip())
            continue
        buf.append(code.strip())
        joined = " ".join(b for b in buf if b)
        if open_quote(joined):                   # a quoted string goes on to the next line
            buf = [joined + "\n"]
            continue
        out.append((start, joined.replace("\n ", "\n")))
        buf, start = [], None
    return out


def open_quote(s):
    """True if the shell text ends inside a '...' or "..." string."""
    quote = None
    i = 0
    while i < len(s):
        ch = s[i]
        if quote == "'":
            if ch == "'":
                quote = None
        elif quote == '"':
            if ch == "\\":
                i += 1
            elif ch == '"':
                quote = None
        elif ch == "\\":
            i += 1
        elif ch in "'\"":
            quote = ch
        i += 1
    return quote is not None


def named_files(text):
    """{name: content} of the page's non-shell blocks whose first line is `# file: NAME`:
    the files its commands read (a config, a schema), written before they run."""
    out, cur, name = {}, [], None
    for _, line, info in split_fences(text) + [(0, "", None)]:
        if info is None or info in SHELL_LANGS:
            if name:
                out[name] = "\n".join(cur) + "\n"
            cur, name = [], None
            continue
        if name is None and not cur:
            m = re.match(r"^\s*#\s*file:\s*(\S+)\s*$", line)
            if m:
                name = m.group(1)
                continue
        cur.append(line)
    return out


def have_module(name):
    try:
        __import__(name)
        return True
    except Exception:
        return False


INSTALL = re.compile(r"^(python3? -m venv|\. \S+/activate|module load|.*\bpip install)")
# (flag, small value): a size flag is cut to this when larger (numbers) or set (lists)
SMALL = {"--rows": 4000, "--test-rows": 1000, "--synth-rows": 4000, "--synth-test-rows": 1000,
         "--rows-per-pass": 200, "--days": 1, "--hours": 2, "--epochs": 1, "--rounds": 1,
         "--probes": 4, "--every": 10, "--parts": 8, "--stream-timeout": 2, "--seconds": 2,
         "--patch-seconds": 3, "--lines": 256}
FIRST_OF_LIST = ("--real", "--sim", "--sync", "--seeds", "--runs", "--processes", "--batches")


def slurm_up():
    """True if a Slurm controller answers (sinfo), as on a cluster or under .ci/run."""
    if not shutil.which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# commands that serve until stopped: started in the background, they serve the page's next
# commands (curl) until the next server or the page's end; one that does not say it is ready
# within SERVE_SECONDS (mpips.serve's "ready" line) or that exits first fails
SERVERS = re.compile(r"(^|\s)(python -m mpips\.serve|tensorboard)\b")
SERVE_SECONDS = 120


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Background:
    """A server command of a page, running in its own process group."""

    def __init__(self, cmd, cwd):
        self.log = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=run_env(), stdout=self.log,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def wait_ready(self, pattern, seconds):
        """(status, detail): pass once the output matches pattern, FAIL if it exits first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.log.seek(0)
            text = self.log.read()
            if re.search(pattern, text):
                return "pass", "a server: ready, serves the next commands of the page"
            if self.p.poll() is not None:
                return "FAIL", f"exit {self.p.returncode} before it was ready: {text[-600:]}"
            time.sleep(0.2)
        return "FAIL", f"not ready within {seconds} s: {text[-600:]}"

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, 15)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, 9)
                self.p.wait()
        self.log.close()


def run_one(cmd, cwd, timeout):
    """(status, detail) of one command run with bash in cwd."""
    serving = False
    p = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=run_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=SERVE_SECONDS if serving else timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 15)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            out, err = p.communicate()
        if serving:
            return "pass", f"a server: up for {SERVE_SECONDS} s, then stopped"
        return "FAIL", f"timeout after {timeout} s"
    if p.returncode == 0:
        return "pass", ""
    return "FAIL", f"exit {p.returncode}: " + (err.strip() or out.strip())[-600:]


def skip_reason(cmd):
    """Why a command cannot run here, or None."""
    if re.search(r"(^|\s)\.\.\.(\s|$)", cmd) or re.search(r"<[^>]+>", cmd):
        return "a placeholder (... or <...>) stands for the user's own arguments"
    if cmd.startswith("sbatch ") and not slurm_up():
        return "needs a Slurm cluster (tests/test_slurm.py runs the scripts on a local one)"
    m = re.match(r"^(\w+)\s", cmd)
    if m and m.group(1) in ("tensorboard",) and not shutil.which(m.group(1)):
        return f"needs the {m.group(1)} program, not installed here"
    if "--tensorboard" in cmd and not have_module("tensorboardX"):
        return "needs the tensorboard extra (tensorboardX), not installed here"
    if "local_cluster.sh" in cmd or "MPIPS_REQUIRE_SLURM=1" in cmd or "SLURM_CONF" in cmd:
        return "needs root, apt and a local Slurm (.ci/run starts one)"
    if re.search(r"bench/(bench_vs_torch|torch_ref)\.py", cmd) and not have_module("torch"):
        return "needs the bench extra (torch), not installed here"
    if "tools/check_docs.py --commands" in cmd:
        return "this checker itself"
    if "--plot" in cmd and not have_module("matplotlib"):
        return "needs matplotlib (the plot extra)"
    parts = [p.strip() for p in cmd.split("&&")]
    if all(INSTALL.match(p) for p in parts):
        return "an install step (CI installs from scratch in .ci/run)"
    return None


def in_small(cmd, sandbox):
    """The command as it runs here: install steps of a chain dropped, sizes cut, absolute
    data paths moved into the sandbox, the embedded set made small, pytest only collecting."""
    parts = [p.strip() for p in cmd.split("&&")]
    kept = [p for p in parts if not INSTALL.match(p)]
    notes = ["install steps left out"] if len(kept) < len(parts) else []
    cmd = " && ".join(kept)
    cmd = re.sub(r"(?<![\w/.])/(tmp|data)/", lambda m: f"{sandbox}/{m.group(1)}/", cmd)
    cmd = cmd.replace("$HOME/venvs", f"{sandbox}/venvs")

    def cut(m):
        flag, val = m.group(1), m.group(2)
        if flag in FIRST_OF_LIST:
            return f"{flag} {val.split(',')[0]}"
        small = SMALL[flag]
        try:
            return f"{flag} {min(float(val), small):g}"
        except ValueError:
            return m.group(0)

    flags = "|".join(re.escape(f) for f in list(SMALL) + list(FIRST_OF_LIST))
    cmd = re.sub(rf"({flags})[ =]([^\s]+)", cut, cmd)
    cmd = re.sub(r"\s\[--?\w[^\]]*\]", "", cmd)                # [--optional] parts: left out
    if re.search(r"python -m mpips\.train\b", cmd) and not re.search(
            r"--(train|stream|help|config)\b", cmd):
        cmd += " --synth-rows 4000 --synth-test-rows 1000 --cache-dir cache"
        notes.append("embedded set of 4000 rows")
    # what a benchmark writes into the repository by default goes to the scratch folder
    for script, flag, value in (("bench_scale.py", "--plot", "plot.png"),
                                ("bench_scale.py", "--out", "bench_scale.json"),
                                ("bench_workers.py", "--plot", "plot.png"),
                                ("bench_workers.py", "--json", "bench_workers.json")):
        if f"bench/{script}" in cmd and flag not in cmd and not (
                flag != "--plot" and "--replot" in cmd):
            cmd += f" {flag} {value}"
            if "outputs in the scratch folder" not in notes:
                notes.append("outputs in the scratch folder")
    if "--stream " in cmd and "--stream-timeout" not in cmd:
        cmd += " --stream-timeout 2"
    if re.match(r"curl\s", cmd):                # an HTTP error answer fails the command
        cmd = "curl --fail-with-body" + cmd[4:]
    if re.search(r"python -m pytest -q$", cmd):
        cmd += " --collect-only"
        notes.append("the suite collected, not run (CI runs it)")
    return cmd, notes


def fixtures(base, log):
    """What the pages take as given, made once: a small Criteo-format set at /data/criteo,
    a stream of passes at /data/stream, a run's checkpoint root `ckpt` (a base and deltas
    every batch) and metrics files (`metrics.jsonl`, `async.jsonl`, `sync.jsonl`), a sample
    of raw lines (`day_23_sample.txt`), and a stand-in for Criteo's `train.txt`."""
    steps = [
        "python -m data_prep.synth --rows 4000 --test-rows 1000 --parts 2 --out data/criteo",
        "python -m data_prep.stream_synth --out data/stream --days 1 --hours 2 --rows-per-pass 200",
        "python -m mpips.train --local --train data/criteo/train --test data/criteo/test "
        "--save-dir ckpt --save-every 1 --save-mode delta --metrics-out metrics.jsonl "
        "--print-every 1000",
        "cp metrics.jsonl async.jsonl && cp metrics.jsonl sync.jsonl",
        "head -n 20 data/criteo/test/part-00000.txt > day_23_sample.txt",
        "cat data/criteo/train/part-*.txt > train.txt",
    ]
    for s in steps:
        r = subprocess.run(s, shell=True, cwd=base, env=run_env(), capture_output=True, text=True)
        if r.returncode:
            log(f"fixture failed: {s}\n{r.stderr[-2000:]}")
            raise SystemExit(2)


def run_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    return env


REPO_LINKS = ("mpips", "data_prep", "bench", "tests", "tools", "jobs", ".ci", ".git", "setup.cfg")


def repo_status():
    """What a command might write into the repository: files not tracked (and not ignored),
    and tracked files other than sources and pages (a plot, a JSON), as git sees them.
    (Edits of .py and .md files are left out: those are a developer's, made meanwhile.)"""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                         text=True).stdout
    return "\n".join(line for line in out.splitlines()
                     if line.startswith("??") or not line.endswith((".py", ".md")))


def run_commands(pages, timeout, keep, log=print):
    """Run every command of the pages; [(page, line, command, status, detail, seconds)]."""
    base = tempfile.mkdtemp(prefix="mpips-docs-")
    results = []
    before = repo_status()
    try:
        log(f"scratch folder {base}; fixtures ...")
        fixtures(base, log)
        for page in pages:
            text = open(os.path.join(ROOT, page), encoding="utf-8").read()
            cmds = shell_commands(text)
            if not cmds:
                continue
            sandbox = os.path.join(base, re.sub(r"\W", "_", page))
            os.makedirs(sandbox)
            for name in REPO_LINKS:
                os.symlink(os.path.join(ROOT, name), os.path.join(sandbox, name))
            written = " ".join(c for _, c in cmds)
            for name in ("data", "ckpt", "metrics.jsonl", "async.jsonl", "sync.jsonl",
                         "day_23_sample.txt", "train.txt"):
                if re.search(rf"--(save-dir|out|metrics-out) {re.escape(name)}(\s|$)", written):
                    continue                       # the page makes its own
                src = os.path.join(base, name)
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(sandbox, name), symlinks=True)
                else:
                    shutil.copy(src, sandbox)
            for name, content in named_files(text).items():
                with open(os.path.join(sandbox, name), "w") as f:
                    f.write(content.replace("/data/", f"{sandbox}/data/"))
            port, server = str(free_port()), None
            for line, cmd in cmds:
                why = skip_reason(cmd)
                if why:
                    results.append((page, line, cmd, "skip", why, 0.0))
                    log(f"SKIP {page}:{line}: {cmd}\n     ({why})")
                    continue
                small, notes = in_small(cmd, sandbox)
                small = re.sub(r"(--port |localhost:|127\.0\.0\.1:)8500\b", rf"\g<1>{port}", small)
                t0 = time.perf_counter()
                if SERVERS.search(small):
                    if server is not None:
                        server.stop()
                    server = Background(small, sandbox)
                    ready = r"mpips\.serve: ready" if "mpips.serve" in small else r"http://"
                    status, detail = server.wait_ready(ready, SERVE_SECONDS)
                else:
                    status, detail = run_one(small, sandbox, timeout)
                dt = time.perf_counter() - t0
                if status == "pass":
                    detail = "; ".join(notes + ([detail] if detail else []))
                now = repo_status()
                if now != before:                  # a command wrote into the repository
                    status, detail = "FAIL", "changed the repository: " + " ".join(
                        sorted(set(now.split("\n")) - set(before.split("\n"))))
                    before = now
                results.append((page, line, cmd, status, detail, dt))
                log(f"{status.upper():4} {page}:{line} ({dt:.1f} s): {cmd}"
                    + (f"\n     ran: {small}" if small != cmd else "")
                    + (f"\n     {detail}" if detail else ""))
            if server is not None:
                server.stop()
    finally:
        if keep:
            log(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", action="store_true", help="check only the links")
    ap.add_argument("--commands", action="store_true", help="run only the commands")
    ap.add_argument("--only", action="append", help="a page (repeatable); default: all")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per command")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    a = ap.parse_args(argv)
    both = not (a.links or a.commands)
    pages = a.only or doc_files()
    bad = 0
    if a.links or both:
        problems = check_links(ROOT, pages)
        for p, n, t, why in problems:
            print(f"LINK {p}:{n}: {t}: {why}")
        print(f"links: {len(problems)} broken")
        bad += len(problems)
    if a.commands or both:
        res = run_commands(pages, a.timeout, a.keep)
        counts = {s: sum(1 for r in res if r[3] == s) for s in ("pass", "FAIL", "skip")}
        print(f"commands: {len(res)}: {counts['pass']} pass, {counts['FAIL']} fail, "
              f"{counts['skip']} skipped")
        bad += counts["FAIL"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
