"""The weight-sync record and its pure parts: each rank's engines, the payload, every (transport, payload)
having an implementation, and the phases a push's seconds split into."""

from __future__ import annotations

import typing

import pytest

from agentrl.weight_sync import (
    CONNECTORS,
    PayloadKind,
    Transport,
    WeightUpdate,
    payload_kind,
    route,
    sync_phases,
)

URLS = ["http://e0", "http://e1", "http://e2", "http://e3"]


def test_rank_zero_pushes_to_every_engine_except_in_memory() -> None:
    assert route("disk", URLS, 0, 2) == URLS and route("disk", URLS, 1, 2) == []
    assert route("distributed", URLS, 0, 4) == URLS and route("distributed", URLS, 3, 4) == []
    # in memory, engine j from rank j % world: colocated, engine i shares GPU i with rank i
    assert route("tensor", URLS, 0, 4) == ["http://e0"] and route("tensor", URLS, 3, 4) == ["http://e3"]
    assert route("tensor", URLS, 1, 2) == ["http://e1", "http://e3"]


def test_the_payload_follows_lora_and_the_engines() -> None:
    assert payload_kind(None, serves_adapters_by_name=True) == "full"
    assert payload_kind(object(), serves_adapters_by_name=False) == "lora"
    assert payload_kind(object(), serves_adapters_by_name=True) == "lora_named"


def test_every_transport_carries_every_payload() -> None:
    pairs = {(t, p) for t in typing.get_args(Transport) for p in typing.get_args(PayloadKind)}
    assert set(CONNECTORS) == pairs


def test_the_record_keeps_its_urls_as_a_tuple_and_does_not_change() -> None:
    update = WeightUpdate("disk", URLS, out_dir="w")
    assert update.engine_urls == tuple(URLS)
    with pytest.raises(AttributeError):
        update.version = 3  # type: ignore[misc]


def test_phases_of_a_push_for_any_transport() -> None:
    assert sync_phases({}) == {}
    broadcast = {"seconds": 2.0, "gather_seconds": 0.5, "num_buckets": 3.0}  # nothing laid out first
    assert sync_phases(broadcast) == {"gather": 0.5, "pack": 0.0, "push": 2.0}
    disk = {"seconds": 3.0, "pack_seconds": 1.0, "gather_seconds": 0.25}
    assert sync_phases(disk) == {"gather": 0.25, "pack": 1.0, "push": 2.0}
