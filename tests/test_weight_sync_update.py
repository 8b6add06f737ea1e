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


def test_a_flattened_bucket_is_its_tensors_bytes_in_order() -> None:
    import torch

    from agentrl.engine.dist import bucket_bytes, flatten_bucket, flattens, unflatten_bucket

    tensors = [
        torch.arange(6, dtype=torch.float32).view(2, 3),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.randn(6).to(torch.bfloat16)[::2],  # strided: its values travel, not its storage
    ]
    layout = [(t.dtype, list(t.shape)) for t in tensors]
    flat = flatten_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == bucket_bytes(layout) == 24 + 24 + 6
    # SGLang's FlattenedTensorBucket: each tensor's bytes after the last's, no padding
    expected = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    assert flat.numpy().tobytes() == expected
    back = unflatten_bucket(flat, layout)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))
    assert flattens(layout)
    # a float32 tensor two bytes into the buffer cannot be viewed as float32: the bucket goes tensor by tensor
    assert not flattens([(torch.bfloat16, [3]), (torch.float32, [2])])
    with pytest.raises(ValueError, match="holds tensors of"):
        unflatten_bucket(flat[:-2], layout)


async def test_a_broadcast_flattens_the_buckets_whose_tensors_line_up() -> None:
    import torch

    from agentrl.engine.dist import FLATTENED, host_store, init_custom_process_group, leave_process_group
    from agentrl.weight_sync.broadcast import broadcast_weights

    store = host_store(1, timeout=60)
    pg = init_custom_process_group(
        "gloo", "", world_size=1, rank=0, group_name="flatten_test", timeout=60, store=store
    )
    announced: list[tuple[list[str], str | None]] = []

    async def announce(names, dtypes, shapes, last, load_format) -> None:
        announced.append((names, load_format))

    named = [
        ("a", torch.zeros(8, dtype=torch.float32)),
        ("b", torch.zeros(4, dtype=torch.bfloat16)),
        ("c", torch.zeros(3, dtype=torch.bfloat16)),  # 6 bytes: the next float32 would start unaligned
        ("d", torch.zeros(2, dtype=torch.float32)),
    ]
    try:
        flat = await broadcast_weights(named, pg, bucket_bytes=40, announce=announce, flatten=True)
        plain = await broadcast_weights(named, pg, bucket_bytes=40, announce=announce)
    finally:
        await leave_process_group(pg, 30)
    # buckets of at most 40 bytes: [a, b] (32 + 8) and [c, d] (6 + 8), whose float32 would start unaligned
    assert announced[:2] == [(["a", "b"], FLATTENED), (["c", "d"], None)]
    assert (flat.num_buckets, flat.num_broadcasts) == (2, 1 + 2)
    assert announced[2:] == [(["a", "b"], None), (["c", "d"], None)] and plain.num_broadcasts == 4
