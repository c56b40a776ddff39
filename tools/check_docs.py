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
import shlex
import shutil
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
