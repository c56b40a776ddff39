"""The docs' links resolve: every relative link and image of README.md and docs/**/*.md names
a file of the repository and, with #anchor, a heading of that file; file paths and module
names quoted in them exist.  (The docs' shell commands are run by `python tools/check_docs.py
--commands`, minutes long, not part of the suite.)"""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("check_docs", os.path.join(ROOT, "tools", "check_docs.py"))
check_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_docs)


def test_every_doc_link_resolves():
    problems = check_docs.check_links(ROOT)
    assert not problems, "\n".join(f"{p}:{n}: {t}: {why}" for p, n, t, why in problems)


def test_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 200


def test_the_checker_finds_what_is_broken(tmp_path):
    """A page with a missing file, a missing anchor, a moved module and a good link: the
    checker reports exactly the three bad ones (links inside code blocks are not links)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "mpips").mkdir()
    (tmp_path / "mpips" / "__init__.py").write_text("")
    (tmp_path / "mpips" / "config.py").write_text("X = 1\n\ndef parse_args():\n    pass\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# Title\n\n## The `--flag` rule, measured (2x)\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n[ok](docs/a.md#the---flag-rule-measured-2x) [gone](docs/b.md)\n"
        "[bad anchor](docs/a.md#nope) `mpips.config.parse_args` `mpips.config.MEANING`\n"
        "```sh\n[not a link](nowhere.md)\n```\n[web](https://example.org/x)\n")
    got = [(p, t, why) for p, _, t, why in check_docs.check_links(str(tmp_path))]
    assert got == [("README.md", "docs/b.md", "no such file"),
                   ("README.md", "docs/a.md#nope", "no heading with anchor #nope"),
                   ("README.md", "mpips.config.MEANING", "mpips.config has no MEANING")]
    assert check_docs.slug("The `--flag` rule, measured (2x)") == "the---flag-rule-measured-2x"


def test_commands_are_read_and_made_small_as_the_checker_says():
    """The command reader joins continuations and quoted strings over lines and drops
    comments; in small, sizes are cut, lists of worker counts keep their first, absolute
    data paths move into the scratch folder, and [--optional] parts go (JSON stays)."""
    page = ("text\n```sh\n# a comment\npython -m x --rows 1000000 \\\n    --real 2,4,8   # cut\n"
            "curl -s localhost:8500/v1 -d '{\"a\": [1,\n  2]}'\n```\n```toml\n# file: run.toml\n"
            "epochs = 3\n```\n")
    cmds = [c for _, c in check_docs.shell_commands(page)]
    assert cmds == ["python -m x --rows 1000000 --real 2,4,8",
                    "curl -s localhost:8500/v1 -d '{\"a\": [1,\n2]}'"]
    assert check_docs.named_files(page) == {"run.toml": "epochs = 3\n"}
    small, _ = check_docs.in_small(cmds[0] + " --out /tmp/d [--dtype float16]", "/S")
    assert small == "python -m x --rows 4000 --real 2 --out /S/tmp/d"
    small, _ = check_docs.in_small(cmds[1], "/S")
    assert small.startswith("curl --fail-with-body -s") and "[1,\n2]" in small
    assert check_docs.skip_reason("python -m mpips.train --local ...")
    assert check_docs.skip_reason("pip install -e '.[plot]'")
    assert check_docs.skip_reason("python -m mpips.train --local") is None


def test_every_page_is_in_the_index():
    """Every page of docs/ is linked from docs/README.md (the guide and the studies index)."""
    index = open(os.path.join(ROOT, "docs", "README.md"), encoding="utf-8").read()
    linked = {os.path.normpath(os.path.join("docs", m.group(1).split("#")[0]))
              for m in check_docs.LINK.finditer(index)}
    pages = {p for p in check_docs.doc_files(ROOT) if p.startswith("docs" + os.sep)}
    assert pages - linked == {os.path.join("docs", "README.md")}
