"""The ROLECTL_* variables are declared in one typed model: read as text, validated, named when bad."""

from __future__ import annotations

import pytest

from rolectl.roles.config import env_settings
from rolectl.sync_protocol import ConfigError


def test_variables_are_read_and_typed():
    settings = env_settings({"ROLECTL_TORCH_THREADS": "3", "ROLECTL_ADVERTISE_HOST": "10.0.0.7", "HOME": "/root"})
    assert (settings.torch_threads, settings.advertise_host, settings.nats_creds) == (3, "10.0.0.7", None)


def test_unset_variables_take_their_defaults():
    assert env_settings({}).torch_threads == 1


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ConfigError) as info:
        env_settings({"ROLECTL_TORCH_THREADS": value})
    assert info.value.problems == [("ROLECTL_TORCH_THREADS", f"must be an integer > 0, got {value!r}")]
