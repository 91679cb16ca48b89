"""Which framework a feeder stages for, told from what the user passed, without importing one.

As Keras does (`data_adapter_utils.is_tf_dataset`), framework objects are recognised by the
module their class comes from, so a JAX or PyTorch user never loads TensorFlow, nor the reverse.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

FRAMEWORKS = {
    "tensorflow": "feedpipe.tf.feeder",
    "jax": "feedpipe.jax.feeder",
    "torch": "feedpipe.torch.feeder",
}
"""Each framework's name, as `framework=` takes it, and the module of its feeder."""


def _library(value: Any) -> str:
    """The top-level package that `value`'s class comes from ("jaxlib" counts as "jax")."""
    library = type(value).__module__.split(".")[0]
    return "jax" if library == "jaxlib" else library


def _string_framework(device: str) -> str:
    """The framework a device string names: PyTorch's "cuda:N" is no TensorFlow device; every
    other string ("/gpu:0", "cpu") is read as TensorFlow's."""
    return "torch" if device.split(":")[0] == "cuda" else "tensorflow"


def _from_devices(devices: Any) -> str:
    if _library(devices) == "jax":  # a Mesh or a Sharding
        return "jax"
    if isinstance(devices, str):
        return "tensorflow"  # resolve_devices explains that a list is wanted
    try:
        kinds = {_string_framework(d) if isinstance(d, str) else _library(d) for d in devices}
    except TypeError:
        kinds = set()
    if len(kinds) == 1 and kinds <= set(FRAMEWORKS):
        return kinds.pop()
    raise TypeError(
        f"`devices`={devices!r} must list TensorFlow device strings (['/gpu:0', '/gpu:1']), "
        "JAX devices (jax.devices()) or PyTorch devices ([torch.device('cuda:0')]), one kind "
        "only, or be a jax.sharding.Mesh or Sharding; PyTorch device strings ('cuda:0') need "
        "framework='torch'."
    )


def _default() -> str:
    """Keras's backend where Keras is loaded; else the one framework loaded; else the one
    installed (TensorFlow, then JAX, then PyTorch: the order they were supported in)."""
    keras = sys.modules.get("keras")
    if keras is not None:
        backend = keras.backend.backend()
        if backend in FRAMEWORKS:
            return backend
    loaded = [name for name in FRAMEWORKS if name in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    wanted = os.environ.get("KERAS_BACKEND")
    if wanted in FRAMEWORKS:
        return wanted
    return first_installed("fp.Feeder stages batches for")


def first_installed(needs: str) -> str:
    """The first framework installed, in `FRAMEWORKS`' order; `needs` begins the error
    ("<needs> TensorFlow, JAX or PyTorch, and none is installed")."""
    for name in FRAMEWORKS:
        if importlib.util.find_spec(name) is not None:
            return name
    raise ImportError(
        f"{needs} TensorFlow, JAX or PyTorch, and none is installed; install one: "
        'pip install "feedpipe[tensorflow]", "feedpipe[jax]" or "feedpipe[torch]".'
    )


def import_keras(user: str) -> Any:
    """Keras, for `user` (a feedpipe feature that needs it), on a backend that is installed.

    Keras's default backend is TensorFlow. Where Keras is not loaded yet, no backend was asked
    for (`KERAS_BACKEND`), and TensorFlow is not installed but JAX or PyTorch is, Keras would
    fail to import; the first of those installed is then chosen (`KERAS_BACKEND`, which the
    user's own later `import keras` sees too). Where no backend Keras can run is installed, the
    error says so in one line.
    """
    if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND"):
        installed = [n for n in FRAMEWORKS if importlib.util.find_spec(n) is not None]
        if installed and "tensorflow" not in installed:
            os.environ["KERAS_BACKEND"] = installed[0]
    try:
        import keras
    except ModuleNotFoundError as error:
        backend = os.environ.get("KERAS_BACKEND") or "tensorflow, Keras's default"
        raise ImportError(
            f"{user} needs Keras, whose backend ({backend}) is not installed ({error}); set "
            "KERAS_BACKEND to an installed one (tensorflow, jax or torch) before importing "
            "keras."
        ) from error
    return keras


def framework_of(framework: str | None, devices: Any, strategy: Any) -> str:
    """The framework to stage for: `framework`, else the one `strategy` or `devices` belong to,
    else the default."""
    if framework is not None:
        if framework not in FRAMEWORKS:
            raise ValueError(
                f"`framework`={framework!r} must be one of {', '.join(map(repr, FRAMEWORKS))}, "
                "or None to tell it from `devices` and `strategy`."
            )
        return framework
    if strategy is not None:
        if _library(strategy) != "tensorflow":
            raise TypeError(
                f"`strategy`={strategy!r} must be a tf.distribute strategy; for JAX pass "
                "devices=jax.devices() (or a Mesh) and shard with batch.distributed(); for "
                "PyTorch pass devices (or none) and run one process per device."
            )
        return "tensorflow"
    if devices is not None:
        return _from_devices(devices)
    return _default()


def feeder_class(framework: str | None, devices: Any, strategy: Any) -> type:
    """The `Feeder` subclass of the framework to stage for; where Keras is loaded, also a
    Keras data adapter, so that `model.fit(feeder)` works (`feedpipe.keras.adapter`)."""
    name = framework_of(framework, devices, strategy)
    cls = importlib.import_module(FRAMEWORKS[name]).Feeder
    if "keras" in sys.modules:
        from feedpipe.keras.adapter import with_keras

        cls = with_keras(cls)
    return cls
