"""Every `FEEDPIPE_*` environment variable: its name, what it sets, its grammar and its default,
and the one reader of each grammar.

Four grammars, each written once:

- a count: a whole number, at least the variable's least; where the least is 0, `off`, `false`
  and `no` also mean 0;
- seconds: a number > 0;
- bytes: a whole number of bytes;
- a switch: on is `1`, `on`, `true` or `yes`; off is `0`, `off`, `false` or `no`.

Words are read in any case, blanks around a value are ignored, and a variable unset or blank
takes its default. A value outside its grammar is refused with a ValueError that names the
variable, the rule, the value received and the fix. No other module of feedpipe reads a
`FEEDPIPE_*` variable, and docs/environment.md lists every one declared here (a test checks
both).
"""

from __future__ import annotations

import dataclasses
import os

COUNT, SECONDS, BYTES, SWITCH = "count", "seconds", "bytes", "switch"
"""The grammars."""
OFF = ("0", "off", "false", "no")
"""The spellings of off, in any case."""
ON = ("1", "on", "true", "yes")
"""The spellings of on, in any case."""
_SPELLINGS = "1, on, true or yes and 0, off, false or no"


@dataclasses.dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable of feedpipe's."""

    name: str
    grammar: str
    """`COUNT`, `SECONDS`, `BYTES` or `SWITCH`."""
    meaning: str
    """What it sets, as a noun phrase: "how long an idle worker process is kept"."""
    default: str
    """What applies where it is unset, as the docs say it."""
    fix: str
    """What to set instead of a refused value, as a clause."""
    unit: str = ""
    """What a count counts: "processes", "threads"."""
    least: int = 0
    """The smallest count allowed."""


AGREEMENT_TIMEOUT_S = "FEEDPIPE_AGREEMENT_TIMEOUT_S"
AVAILABLE_BYTES = "FEEDPIPE_AVAILABLE_BYTES"
COPY_STREAM = "FEEDPIPE_COPY_STREAM"
GATHER_THREADS = "FEEDPIPE_GATHER_THREADS"
PAGE_LOCK = "FEEDPIPE_PAGE_LOCK"
WARM_IDLE_S = "FEEDPIPE_WARM_IDLE_S"
WARM_WORKERS = "FEEDPIPE_WARM_WORKERS"

VARIABLES = {
    variable.name: variable
    for variable in (
        Variable(
            AGREEMENT_TIMEOUT_S,
            SECONDS,
            "how long a host waits for the other hosts' feeders",
            "300 s",
            "set it to the seconds a host may wait, or unset it to wait 300 s",
        ),
        Variable(
            AVAILABLE_BYTES,
            BYTES,
            "the memory worker processes may count on",
            "what the system says is available",
            f"set it to, say, {2**30} for 1 GiB, or unset it to use what the system says is "
            "available",
        ),
        Variable(
            COPY_STREAM,
            SWITCH,
            "whether batches are copied to CUDA GPUs on feedpipe's own streams",
            "on",
            "set it to 0 to turn it off, or to 1 (or leave it unset) to copy on feedpipe's own "
            "CUDA streams",
        ),
        Variable(
            GATHER_THREADS,
            COUNT,
            "the most threads gathering a batch of in-memory arrays",
            "one a core this process may run on",
            "set it to 1 for one thread, to the threads to gather in, or unset it to use every "
            "core",
            unit="threads",
            least=1,
        ),
        Variable(
            PAGE_LOCK,
            SWITCH,
            "whether host slots are page-locked with the CUDA library the framework loaded",
            "on",
            "set it to 0 to turn it off, or to 1 (or leave it unset) to page-lock host slots",
        ),
        Variable(
            WARM_IDLE_S,
            SECONDS,
            "how long an idle worker process is kept",
            "300 s",
            f"set it to the seconds an idle worker may wait, or set {WARM_WORKERS}=0 to keep none",
        ),
        Variable(
            WARM_WORKERS,
            COUNT,
            "the idle worker processes kept for the next feeder",
            "one a core this process may run on",
            "set it to 0 to end every worker with its feeder, or to how many idle workers to keep",
            unit="processes",
        ),
    )
}
"""Every variable, by name."""


def count(name: str, default: int | None = None) -> int | None:
    """The count the variable `name` sets, or `default` where it is unset."""
    variable, value = _read(name, COUNT)
    if value is None:
        return default
    if variable.least == 0 and value.lower() in OFF:
        return 0
    try:
        number = int(value)
    except ValueError:
        number = variable.least - 1
    if number < variable.least:
        offs = ", or off" if variable.least == 0 else ""
        _refuse(variable, f"must be a whole number of {variable.unit} >= {variable.least}{offs}")
    return number


def seconds(name: str, default: float | None = None) -> float | None:
    """The seconds the variable `name` sets, or `default` where it is unset."""
    variable, value = _read(name, SECONDS)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        _refuse(variable, "must be a number of seconds > 0")
    return number


def nbytes(name: str, default: int | None = None) -> int | None:
    """The bytes the variable `name` sets, or `default` where it is unset."""
    variable, value = _read(name, BYTES)
    if value is None:
        return default
    if not value.isdigit():
        _refuse(variable, "must be a whole number of bytes")
    return int(value)


def switched_off(name: str) -> bool:
    """Whether the switch `name` is set off (unset, it is on)."""
    variable, value = _read(name, SWITCH)
    if value is None:
        return False
    if value.lower() not in OFF + ON:
        _refuse(variable, f"is neither on nor off, written {_SPELLINGS}")
    return value.lower() in OFF


def setting(name: str) -> str:
    """The variable `name` as it is set, `NAME=value`, for a message that says what it did."""
    return f"{name}={os.environ.get(name, '').strip()}"


def _read(name: str, grammar: str) -> tuple[Variable, str | None]:
    """The declaration of `name`, which must be of `grammar`, and its value, stripped (None
    where it is unset or blank)."""
    variable = VARIABLES[name]
    if variable.grammar != grammar:
        raise TypeError(f"{name} is read as a {variable.grammar}, not as {grammar}.")
    value = os.environ.get(name, "").strip()
    return variable, value or None


def _refuse(variable: Variable, rule: str) -> None:
    raise ValueError(
        f"{variable.name}={os.environ[variable.name]!r} {rule} ({variable.meaning}); "
        f"{variable.fix}."
    )
