"""Environment variables: every `FEEDPIPE_*` one is declared and read in `feedpipe.core.env` and
listed in docs/environment.md, each grammar takes every spelling it promises, and a bad value is
refused naming the variable, the rule, the value and the fix."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import feedpipe
from feedpipe.core import env

PACKAGE = Path(feedpipe.__file__).parent
DOC = PACKAGE.parent / "docs" / "environment.md"
NAME = re.compile(r"FEEDPIPE_[A-Z0-9_]*[A-Z0-9]")


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_feedpipe_variable_named_in_the_package_is_declared_in_env():
    named = {
        (name, path.relative_to(PACKAGE).as_posix())
        for path in modules()
        for name in NAME.findall(path.read_text())
    }
    undeclared = sorted(f"{name} in {where}" for name, where in named if name not in env.VARIABLES)
    assert undeclared == []


def test_every_declared_variable_is_listed_in_the_doc_with_its_grammar():
    rows = {
        match.group(1): line
        for line in DOC.read_text().splitlines()
        if (match := re.match(r"\| `(FEEDPIPE_\w+)` \|", line))
    }
    assert sorted(rows) == sorted(env.VARIABLES)
    wrong = [name for name, row in rows.items() if f"| {env.VARIABLES[name].grammar}" not in row]
    assert wrong == []


def environ_reads(tree: ast.AST) -> list[tuple[int, ast.expr | None]]:
    """Each read of one environment variable in `tree` (`os.environ[key]`, `.get(key)`,
    `.pop(key)`, `.setdefault(key)`, `key in os.environ`, `os.getenv(key)`), with its key;
    a use of the whole mapping (a copy, a comparison, `update`) reads none by name."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            by_key = node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value)
            if by_key or node.func.attr == "getenv":
                reads.append((node.lineno, node.args[0] if node.args else None))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            if is_environ(node.comparators[0]):
                reads.append((node.lineno, node.left))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            reads += [(node.lineno, None) for a in node.names if a.name in ("environ", "getenv")]
    return reads


def test_no_module_but_env_reads_a_feedpipe_variable():
    """Elsewhere a variable is read by its literal name, and that name is none of feedpipe's
    (`KERAS_BACKEND`, `WORLD_SIZE`), so every `FEEDPIPE_*` one takes the grammar of its kind."""
    outside = []
    for path in modules():
        if path == PACKAGE / "core" / "env.py":
            continue
        for line, key in environ_reads(ast.parse(path.read_text())):
            literal = isinstance(key, ast.Constant) and isinstance(key.value, str)
            if not literal or key.value.startswith("FEEDPIPE_"):
                outside.append(f"{path.relative_to(PACKAGE)}:{line}")
    assert outside == []


def test_the_check_finds_a_read_of_a_feedpipe_variable_by_any_name():
    source = (
        "import os\nNAME = 'FEEDPIPE_X'\nos.environ.get('FEEDPIPE_X')\nos.environ[NAME]\n"
        "NAME in os.environ\nos.getenv('HOME')\n{**os.environ}\nos.environ.update({})\n"
        "os.environ != {}\n"
    )
    reads = environ_reads(ast.parse(source))
    assert [line for line, _ in reads] == [3, 4, 5, 6]


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false", "No", " 0 "])
def test_every_spelling_of_off_turns_a_switch_off(monkeypatch, value):
    monkeypatch.setenv(env.PAGE_LOCK, value)
    assert env.switched_off(env.PAGE_LOCK)


@pytest.mark.parametrize("value", ["1", "on", "True", "YES", "", "  "])
def test_every_spelling_of_on_and_blank_leave_a_switch_on(monkeypatch, value):
    monkeypatch.setenv(env.COPY_STREAM, value)
    assert not env.switched_off(env.COPY_STREAM)


def test_an_unset_variable_takes_its_default(monkeypatch):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert env.count(env.WARM_WORKERS) is None
    assert env.seconds(env.WARM_IDLE_S, 300.0) == 300.0
    assert env.nbytes(env.AVAILABLE_BYTES) is None
    assert not env.switched_off(env.PAGE_LOCK)
    monkeypatch.setenv(env.AGREEMENT_TIMEOUT_S, " ")
    assert env.seconds(env.AGREEMENT_TIMEOUT_S, 300.0) == 300.0


@pytest.mark.parametrize(
    ("value", "count"), [("3", 3), (" 8 ", 8), ("0", 0), ("off", 0), ("no", 0)]
)
def test_a_count_that_may_be_zero_takes_off_for_zero(monkeypatch, value, count):
    monkeypatch.setenv(env.WARM_WORKERS, value)
    assert env.count(env.WARM_WORKERS) == count


def test_seconds_and_bytes_take_their_numbers(monkeypatch):
    monkeypatch.setenv(env.WARM_IDLE_S, "0.25")
    monkeypatch.setenv(env.AVAILABLE_BYTES, "1073741824")
    assert env.seconds(env.WARM_IDLE_S) == 0.25
    assert env.nbytes(env.AVAILABLE_BYTES) == 2**30


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        (env.GATHER_THREADS, "0", "must be a whole number of threads >= 1"),
        (env.GATHER_THREADS, "off", "must be a whole number of threads >= 1"),
        (env.WARM_WORKERS, "-1", "must be a whole number of processes >= 0, or off"),
        (env.WARM_IDLE_S, "0", "must be a number of seconds > 0"),
        (env.AGREEMENT_TIMEOUT_S, "5m", "must be a number of seconds > 0"),
        (env.AVAILABLE_BYTES, "1G", "must be a whole number of bytes"),
        (
            env.PAGE_LOCK,
            "maybe",
            "is neither on nor off, written 1, on, true or yes and 0, off, false or no",
        ),
    ],
)
def test_a_bad_value_names_the_variable_the_rule_the_value_and_the_fix(
    monkeypatch, name, value, rule
):
    monkeypatch.setenv(name, value)
    read = {
        env.COUNT: env.count,
        env.SECONDS: env.seconds,
        env.BYTES: env.nbytes,
        env.SWITCH: env.switched_off,
    }[env.VARIABLES[name].grammar]
    with pytest.raises(ValueError) as refused:
        read(name)
    variable = env.VARIABLES[name]
    assert str(refused.value) == f"{name}={value!r} {rule} ({variable.meaning}); {variable.fix}."


def test_a_variable_is_read_by_its_own_grammar_alone():
    with pytest.raises(TypeError, match="FEEDPIPE_PAGE_LOCK is read as a switch, not as count"):
        env.count(env.PAGE_LOCK)
