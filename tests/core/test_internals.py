"""Private framework calls are fenced in `feedpipe._internals`: no other module imports
`keras.src`, `tensorflow.python` or `jax._src`, or reads a framework's frames; each of its
modules imports no framework until called."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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
