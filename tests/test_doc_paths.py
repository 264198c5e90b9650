"""Every repository path README.md and docs/*.md name exists: in inline code, fenced code blocks
and markdown links, whatever starts like a path in this repository (aioprefill/, benchmarks/,
tests/, docs/, examples/, .ci/, dev.py, pyproject.toml). A renamed or moved file then fails here,
naming the doc, the line and the path, instead of leaving a reader at a dead end.

What a name may carry and still count: a `:line` or `::test` suffix, trailing punctuation, a glob
(`tests/kvstore/*.py`), `{a,b}` alternatives, `<placeholder>` or `...` parts (each matches
anything), a `#anchor` on a link, a `.attribute` after a module
(`tests/reliability/util.until_sent`)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PREFIXES = ("aioprefill/", "benchmarks/", "tests/", "docs/", "examples/", ".ci/")
FILES = ("dev.py", "pyproject.toml")
# A path-like word: starts at a word boundary (not inside `/work/x/tests/...` or `DIR/benchmarks/`).
_WORD = re.compile(
    r"(?<![\w./~$-])(?:(?:aioprefill|benchmarks|tests|docs|examples|\.ci)/"
    r"(?:[^\s`'\"<>()\[\]{}|,;]|\{[^{}\s]*\}|<[^\s<>]*>)*|(?:dev\.py|pyproject\.toml)(?![\w.]))"
)
_INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_EXTENSIONS = {"py", "md", "txt", "json", "jsonl", "png", "sh", "yaml", "toml", "gguf", "jinja"}


def _spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span, fenced-block line and link target."""
    out: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((n, line))
            continue
        out += [(n, m.group(2)) for m in _INLINE.finditer(line)]
        out += [(n, "link:" + m.group(1)) for m in _LINK.finditer(line)]
    return out


def _clean(word: str) -> str:
    word = word.split("::", 1)[0]  # pytest selector
    word = re.sub(r":[\w.-]*$", "", word)  # :line, :Name
    word = word.split("#", 1)[0]  # anchor
    return word.rstrip(".,:;!?)'\"`*")


def _candidates(word: str) -> list[str]:
    """`{a,b}` alternatives expanded, `<x>` and `...` turned into globs."""
    parts = re.split(r"\{([^{}]*)\}", word)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    out = []
    for combo in itertools.product(*options):
        w = "".join(combo)
        w = re.sub(r"<[^>]*>", "*", w).replace("...", "*")
        out.append(w)
        attr = re.search(r"\.([A-Za-z_]\w*)$", w)
        if attr and attr.group(1) not in _EXTENSIONS:
            out.append(w[: attr.start()] + ".py")  # module.attribute
    return out


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).exists()


def named_paths(text: str, base: Path) -> list[tuple[int, str]]:
    """(line, path) for every repository path a page in folder `base` names."""
    found = []
    for n, span in _spans(text):
        if span.startswith("link:"):
            target = span[5:].split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):  # http:, mailto:
                continue
            try:
                rel = (base / target).resolve().relative_to(ROOT).as_posix()
            except ValueError:  # outside the repository
                continue
            found.append((n, rel))
            continue
        found += [(n, _clean(m.group(0))) for m in _WORD.finditer(span)]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_named_path_exists(doc: Path) -> None:
    missing = [
        f"{doc.relative_to(ROOT)}:{n}: {word}"
        for n, word in named_paths(doc.read_text(), doc.parent)
        if not any(_exists(c) for c in _candidates(word))
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_checker_reads_what_it_should() -> None:
    """The parsing, on a made-up page: suffixes stripped, globs and placeholders kept."""
    page = (
        "See `aioprefill/loop.py:12`, `tests/test_engine.py::test_x`, (`dev.py`).\n"
        "Run `python benchmarks/bench_engine.py --quick` and [this](serving.md#keys).\n"
        "Not a path: `/work/main/tests/x.py`, `DIR/benchmarks/y.py`, `aioprefill.serve`.\n"
        "```sh\npython3 tests/refvenv.py\n```\n"
        "`benchmarks/results/prefix/prefix_noreuse_sim_gap.{txt,json}`, `tests/kvstore/*.py`.\n"
        "Out of the repository: [up](../../x.md), [web](https://example.com/tests/x.py).\n"
    )
    assert named_paths(page, ROOT / "docs") == [
        (1, "aioprefill/loop.py"),
        (1, "tests/test_engine.py"),
        (1, "dev.py"),
        (2, "benchmarks/bench_engine.py"),
        (2, "docs/serving.md"),
        (5, "tests/refvenv.py"),
        (7, "benchmarks/results/prefix/prefix_noreuse_sim_gap.{txt,json}"),
        (7, "tests/kvstore/*.py"),
    ]
    assert _candidates("a/b.{txt,json}") == ["a/b.txt", "a/b.json"]
    assert _candidates("benchmarks/studies/<topic>/") == ["benchmarks/studies/*/"]
    assert _candidates("results/vs_ct2_zen5_...json") == ["results/vs_ct2_zen5_*json"]
    assert "tests/reliability/util.py" in _candidates("tests/reliability/util.until_sent")
