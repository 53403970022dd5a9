"""Overrides may follow the options (`h2jax train exp.yaml --init-from DIR key=value`), as users
write them; an unknown option is still an error."""

from __future__ import annotations

import pytest

from h2jax.cli import main


def test_overrides_after_an_option_are_overrides(capsys):
    assert main(["check-config", "tiny.yaml", "--print", "model.d_model=48", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "d_model: 48" in out and "steps: 7" in out


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check-config", "tiny.yaml", "--bogus", "model.d_model=48"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
