"""The `nats:` config section and `nats_url` server lists: defaults, validation with clear messages."""

from __future__ import annotations

import pytest

from rolectl.roles.config import NatsConfig, parse_config
from rolectl.sync_protocol import ConfigError


def test_defaults_are_one_replica_and_file_weight_storage():
    cfg = parse_config({"job": "j"})
    assert cfg.nats == NatsConfig(replicas=1)
    assert cfg.transport.object_store_storage == "file"


def test_a_cluster_url_list_and_replicas_load():
    cfg = parse_config({"job": "j", "nats_url": "nats://a:4222,nats://b:4222,nats://c:4222",
                        "nats": {"replicas": 3}})
    assert cfg.nats.replicas == 3
    assert cfg.nats_url.count(",") == 2


@pytest.mark.parametrize("section, where, says", [
    ({"nats": {"replicas": 0}}, "nats.replicas", "must be an integer > 0"),
    ({"nats": {"replicas": "3"}}, "nats.replicas", "must be an integer > 0"),
    ({"nats": {"replicas": 7}}, "nats.replicas", "at most 5"),
    ({"nats": {"replica": 3}}, "nats.replica", "unknown field"),
    ({"nats_url": "nats://a:4222,,nats://b:4222"}, "nats_url", "entry 2 is empty"),
    ({"nats_url": "http://a:80"}, "nats_url", "is not a NATS server URL"),
])
def test_bad_nats_settings_name_the_field(section, where, says):
    with pytest.raises(ConfigError) as caught:
        parse_config({"job": "j", **section})
    assert any(field == where and says in why for field, why in caught.value.problems), caught.value.problems
