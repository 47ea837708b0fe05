"""What the README and docs/ name exists: commands and their flags (against each CLI's --help),
files and folders of the tree, links and their anchors; and the README keeps its shape (the two
commands first, at most 150 lines of at most 100 columns)."""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
TOP = ("runtime/", "calib/", "csrc/", "benchmarks/", "tools/", "tests/", "docs/", "profiles/", ".ci/")
CLIS = {"s2moe": "s2moe.runtime.cli", "s2moe-calib": "s2moe.calib"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def code_spans(text: str) -> list[str]:
    """Inline code spans and code-block lines (a block's lines ending in \\ joined), in order."""
    out, block = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            block = [] if block is None else (out.extend(block) or None)
            continue
        if block is not None:
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1] + " " + line.strip()
            else:
                block.append(line)
            continue
        out.extend(re.findall(r"`([^`\n]+)`", line))
    return out


@functools.lru_cache(maxsize=None)
def help_flags(*argv: str) -> frozenset[str] | None:
    """The flags a command's --help names (typer's and argparse's alike); None where --help fails."""
    r = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    return option_flags(r.stdout) if r.returncode == 0 else None


def option_flags(help_text: str) -> frozenset[str]:
    """The flags of the option lines only (`  -m, --model <str>  …`, `  --out OUT`): a flag that a
    description mentions is not the command's."""
    flags = set()
    for line in help_text.splitlines():
        m = re.match(r"^[│ ]{1,6}(-[^\s].*?)(?:\s{2,}|$)", line)
        if m:
            flags |= set(FLAG.findall(m.group(1)))
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def subcommands(cli: str) -> frozenset[str]:
    r = subprocess.run([sys.executable, "-m", CLIS[cli], "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    section = r.stdout.split("Commands", 1)[1] if "Commands" in r.stdout else ""
    return frozenset(re.findall(r"^[│ ]*([a-z][a-z-]*)\s", section, flags=re.M))


def named_commands(span: str):
    """(argv for --help, the flags given to it) for each command invocation in a code span."""
    span = re.split(r"\s#\s", " " + span + " ")[0]  # a trailing comment is prose
    for part in re.split(r"\s(?:&&|\||;)\s", span):
        words = part.split()
        for i, w in enumerate(words):
            if w in CLIS and i + 1 < len(words) and re.fullmatch(r"[a-z][a-z-]*", words[i + 1]):
                yield (w, words[i + 1]), FLAG.findall(" ".join(words[i + 2:]))
                break
            if w.startswith(("benchmarks/", "tools/")) and w.endswith(".py") and "{" not in w:
                yield ("script", w), FLAG.findall(" ".join(words[i + 1:]))
                break


def all_flags() -> frozenset[str]:
    flags = set()
    for cli in CLIS:
        for sub in subcommands(cli):
            flags |= help_flags("-m", CLIS[cli], sub) or set()
    return frozenset(flags)


def _pages_spans():
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            yield page, code_spans(f.read())


def test_readme_keeps_its_shape():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it to 150 (details go to docs/)"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not wide, f"README.md lines over 100 columns: {wide}"
    blocks = [i for i, line in enumerate(lines) if line.startswith("```bash")]
    first, second = lines[blocks[0] + 1], lines[blocks[1] + 1]
    assert first.startswith("pip install -e . && s2moe run"), first
    assert first.split("&&")[1].split()[:2] == ["s2moe", "run"] and "--model" not in first  # the embedded model
    assert second == 'pip install -e ".[dev]" && python -m pytest -q', second
    assert "issue" not in " ".join(lines).lower(), "the README speaks of the software, not of issues"


def test_every_command_and_flag_named_exists():
    missing = []
    for page, spans in _pages_spans():
        for span in spans:
            for (kind, name), flags in named_commands(span):
                if kind == "script":
                    path = os.path.join(ROOT, name)
                    if not os.path.exists(path):
                        missing.append(f"{_rel(page)}: {name} does not exist")
                        continue
                    known = help_flags(path)
                    if known is not None and name == "benchmarks/ab.py":  # --a/--b carry s2moe bench's flags
                        known |= help_flags("-m", CLIS["s2moe"], "bench") or set()
                else:
                    if name not in subcommands(kind):
                        missing.append(f"{_rel(page)}: `{kind} {name}` is not a command")
                        continue
                    known = help_flags("-m", CLIS[kind], name)
                if known is None:
                    missing.append(f"{_rel(page)}: {name} --help fails")
                    continue
                missing += [f"{_rel(page)}: `{kind} {name}` has no {f}" for f in flags if f not in known]
    assert not missing, "\n".join(missing)


# Other programs' flags the pages name, each with its program.
FOREIGN = {"--repack": "llama-bench", "--no-repack": "llama-completion", "--load-mode": "llama-completion",
           "--draft-expert-topk": "the published code", "--moe-reuse-expert-cap": "the published code",
           "--prune-bandwidth": "the published code", "--draft": "the published code"}


def test_every_flag_named_alone_exists_somewhere():
    """A flag in a code span of its own (`--budget`) is some command's, or another program's we name."""
    known = all_flags() | {"--help", "--version"} | set(FOREIGN)
    missing = []
    for page, spans in _pages_spans():
        for span in spans:
            if any(True for _ in named_commands(span)):
                continue
            if re.fullmatch(r"--[a-z][a-z0-9-]*(?:[ =][^`]*)?", span.strip()):
                flag = FLAG.match(span.strip()).group(0)
                if flag not in known and not _script_flag(flag):
                    missing.append(f"{_rel(page)}: {flag}")
    assert not missing, "flags no command has:\n" + "\n".join(sorted(set(missing)))


@functools.lru_cache(maxsize=None)
def _script_flags() -> frozenset[str]:
    flags = set()
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) + glob.glob(os.path.join(ROOT, "tools", "*.py")):
        with open(path, encoding="utf-8") as f:
            flags |= set(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", f.read()))
    return frozenset(flags)


def _script_flag(flag: str) -> bool:
    return flag in _script_flags()


PATH = re.compile(r"^(?:(?:\.ci/|runtime/|calib/|csrc/|benchmarks/|tools/|tests/|docs/|profiles/|shared/)[\w./*{},-]*"
                  r"|setup\.py|pyproject\.toml|README\.md)$")


def test_every_file_named_exists():
    missing = []
    for page, spans in _pages_spans():
        for span in spans:
            for word in span.split():
                word = word.strip("(),;:'\"").split("::")[0]
                if not PATH.match(word) or "{" in word:
                    continue
                pattern = os.path.join(ROOT, word)
                if not (glob.glob(pattern) or glob.glob(pattern.rstrip("/"))):
                    missing.append(f"{_rel(page)}: {word}")
    assert not missing, "named but not in the tree:\n" + "\n".join(sorted(set(missing)))


def _anchors(path: str) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    out, fenced = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            fenced ^= line.lstrip().startswith("```")
            if line.startswith("#") and not fenced:
                title = line.lstrip("#").strip().lower()
                slug = re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title))
                n = 0
                while (slug if n == 0 else f"{slug}-{n}") in out:  # a repeated heading gets -1, -2, …
                    n += 1
                out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, flags=re.M)
        for link in links:
            if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
                continue
            target, _, anchor = link.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            if not os.path.exists(path):
                broken.append(f"{_rel(page)}: {link} (no file)")
            elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                broken.append(f"{_rel(page)}: {link} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("image", ["speed-vs-budget.png", "time-split.png", "predicted-vs-measured.png"])
def test_each_figure_exists_and_is_shown(image):
    path = os.path.join(ROOT, "docs", "img", image)
    assert os.path.getsize(path) > 1000, f"{image}: run python benchmarks/plots.py"
    shown = [p for p in PAGES if f"img/{image}" in open(p, encoding="utf-8").read()]
    assert shown, f"no page shows docs/img/{image}"


def _cited(text: str, files: set[str]) -> set[str]:
    """Results files a page cites: an exact path, a stem glob (`docs/results/peer.*`), a brace list
    or a folder (`docs/results/predict-default/`); not the results folder named in general."""
    hits = set()
    for cite in re.findall(r"docs/results/[^\s`)(\[\]'\",;|]*", text):
        cite = cite.rstrip(".:")
        alts = [cite]
        if m := re.search(r"\{([^{}]*)\}", cite):
            alts = [cite[:m.start()] + a + cite[m.end():] for a in m.group(1).split(",")]
        for c in alts:
            if c.rstrip("/") == "docs/results" or re.fullmatch(r"docs/results/\*[^/]*", c):
                continue  # the folder in general (`docs/results/`, `docs/results/*.json`) cites no record
            if c.endswith("/") or os.path.isdir(os.path.join(ROOT, c)):
                hits |= {f for f in files if f.startswith(c.rstrip("/") + "/")}
            elif "*" in c:
                pattern = re.compile(re.escape(c).replace(r"\*", "[^/]*") + r"\Z")
                hits |= {f for f in files if pattern.match(f)}
            elif c in files:
                hits.add(c)
    return hits


def test_results_are_the_records_a_page_cites():
    files = {_rel(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(ROOT, "docs", "results")) for f in fs}
    files.discard("docs/results/README.md")  # the index itself
    assert len(files) <= 100, f"docs/results holds {len(files)} records; keep those a current claim cites"
    cited = set()
    for page in PAGES:
        if _rel(page) != "docs/results/README.md":  # the index lists them all; a page must cite each
            with open(page, encoding="utf-8") as f:
                cited |= _cited(f.read(), files)
    assert not files - cited, "records no page cites:\n" + "\n".join(sorted(files - cited))


def test_each_benchmark_backs_a_named_claim_and_has_help():
    scripts = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
    scripts = [s for s in scripts if os.path.basename(s) not in ("__init__.py", "common.py")]
    assert len(scripts) <= 20, f"{len(scripts)} benchmarks; keep the maintained ones"
    text = "".join(open(p, encoding="utf-8").read() for p in PAGES)
    problems = []
    for path in scripts:
        name = _rel(path)
        if name not in text:
            problems.append(f"{name}: no page names it")
        with open(path, encoding="utf-8") as f:
            doc = re.match(r'\s*(?:#[^\n]*\n\s*)*"""(.*?)"""', f.read(), flags=re.S)
        if not doc or not re.search(r"docs/[\w/.-]+\.md|README\.md", doc.group(1).split("\n\n")[0]):
            problems.append(f"{name}: its docstring does not open by naming the docs it backs")
        if help_flags(path) is None:
            problems.append(f"{name}: --help fails")
    assert not problems, "\n".join(problems)


def _section(path: str, anchor: str) -> str:
    """A page's text from the heading with ``anchor`` to the next heading of its level or above."""
    lines = open(path, encoding="utf-8").read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            if re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)) == anchor:
                level = len(line) - len(line.lstrip("#"))
                end = next((j for j in range(i + 1, len(lines))
                            if lines[j].startswith("#") and len(lines[j]) - len(lines[j].lstrip("#")) <= level), len(lines))
                return "\n".join(lines[i:end])
    return ""


def test_readme_results_quote_their_sections():
    """Every figure in a README results row appears in the section the row links to."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    refs = dict(re.findall(r"^\[(\w+)\]:\s*(\S+)", text, flags=re.M))
    rows = [line for line in text.splitlines() if line.startswith("| ") and re.search(r"\]\[\w+\] \|$", line)]
    assert len(rows) >= 4
    missing = []
    for row in rows:
        ref = re.search(r"\]\[(\w+)\] \|$", row).group(1)
        page, _, anchor = refs[ref].partition("#")
        section = _section(os.path.join(ROOT, page), anchor)
        assert section, f"{refs[ref]}: no such section"
        result = row.split("|")[2]
        for number in re.findall(r"\d+\.\d+", result):
            if number not in section:
                missing.append(f"{number} ({row.split('|')[1].strip()}) not in {refs[ref]}")
    assert not missing, "\n".join(missing)
