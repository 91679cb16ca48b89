"""The public names of `import feedpipe` where TensorFlow is not installed (a JAX or PyTorch
install): TensorFlow's training names say what to use there instead of a bare import error."""

from __future__ import annotations

import json

import pytest

from tests.processes import run_as_a_user

TENSORFLOW_ONLY = ("train", "Trainer", "TowerStep", "WarmupLinearScaling")


@pytest.fixture(scope="module")
def without_tensorflow() -> dict:
    """What each of TensorFlow's training names raises in a fresh interpreter where
    `import tensorflow` fails as it does where it is not installed."""
    done = run_as_a_user(
        "import json, sys\n"
        "sys.modules['tensorflow'] = None  # import tensorflow raises ModuleNotFoundError\n"
        "import feedpipe as fp\n"
        "raised = {'Feeder': fp.Feeder.__name__}\n"
        f"for name in {TENSORFLOW_ONLY!r}:\n"
        "    try:\n"
        "        getattr(fp, name)\n"
        "    except ImportError as error:\n"
        "        raised[name] = [type(error).__name__, error.name, str(error)]\n"
        "try:\n"
        "    from feedpipe import train\n"
        "except ImportError as error:\n"
        "    raised['import train'] = [type(error).__name__, error.name, str(error)]\n"
        "print(json.dumps(raised))"
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", [*TENSORFLOW_ONLY, "import train"])
def test_tensorflows_training_names_say_what_jax_and_pytorch_use_instead(without_tensorflow, name):
    kind, missing, message = without_tensorflow[name]
    assert (kind, missing) == ("ModuleNotFoundError", "tensorflow")
    assert f"fp.{name.split()[-1]} trains with Keras on TensorFlow, which is not" in message
    assert "JAX: model.fit(feeder) with Keras on JAX" in message
    assert "batch.distributed()" in message
    assert "PyTorch: model.fit(feeder) with Keras on PyTorch" in message
    assert "for batch in feeder" in message and "pip install" in message


def test_the_feeder_itself_needs_no_tensorflow(without_tensorflow):
    assert without_tensorflow["Feeder"] == "Feeder"
