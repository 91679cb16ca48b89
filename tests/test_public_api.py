"""The public surface: every name in `feedpipe.__all__` imports, `__all__` is sorted, and the
modules worker processes import stay free of TensorFlow."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import io
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

import feedpipe as fp
from feedpipe import cli
from tests.fakes import index_arrays

LIGHT_MODULES = [
    "feedpipe",
    "feedpipe._internals",
    "feedpipe._internals.jax",
    "feedpipe._internals.keras",
    "feedpipe._internals.tf",
    "feedpipe._internals.torch",
    "feedpipe.core._shm",
    "feedpipe.core._sync",
    "feedpipe.core._worker",
    "feedpipe.core.batch",
    "feedpipe.core.checks",
    "feedpipe.core.description",
    "feedpipe.core.producers",
    "feedpipe.core.remainder",
    "feedpipe.core.sampler",
    "feedpipe.core.slots",
    "feedpipe.core.sources",
    "feedpipe.core.split",
    "feedpipe.core.workers",
    "feedpipe.core.writer",
]


@pytest.mark.parametrize("name", fp.__all__)
def test_every_public_name_imports(name):
    value = getattr(fp, name)
    assert value is not None
    assert getattr(fp, name) is value
    assert name in dir(fp)


def test_all_is_sorted_and_unique():
    assert fp.__all__ == sorted(set(fp.__all__))


def test_the_contract_names_are_public():
    assert {"Batch", "FeedOptions", "FeedStats", "Feeder", "from_generator"} <= set(fp.__all__)


def test_fp_batch_is_the_batch_of_every_framework(devices):
    import jax

    with fp.Feeder(index_arrays(8), 4, devices=devices) as on_tf:
        assert isinstance(next(iter(on_tf)), fp.Batch)
    with fp.Feeder(index_arrays(8)[0], 4, devices=jax.devices()) as on_jax:
        assert isinstance(next(iter(on_jax)), fp.Batch)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Feeeder'"):
        fp.Feeeder  # noqa: B018


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_modules_do_not_import_tensorflow(module):
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_options_are_frozen_and_validated():
    options = fp.FeedOptions(global_batch_size=8)
    assert (options.remainder, options.shuffle, options.seed, options.workers, options.depth) == (
        "pad",
        False,
        0,
        0,
        2,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.depth = 3
    with pytest.raises(ValueError, match=r"`depth`=0"):
        fp.FeedOptions(global_batch_size=8, depth=0)
    with pytest.raises(TypeError, match=r"`shuffle`='yes' must be True or False"):
        fp.FeedOptions(global_batch_size=8, shuffle="yes")


def test_options_after_the_batch_size_are_keyword_only():
    assert fp.FeedOptions(128, shuffle=True).shuffle is True
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 9 were given"):
        fp.FeedOptions(8, "pad", False, 0, 0, 2, "process", None)  # the old signature
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 3 were given"):
        fp.FeedOptions(8, "drop")


def _feeder(**options) -> None:
    fp.Feeder(index_arrays(8), **{"global_batch_size": 2, **options}).close()


def _train(steps_per_execution) -> None:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with fp.Feeder(index_arrays(8), 2) as feeder:
        fp.train(
            model,
            feeder,
            loss="mse",
            optimizer="sgd",
            steps_per_execution=steps_per_execution,
            verbose=0,
        )


def _command_steps(text: str) -> None:
    """Raises what `feedpipe demo --steps TEXT` writes after "error: "."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit):
        cli.main(["demo", "--steps", text])
    raise ValueError(stderr.getvalue().splitlines()[-1].removeprefix("feedpipe demo: error: "))


_COUNTS = [
    ("global_batch_size", lambda value: _feeder(global_batch_size=value), 1),
    ("depth", lambda value: _feeder(depth=value), 1),
    ("workers", lambda value: _feeder(workers=value), 0),
    ("steps_per_execution", _train, 1),
]


@pytest.mark.parametrize(
    ("call", "name", "value", "shown", "minimum"),
    [
        pytest.param(call, name, value, repr(value), minimum, id=f"{name}={value!r}")
        for name, call, minimum in _COUNTS
        for value in (minimum - 1, 0.5, True)
    ]
    + [
        pytest.param(_command_steps, "--steps", text, shown, 1, id=f"--steps {text}")
        for text, shown in (("0", "0"), ("0.5", "0.5"), ("ten", "'ten'"))
    ],
)
def test_every_count_is_refused_in_the_same_words(call, name, value, shown, minimum):
    with pytest.raises(ValueError) as refused:
        call(value)
    message = str(refused.value)
    assert message.startswith(f"`{name}`={shown} must be an integer >= {minimum}"), message
    rule, _, fix = message.partition("; ")
    assert fix.endswith(".") and len(fix) > 10, f"no fix after the rule: {message}"
    assert ("(a bool is not an integer)" in rule) == (value is True), message


def test_py_typed_ships_with_the_package():
    assert os.path.exists(os.path.join(os.path.dirname(fp.__file__), "py.typed"))


def _feedpipe_imports(tree) -> set[str]:
    """The feedpipe modules a module imports, at module level or inside functions, leaving
    out imports made for type checkers only."""
    import ast

    names: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("feedpipe."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "feedpipe":
            names.update(alias.name for alias in node.names)
        names |= _feedpipe_imports(node)
    return names


def test_no_import_cycle_inside_the_package():
    """Data flows one way: no module of feedpipe imports one that imports it back, directly or
    through others, even lazily inside a function."""
    import ast
    from pathlib import Path

    package = Path(fp.__file__).parent
    imports = {
        path.stem: _feedpipe_imports(ast.parse(path.read_text()))
        for path in package.glob("*.py")
        if path.stem != "__init__"  # it only re-exports, lazily
    }

    def reaches(start: str, goal: str, seen: set) -> bool:
        for name in imports.get(start, ()):
            if name == goal or (name not in seen and reaches(name, goal, seen | {name})):
                return True
        return False

    cycles = sorted(name for name in imports if reaches(name, name, {name}))
    assert cycles == [], f"modules in an import cycle: {cycles}"


FLOORS = {
    "_version": 0,
    "_internals": 0,
    "core": 1,
    "options": 2,
    "service": 2,
    "dali": 2,
    "keras": 2,
    "ray": 3,
    "_frameworks": 4,
    "plan": 4,
    "passes": 4,
    "assembly": 5,
    "consumer": 6,
    "feeder": 7,
    "demo": 8,
    "tf": 9,
    "jax": 9,
    "torch": 9,
    "diagnostics": 10,
    "cli": 11,
    "__main__": 12,
}
"""The package's floors, ground first: the core, the rooms the facade is built from, the
facade, the framework layers, diagnostics over any of them, and the command."""


def test_no_module_imports_one_from_a_floor_above_it():
    """Each module and subpackage imports only from the floors below it (even lazily, inside a
    function), so the next engineer reads the package from the ground up."""
    import ast
    from pathlib import Path

    package = Path(fp.__file__).parent
    rooms = {p.stem for p in package.glob("*.py")} | {
        p.parent.name for p in package.glob("*/__init__.py")
    }
    assert rooms - {"__init__"} == set(FLOORS), "a new module needs its floor here"
    upward = []
    for room, floor in FLOORS.items():
        paths = [package / f"{room}.py"] if (package / f"{room}.py").exists() else []
        paths += sorted((package / room).rglob("*.py"))
        for path in paths:
            for name in _feedpipe_imports(ast.parse(path.read_text())) - {room}:
                if FLOORS.get(name, 0) >= floor:
                    upward.append(f"{path.relative_to(package)} imports {name}")
    assert upward == []


def test_help_on_the_feeder_documents_every_parameter_and_the_keras_entry_point():
    import inspect

    doc = inspect.getdoc(fp.Feeder)
    parameters = list(inspect.signature(fp.Feeder.__init__).parameters)[1:]
    assert [name for name in parameters if f"{name}:" not in doc] == []
    methods = {name for name, _ in inspect.getmembers(fp.Feeder) if not name.startswith("_")}
    assert {"as_dataset", "fit_callback", "get_state", "set_state", "stats", "describe"} <= methods


def test_ides_and_help_show_the_feeders_real_parameters():
    """`fp.Feeder(...)` returns its framework's subclass through `__new__(*args, **kwargs)`;
    `inspect.signature` (IDEs, notebooks) and `help()` still show `__init__`'s parameters."""
    import inspect
    import pydoc

    signature = inspect.signature(fp.Feeder)
    assert list(signature.parameters)[:3] == ["source", "global_batch_size", "devices"]
    assert signature.parameters["depth"].default == 2
    assert signature.parameters["errors"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "self" not in signature.parameters
    shown = pydoc.render_doc(fp.Feeder, renderer=pydoc.plaintext)
    assert "Feeder(source: Any, global_batch_size: int, devices: Any = None" in shown


def test_help_on_the_feeder_shows_pytorchs_checkpoint_methods(devices):
    """The README's PyTorch quick start saves `feeder.state_dict()`: help(fp.Feeder) documents
    it, and it works on whichever framework's feeder `fp.Feeder(...)` returns."""
    import pydoc

    shown = pydoc.render_doc(fp.Feeder, renderer=pydoc.plaintext)
    assert " |  state_dict(self)" in shown and " |  load_state_dict(self, state_dict" in shown
    assert "PyTorch's name" in shown
    with fp.Feeder(index_arrays(16), 4, devices=devices[:1]) as feeder:
        next(iter(feeder))
        state = feeder.state_dict()
        assert state == feeder.get_state()
    with fp.Feeder(index_arrays(16), 4, devices=devices[:1]) as again:
        again.load_state_dict(state)
        assert again.get_state() == state


def test_the_readmes_api_at_a_glance_names_every_parameter_of_the_feeder():
    import inspect
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    glance = readme.split("## The API at a glance", 1)[1].split("```python", 1)[1]
    glance = glance.split("```", 1)[0]
    call = glance.split("feeder = fp.Feeder(", 1)[1].split("\n)", 1)[0]
    named = set(re.findall(r"^    (\w+)[=,]", call, re.MULTILINE))
    named |= set(re.findall(r"^    \w+=[^,]+, (\w+)=", call, re.MULTILINE))  # shuffle, seed
    missing = [name for name in inspect.signature(fp.Feeder).parameters if name not in named]
    assert missing == [], f"README's API at a glance leaves out {missing}"


def test_the_layout_page_names_every_module_and_the_readme_links_it():
    package = Path(fp.__file__).parent
    root = package.parent
    layout = (root / "docs" / "layout.md").read_text()
    modules = sorted(
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.stem not in ("__init__", "__main__")
    )
    missing = [name for name in modules if f"`{name}`" not in layout]
    assert missing == [], f"docs/layout.md does not name {missing}"
    assert "(docs/layout.md)" in (root / "README.md").read_text()


def test_the_version_is_written_once_and_the_installed_package_says_it(capsys):
    metadata = importlib.metadata.metadata("feedpipe")
    assert metadata["Version"] == fp.__version__ != "0.1.0"
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip() == f"feedpipe {fp.__version__}"
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and '\nversion = "' not in pyproject


def test_the_license_is_apache_2_and_shipped():
    metadata = importlib.metadata.metadata("feedpipe")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Author"] or metadata["Author-email"]
    text = (Path(__file__).resolve().parent.parent / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text


def test_the_light_test_path_installs_no_dali_and_the_readme_gives_it():
    import tomllib

    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def requirements(extra: str) -> set[str]:
        found = set()
        for requirement in extras[extra]:
            if requirement.startswith("feedpipe["):
                for name in requirement[len("feedpipe[") : -1].split(","):
                    found |= requirements(name)
            else:
                found.add(requirement)
        return found

    assert not [r for r in requirements("test-light") if "dali" in r]
    assert any("dali" in r for r in requirements("test"))  # CI's full path keeps DALI
    readme = (root / "README.md").read_text()
    light = (
        '.venv/bin/pip install -q -e ".[test-light]" && .venv/bin/python -m pytest -q -m "not slow"'
    )
    assert light in readme
