"""Private framework calls are fenced in `feedpipe._internals`: no other module imports
`keras.src`, `tensorflow.python` or `jax._src`, or reads a framework's frames; each of its
modules imports no framework until called."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import feedpipe

PACKAGE = Path(feedpipe.__file__).parent
INTERNALS = PACKAGE / "_internals"
PRIVATE = ("keras.src", "tensorflow.python", "jax._src")
"""The frameworks' private packages."""
FRAMEWORKS = ("tensorflow", "keras", "jax", "jaxlib", "torch")

FRAME_STATE = {
    *("f_locals", "f_builtins", "f_lasti", "f_trace"),
    *("co_name", "co_qualname", "co_varnames", "co_cellvars", "co_freevars", "co_consts"),
    *("tb_frame", "gi_frame", "cr_frame", "ag_frame"),
}
"""What a frame holds beyond its place. Outside `_internals` a frame is read for its place
alone: the frame that called it, its file and line, `f_globals["__name__"]`. So
`core/checks.py` walks feedpipe's own frames to find the user's line, and `core/_worker.py`
names the package and user file an import in a worker came from, and neither reads a frame's
locals or which function it runs: the state a framework keeps in its frames (`fit`'s
locals), which `_internals` alone reads."""
WALKERS = {
    "inspect": {"stack", "trace", "currentframe", "getouterframes", "getinnerframes"},
    "traceback": {"walk_stack", "walk_tb"},
    "sys": {"_current_frames"},
}
"""Ways to reach other frames than through `sys._getframe` and `f_back`."""


def is_private(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in PRIVATE)


def fenced(tree: ast.AST) -> list[str]:
    """What in `tree` only `_internals` may do: import a framework's private package, read a
    frame for more than its place, or reach frames other than by walking up from its own."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"imports {name}" for name in names if is_private(name)][:1]
        elif isinstance(node, ast.Attribute):
            if node.attr in FRAME_STATE:
                found.append(f"reads {node.attr}")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in WALKERS.get(owner, ()):
                found.append(f"calls {owner}.{node.attr}")
        elif isinstance(node, ast.Subscript | ast.Call):
            target = node.value if isinstance(node, ast.Subscript) else node.func
            if isinstance(node, ast.Call):
                is_get = isinstance(target, ast.Attribute) and target.attr == "get"
                target = target.value if is_get else None
                key = node.args[0] if node.args else None
            else:
                key = node.slice
            by_name = isinstance(key, ast.Constant) and key.value == "__name__"
            if isinstance(target, ast.Attribute) and target.attr == "f_globals" and not by_name:
                found.append("reads f_globals beyond __name__")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and is_private(str(first.value)):
                found.append(f"imports {first.value}")
    return found


def test_no_module_but_internals_calls_a_framework_private_api_or_reads_its_frames():
    outside = {
        path.relative_to(PACKAGE).as_posix(): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if INTERNALS not in path.parents and (found := fenced(ast.parse(path.read_text())))
    }
    assert outside == {}


def test_the_fence_sees_what_internals_does():
    """The check can fail: it finds, in `_internals`, the private imports and the frame reads
    it forbids elsewhere."""
    found = set(fenced(ast.parse((INTERNALS / "keras.py").read_text())))
    assert {"imports keras.src.backend.torch.core", "reads f_locals", "reads co_name"} <= found
    assert "imports jax._src" in set(fenced(ast.parse((INTERNALS / "jax.py").read_text())))
    source = (
        "import inspect, sys\nfrom jax import _src\nimport tensorflow.python.ops\n"
        "frame = sys._getframe(1)\nframe.f_globals['__name__']\nframe.f_globals.get('x')\n"
        "inspect.currentframe()\nframe.f_code.co_filename\nos.statvfs('/').f_bavail\n"
        "importlib.import_module('keras.src.trainers')\n"
    )
    assert sorted(fenced(ast.parse(source))) == [
        "calls inspect.currentframe",
        "imports jax._src",
        "imports keras.src.trainers",
        "imports tensorflow.python.ops",
        "reads f_globals beyond __name__",
    ]


@pytest.mark.parametrize("module", sorted(p.stem for p in INTERNALS.glob("[!_]*.py")))
def test_importing_a_module_of_internals_imports_no_framework(module):
    code = (
        f"import sys, feedpipe._internals.{module}\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "assert not loaded, loaded[:5]\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


FAKE_TRAINER = "/site-packages/keras/src/backend/tensorflow/trainer.py"
FAKE_FIT = """
def fit(self, {x}=None, y=None, batch_size=None, callbacks=None, validation_data=None,
        class_weight=None, sample_weight=None, validation_steps=None,
        validation_batch_size=None):
    epoch_iterator = val_x = val_y = val_sample_weight = None
    return read({x})
"""


def fake_fit(read, x: str = "x"):
    """A `fit` whose code claims to be Keras's TensorFlow trainer's, its input named `x`, that
    calls `read(input)` from inside itself."""
    namespace = {"read": read}
    exec(compile(FAKE_FIT.format(x=x), FAKE_TRAINER, "exec"), namespace)
    return namespace["fit"]


def readers():
    """Each reader of a `fit`'s frame, called from inside a fit given `adapter`."""
    from feedpipe._internals import keras

    return {
        "keras_call": keras.keras_call,
        "keras_fit_input": lambda adapter: keras.keras_fit_input(),
        "batch_keras_validation_arrays": lambda a: keras.batch_keras_validation_arrays(a, 8),
        "in_keras_fit_with": lambda adapter: keras.in_keras_fit_with(object(), sys._getframe()),
        "read_keras_fit_input_through": lambda a: keras.read_keras_fit_input_through(iter),
    }


@pytest.mark.parametrize("reader", sorted(readers()))
def test_a_fit_whose_local_was_renamed_is_refused_naming_keras_the_frame_the_local_and_the_fix(
    reader,
):
    from feedpipe._internals.keras import KERAS_BELOW

    fit = fake_fit(readers()[reader], x="inputs")
    with pytest.raises(RuntimeError) as refused:
        fit(None, inputs=object())
    message = str(refused.value)
    assert re.search(r"^(Keras \S+|This Keras) changed `fit` ", message), message
    assert "(keras/src/backend/tensorflow/trainer.py): it has no local `x`" in message
    assert (
        f"tested with keras<{KERAS_BELOW}: install one (pip install 'keras<{KERAS_BELOW}')"
        in message
    )


def test_a_fit_with_every_local_is_read_as_before():
    from feedpipe._internals.keras import keras_call, keras_fit_input

    adapter = object()
    assert fake_fit(keras_call)(None, x=adapter, y=None) == (
        "fit",
        {"y": None, "sample_weight": None, "class_weight": None},
    )
    # A fit on other data reading `adapter` is validating on it.
    assert fake_fit(lambda x: keras_call(adapter))(None, x=object()) == ("evaluate", {})
    assert fake_fit(lambda x: keras_fit_input())(None, x=adapter) is adapter


def trainer_methods(path: Path) -> dict[str, object]:
    """The code of `fit`, `evaluate` and `predict` in the trainer at `path`, compiled, not run."""
    found, pending = {}, [compile(path.read_text(), str(path), "exec")]
    while pending:
        code = pending.pop()
        if code.co_name in ("fit", "evaluate", "predict"):
            found[code.co_name] = code
        pending += [c for c in code.co_consts if hasattr(c, "co_code")]
    return found


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_the_installed_keras_trainers_have_every_local_feedpipe_reads(backend):
    """The test to run on a new Keras before raising `KERAS_BELOW` (docs/layout.md)."""
    from feedpipe._internals.keras import TRAINER_LOCALS, missing_trainer_locals

    spec = importlib.util.find_spec("keras")
    if spec is None:
        pytest.skip("Keras is not installed")
    path = Path(spec.origin).parent / "src" / "backend" / backend / "trainer.py"
    methods = trainer_methods(path)
    assert sorted(methods) == sorted(TRAINER_LOCALS)
    assert {name: missing_trainer_locals(code) for name, code in methods.items()} == {
        name: [] for name in TRAINER_LOCALS
    }


def test_pyproject_requires_keras_below_the_release_feedpipe_was_tested_on():
    from feedpipe._internals.keras import KERAS_BELOW

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    wanted = [
        requirement
        for requirements in project["optional-dependencies"].values()
        for requirement in requirements
        if re.match(r"keras\b", requirement)
    ]
    assert wanted
    assert all(requirement.endswith(f",<{KERAS_BELOW}") for requirement in wanted), wanted
