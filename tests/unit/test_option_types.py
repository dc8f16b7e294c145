"""The option types of the titan commands (cli/options.py): they refuse what click's own types
let through (NaN and infinities in a range, the empty path) with a message that names the
bound. (Every command's options as processes: e2e/test_options.py, e2e/test_cli_matrix.py.)"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from titan.cli.options import LEARNING_RATE, SEED, TIMEOUT, FiniteFloat, NonEmptyPath


@pytest.mark.parametrize("kind, value, message", [
    (LEARNING_RATE, "nan", "'nan' is not a finite number (want a number > 0)"),
    (LEARNING_RATE, "-inf", "'-inf' is not a finite number (want a number > 0)"),
    (LEARNING_RATE, "0", "'0' is not > 0"),
    (LEARNING_RATE, "-1e-3", "'-1e-3' is not > 0"),
    (LEARNING_RATE, "fast", "'fast' is not a number"),
    (TIMEOUT, "0.5", "'0.5' is not >= 1"),
    (TIMEOUT, "inf", "'inf' is not a finite number (want a number >= 1)"),
])
def test_a_finite_float_refuses_nan_infinities_and_values_past_its_bound(kind, value, message):
    with pytest.raises(click.BadParameter) as e:
        kind.convert(value, None, None)
    assert e.value.message == message


def test_a_finite_float_takes_numbers_at_or_above_its_bound():
    assert LEARNING_RATE.convert("3e-4", None, None) == 3e-4
    assert TIMEOUT.convert("1", None, None) == 1.0 and TIMEOUT.convert(60, None, None) == 60.0
    assert FiniteFloat(-1.0).convert("-0.5", None, None) == -0.5


def test_a_path_option_refuses_the_empty_path(tmp_path):
    kind = NonEmptyPath(path_type=str)
    for empty in ("", "   "):
        with pytest.raises(click.BadParameter) as e:
            kind.convert(empty, None, None)
        assert e.value.message == "an empty path; give a file or directory name"
    assert kind.convert(str(tmp_path), None, None) == str(tmp_path)


def test_a_seed_is_any_non_negative_63_bit_integer():
    assert SEED.convert(str(2**63 - 1), None, None) == 2**63 - 1
    for bad in ("-1", str(2**63)):
        with pytest.raises(click.BadParameter):
            SEED.convert(bad, None, None)


def test_a_command_reports_a_bad_value_as_a_usage_error_naming_the_option():
    @click.command()
    @click.option("--lr", type=LEARNING_RATE, default=1e-3)
    def train(lr):
        click.echo(f"lr {lr}")

    runner = CliRunner()
    assert runner.invoke(train, ["--lr", "2e-3"]).output == "lr 0.002\n"
    bad = runner.invoke(train, ["--lr", "nan"])
    assert bad.exit_code == 2 and "Invalid value for '--lr': 'nan' is not a finite number (want a number > 0)" in bad.output
