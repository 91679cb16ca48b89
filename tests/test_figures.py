"""The docs' measured figures equal the results JSON they come from (`kernels_bench.figures`),
and the suite's own figures are recorded by `kernels_bench.suite`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kernels_bench import figures, suite

REPORT = {
    "name": "bench",
    "settings": {"reps": 5},
    "cases": [
        {
            "case": "A: fast, depth 2",
            "params": {"stats": {"bound": 0.0029}},
            "metrics": {"ratio": {"median": 1.7392, "min": 1.5969, "max": 2.4560, "reps": []}},
        }
    ],
}


def page_and_results(tmp_path: Path, text: str, **results: dict) -> Path:
    """A page of `text` beside a results folder holding each of `results` as `<name>.json`."""
    (tmp_path / "results").mkdir()
    for name, data in results.items():
        (tmp_path / "results" / f"{name}.json").write_text(json.dumps(data))
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent(text))
    return page


def test_every_marked_figure_of_the_docs_equals_its_json():
    stale = figures.check(figures.docs())
    assert not stale, "run `python -m kernels_bench.figures`:\n" + "\n".join(stale)


def test_the_results_tables_show_no_unmarked_measured_number():
    assert figures.unmarked_in_tables(figures.RESULTS_PAGE) == []


def test_the_docs_mark_their_figures():
    pages = {page.name: list(figures.figures(page)) for page in figures.docs()}
    assert len(pages["results.md"]) > 200
    assert pages["README.md"] and pages["torch.md"] and pages["multi-host.md"]


def test_value_reads_a_report_by_case_and_metric_and_other_json_by_keys():
    assert figures.value(REPORT, "A: fast, depth 2/ratio") == 1.7392
    assert figures.value(REPORT, "A: fast, depth 2/ratio/min") == 1.5969
    assert figures.value(REPORT, "A: fast, depth 2/params/stats/bound") == 0.0029
    assert figures.value(REPORT, "settings/reps") == 5
    assert figures.value({"runs": {"fast": {"passed": 976}}}, "runs/fast/passed") == 976
    for path in ("B/ratio", "A: fast, depth 2/speed", "A: fast, depth 2/ratio/p99", "runs"):
        with pytest.raises(KeyError):
            figures.value(REPORT, path)


def test_a_stale_figure_is_reported_where_it_is_then_rewritten(tmp_path):
    page = page_and_results(
        tmp_path,
        """\
        # Figures
        right: **<!--fig bench:A: fast, depth 2/ratio {:.2f}x-->1.74x<!--/fig-->**
        stale: <!--fig bench:A: fast, depth 2/ratio/max {:.2f}-->2.40<!--/fig--> and
        scaled: <!--fig bench:A: fast, depth 2/params/stats/bound*1e2 {:.1f}-->0.3<!--/fig-->
        """,
        bench=REPORT,
    )
    results = tmp_path / "results"
    problems = figures.check([page], results)
    assert len(problems) == 1
    assert problems[0].endswith(
        "page.md:3: shows '2.40', JSON gives '2.46' (bench:A: fast, depth 2/ratio/max)"
    )

    assert figures.rewrite(page, results)
    assert "stale: <!--fig bench:A: fast, depth 2/ratio/max {:.2f}-->2.46<!--/fig--> and" in (
        page.read_text()
    )
    assert figures.check([page], results) == []
    assert not figures.rewrite(page, results)


def test_a_marker_naming_a_missing_value_or_in_code_fails(tmp_path):
    text = """\
        <!--fig absent:A/ratio {:.2f}-->1.00<!--/fig-->
        <!--fig bench:B: slow/ratio {:.2f}-->1.00<!--/fig-->
        <!--fig bench:A: fast, depth 2/speed {:.2f}-->1.00<!--/fig-->
        `--reps <!--fig bench:settings/reps {}-->5<!--/fig-->`
        """
    page = page_and_results(tmp_path, text, bench=REPORT)
    problems = figures.check([page], tmp_path / "results")
    assert [p.split("page.md:")[1] for p in problems] == [
        f"1: no file {tmp_path / 'results' / 'absent.json'}",
        "2: bench:B: slow/ratio: no case 'B: slow'",
        "3: bench:A: fast, depth 2/speed: no 'speed'",
        "4: marker in code",
    ]
    assert not figures.rewrite(page, tmp_path / "results")
    assert page.read_text() == textwrap.dedent(text)


def test_a_number_outside_a_marker_in_a_measured_cell_is_found(tmp_path):
    mark = "<!--fig bench:A: fast, depth 2/ratio {:.2f}-->1.74<!--/fig-->"
    page = page_and_results(
        tmp_path,
        f"""\
        | question | case, 2 MB | figure | target |
        |---|---|---|---|
        | marked | 4 MB | **{mark}** (bare {mark}) | >= 1.8 |
        | unmarked | 4 MB | {mark} / 0.99 | >= 1.8 |

        | case | steady | first epoch |
        |---|---|---|
        | 16 MB | {mark} | 1.01 |
        """,
    )
    assert figures.unmarked_in_tables(page) == [
        f"{page}:4: unmarked number in '{mark} / 0.99'",
        f"{page}:8: unmarked number in '1.01'",
    ]


def test_parse_summary_reads_the_counts_and_seconds_of_pytest():
    output = (
        "....s.F\nFAILED tests/test_x.py::test_y\n"
        "1 failed, 5 passed, 1 skipped, 3 warnings, 1 error in 2.50s\n"
    )
    assert suite.parse_summary(output) == {
        **{count: 0 for count in suite.COUNTS},
        "passed": 5,
        "failed": 1,
        "skipped": 1,
        "warnings": 3,
        "errors": 1,
        "pytest_s": 2.5,
    }
    banner = "===== 1176 passed, 45 skipped, 12 deselected in 153.21s (0:02:33) =====\n"
    assert suite.parse_summary(banner)["passed"] == 1176
    assert suite.parse_summary(banner)["deselected"] == 12
    with pytest.raises(ValueError, match="no pytest summary line"):
        suite.parse_summary("Traceback (most recent call last):\nKeyboardInterrupt\n")


def test_suite_records_each_run_by_name_in_suite_json(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "pytest.ini").write_text("[pytest]\n")
    (target / "test_tiny.py").write_text(
        textwrap.dedent(
            """\
            import pytest

            def test_one(): pass
            def test_two(): pass
            def test_three(): assert False
            @pytest.mark.skip(reason="tiny")
            def test_four(): pass
            """
        )
    )
    out = tmp_path / "results"
    argv = ["--out-dir", str(out), "{}", "--", str(target), "-p", "no:cacheprovider"]

    assert suite.main([a.format("tiny") for a in argv]) == 1  # pytest's own exit status
    assert suite.main([a.format("again") for a in argv]) == 1

    runs = json.loads((out / "suite.json").read_text())["runs"]
    assert set(runs) == {"tiny", "again"}
    run = runs["tiny"]
    assert (run["passed"], run["failed"], run["skipped"], run["errors"]) == (2, 1, 1, 0)
    assert run["returncode"] == 1
    assert run["command"].startswith("python -m pytest -q ") and str(target) in run["command"]
    assert 0 < run["pytest_s"] <= run["wall_s"]
    assert run["wall_min"] == pytest.approx(run["wall_s"] / 60, abs=0.01)
    assert run["environment"]["git_commit"] and run["environment"]["cpu_count"]
    assert figures.value(json.loads((out / "suite.json").read_text()), "runs/again/passed") == 2


def test_suite_refuses_a_run_it_does_not_know_without_pytest_arguments(capsys):
    with pytest.raises(SystemExit):
        suite.main(["nightly"])
    assert "give its pytest arguments after --" in capsys.readouterr().err
