"""The docs' measured figures, written from the results JSON so that they cannot go stale.

The markdown stays what people edit. Each figure that comes from a measurement carries an
invisible marker naming where it comes from, and what is between the marker's two halves is
the figure as rendered:

    <!--fig workers:GIL-bound/process_over_serial {:.2f}x-->1.74x<!--/fig-->

`workers` is `kernels_bench/results/workers.json` (any path under `results/`, less `.json`);
`GIL-bound/process_over_serial` is the value's path in it (`value` says how a path is read);
`{:.2f}x` is how it is written (`str.format`, one field, no spaces). A path may end in `*1e3`
(or any number) to change the unit first: seconds to ms, a fraction to a percentage. Bold and
units with a space (`%`, `µs`) stay outside the marker.

    python -m kernels_bench.figures            # rewrite every marked figure from its JSON
    python -m kernels_bench.figures --check    # change nothing; list each that differs, exit 1

After running a benchmark, run it to update README.md and docs/*.md; `tests/test_figures.py`
runs the check, so a figure that no longer matches its JSON fails the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernels_bench.harness import REPO_DIR, RESULTS_DIR

MARKER = re.compile(
    r"<!--fig (?P<source>[^:\s]+):(?P<path>[^*>]+?)(?:\*(?P<scale>[0-9.e+-]+))?"
    r" (?P<fmt>[^\s>]*\{[^}]*\}[^\s>]*)-->(?P<shown>.*?)<!--/fig-->"
)
"""A marked figure; `shown` is what the page shows now."""


RESULTS_PAGE = REPO_DIR / "docs" / "results.md"
"""The page whose tables may show no measured number without a marker."""


def docs(repo_dir: Path = REPO_DIR) -> list[Path]:
    """The pages whose figures are rendered: README.md and docs/*.md."""
    return [repo_dir / "README.md", *sorted((repo_dir / "docs").glob("*.md"))]


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """One marked figure of a page, as the page shows it and as its JSON gives it."""

    page: Path
    line: int
    source: str
    path: str
    shown: str
    rendered: str | None
    """None where the source or the path does not exist (then `error` says which)."""
    error: str | None = None

    def __str__(self) -> str:
        where = f"{_relative(self.page)}:{self.line}"
        if self.error:
            return f"{where}: {self.error}"
        source = f"{self.source}:{self.path}"
        return f"{where}: shows {self.shown!r}, JSON gives {self.rendered!r} ({source})"


def value(data: Any, path: str) -> Any:
    """The value at `path` in a results JSON: its keys joined by `/`.

    A harness report (`Report.as_dict`) is read as its cases: `CASE/METRIC` is the metric's
    median, and `CASE/METRIC/min` (`max`, `reps`), `CASE/params/...` and top-level keys
    (`settings/reps`) go further. Any other JSON is read by its keys alone (`runs/fast/passed`).
    """
    node = data
    for key in path.split("/"):
        if isinstance(node, dict) and key not in node:
            # A report's root holds its cases; a case holds its metrics.
            node = node.get("cases", node.get("metrics", node))
        if isinstance(node, list):
            node = next((e for e in node if isinstance(e, dict) and e.get("case") == key), None)
            if node is None:
                raise KeyError(f"no case {key!r}")
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise KeyError(f"no {key!r}")
    if isinstance(node, dict) and "median" in node:
        node = node["median"]
    return node


@functools.cache
def _load(path: Path, mtime_ns: int) -> Any:
    """A JSON file's contents, read once per version of it."""
    return json.loads(path.read_text())


def render(match: re.Match, results_dir: Path = RESULTS_DIR) -> str:
    """The figure a marker names, written in its format; KeyError where its source lacks it."""
    file = results_dir / f"{match['source']}.json"
    if not file.is_file():
        raise KeyError(f"no file {_relative(file)}")
    try:
        found = value(_load(file, file.stat().st_mtime_ns), match["path"])
    except KeyError as err:
        raise KeyError(f"{match['source']}:{match['path']}: {err.args[0]}") from None
    if match["scale"]:
        found *= float(match["scale"])
    return match["fmt"].format(found)


def figures(page: Path, results_dir: Path = RESULTS_DIR) -> Iterator[Figure]:
    """Every marked figure of `page`, in order."""
    text = page.read_text()
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        common = dict(page=page, line=line, source=match["source"], path=match["path"])
        before = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
        if before.count("`") % 2:
            # In a code span the marker would show as text.
            yield Figure(**common, shown=match["shown"], rendered=None, error="marker in code")
            continue
        try:
            yield Figure(**common, shown=match["shown"], rendered=render(match, results_dir))
        except KeyError as err:
            yield Figure(**common, shown=match["shown"], rendered=None, error=err.args[0])


def rewrite(page: Path, results_dir: Path = RESULTS_DIR) -> bool:
    """Writes each marked figure of `page` as its JSON gives it; True if the page changed.

    A marker whose source or path is missing keeps what it shows (`figures` reports it).
    """
    text = page.read_text()

    def new(match: re.Match) -> str:
        try:
            shown = render(match, results_dir)
        except KeyError:
            return match[0]
        return match[0][: match.start("shown") - match.start()] + shown + "<!--/fig-->"

    updated = MARKER.sub(new, text)
    if updated != text:
        page.write_text(updated)
    return updated != text


def unmarked_in_tables(page: Path) -> list[str]:
    """The measured cells of `page`'s tables that hold a number outside a marker.

    The rule: in a table with a column headed `figure`, that column is measured; in any other
    table, every column but the first (which names the case) is. A measured cell may hold no
    digit once its marked figures are taken out: a number there either comes from a JSON or
    is not shown. The other columns (the question, the case, the target) hold settings and
    thresholds, and are not checked.
    """
    found = []
    header: list[str] | None = None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(line) <= set("|-: "):
            continue
        measured = [header.index("figure")] if "figure" in header else range(1, len(cells))
        for column in measured:
            rest = MARKER.sub("", cells[column]) if column < len(cells) else ""
            if re.search(r"\d", rest):
                found.append(f"{_relative(page)}:{number}: unmarked number in {cells[column]!r}")
    return found


def check(pages: list[Path], results_dir: Path = RESULTS_DIR) -> list[str]:
    """Each marked figure of `pages` that differs from its JSON or cannot be rendered."""
    return [
        str(figure)
        for page in pages
        for figure in figures(page, results_dir)
        if figure.error or figure.shown != figure.rendered
    ]


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_DIR))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; list problems")
    args = parser.parse_args(argv)
    pages = docs()
    if not args.check:
        for page in pages:
            if rewrite(page):
                print(f"updated {_relative(page)}")
    problems = check(pages) + unmarked_in_tables(RESULTS_PAGE)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
