"""How a config dataclass field tells the command line what it accepts.

The run and build configs (runtime/run_config.py, builder/spec/build_config.py) are plain typed
dataclasses with a one-line docstring under each field; cli/config_options.py turns each field
into a click option and a key of a --config TOML file. A field's annotation says most of it
(bool: a flag, Literal: a choice, int / float / str); `setting` adds what the type cannot: the
range a number must be in, whether a string is a file or a directory, another flag name.
This module imports nothing, so the runtime's configs stay free of click.
"""

from __future__ import annotations

from dataclasses import field

CHECKS = ("positive", "non_negative", "seed", "positive_float", "non_negative_float", "fraction", "timeout",
          "file", "dir", "path", "seq_len")
"""What a value must be beyond its type (cli/config_options.py maps each to a click type)."""


def setting(default, *, check: str | None = None, flag: str | None = None, cli: bool = True,
            flag_value: str | None = None):
    """A config field: `check` one of CHECKS, `flag` the option's name when it is not the
    field's (e.g. --timeout for timeout_s), `cli=False` for a field no command line sets,
    `flag_value` what a bare flag means for an option that also takes a value."""
    assert check is None or check in CHECKS, check
    return field(default=default, metadata={"check": check, "flag": flag, "cli": cli, "flag_value": flag_value})
