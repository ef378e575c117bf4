"""The weights wire format: layout, zero-copy byte views, destinations, the digest tree, manifests."""

from __future__ import annotations

import json

import pytest
import torch

from rolectl.bus.weights.base import CorruptWeights, TransferError
from rolectl.bus.weights.format import (
    DEFAULT_DIGEST_ALGORITHM,
    DIGEST_ALGORITHMS,
    Destination,
    Layout,
    Manifest,
    SourceBytes,
    StreamedChunks,
    build_manifest,
    dtype_from_name,
    dtype_name,
    plan_layout,
    streamed_chunks,
)
from tests.support.tensors import assert_bit_exact, raw_bytes


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(33, 8, generator=g).bfloat16(),
        "layer.0.w": torch.randn(5, 7, generator=g),
        "layer.0.b": torch.randn(7, generator=g).half(),
        "step": torch.tensor(12345678901, dtype=torch.int64),  # 0-d
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(11, dtype=torch.int64),
        "scale": torch.tensor(0.5, dtype=torch.float64),
        "q": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
    }


@pytest.mark.parametrize(
    "dtype, name",
    [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.int64, "I64"),
     (torch.int32, "I32"), (torch.uint8, "U8"), (torch.bool, "BOOL"), (torch.float64, "F64"),
     (torch.int8, "I8"), (torch.int16, "I16"), (torch.float8_e4m3fn, "F8_E4M3")],
)
def test_dtype_names_are_safetensors_names(dtype, name):
    assert dtype_name(dtype) == name
    assert dtype_from_name(name) == dtype


def test_unknown_dtype_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype 'F12'"):
        dtype_from_name("F12")


def test_layout_aligns_every_tensor_without_padding():
    layout = plan_layout(mixed_state())
    total = 0
    for spec in layout.specs:
        assert spec.start % spec.torch_dtype.itemsize == 0, spec
        total += spec.nbytes
    assert layout.nbytes == total


def test_layout_keeps_the_callers_order_in_the_header():
    state = mixed_state()
    assert list(plan_layout(state).header()) == list(state)


def test_segments_cover_the_stream_in_order_without_copies():
    state = mixed_state()
    source = SourceBytes(state)
    by_start = sorted(source.layout.specs, key=lambda s: s.start)
    whole = b"".join(raw_bytes(state[s.name]) for s in by_start)
    assert b"".join(source.segments(0, source.nbytes)) == whole
    # any window, including ones that split tensors
    for a, b in [(0, 1), (3, 50), (17, source.nbytes), (source.nbytes - 5, source.nbytes)]:
        assert b"".join(source.segments(a, b)) == whole[a:b]
    # the views share the tensors' memory: writing the tensor shows through
    ids = state["ids"]
    spec = next(s for s in source.layout.specs if s.name == "ids")
    ids[0] = 99
    assert bytes(b"".join(source.segments(spec.start, spec.start + 8))) == raw_bytes(torch.tensor([99]))


def test_destination_round_trips_bit_exactly():
    state = mixed_state()
    source = SourceBytes(state)
    dest = Destination(source.layout)
    source.read_into(0, dest.view)
    assert list(dest.tensors()) == list(state)  # the layout keeps the source's order
    assert_bit_exact(state, dest.tensors())


def test_non_contiguous_tensors_travel_as_their_logical_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"t": base.t(), "s": base[:, 1]}
    source = SourceBytes(state)
    dest = Destination(source.layout)
    source.read_into(0, dest.view)
    got = dest.tensors()
    assert torch.equal(got["t"], base.t()) and torch.equal(got["s"], base[:, 1])


def test_large_destinations_are_usable_tensors():
    state = {"w": torch.randn(64, 1024, 1024 // 64 * 1)}  # 4 MiB
    state["big"] = torch.randn(10 * 1024 * 1024 // 4)  # 40 MiB: the huge-page path
    source = SourceBytes(state)
    dest = Destination(source.layout)
    source.read_into(0, dest.view)
    assert list(dest.tensors()) == list(state)  # the layout keeps the source's order
    assert_bit_exact(state, dest.tensors())


def test_digest_does_not_depend_on_dict_order():
    state = mixed_state()
    reordered = dict(reversed(list(state.items())))
    a = build_manifest(1, SourceBytes(state), chunk_size=64)
    b = build_manifest(1, SourceBytes(reordered), chunk_size=64)
    assert a.digest == b.digest


def test_digest_changes_with_any_bit_and_with_chunk_size():
    state = mixed_state()
    base = build_manifest(1, SourceBytes(state), chunk_size=64).digest
    assert build_manifest(1, SourceBytes(state), chunk_size=128).digest != base
    state["layer.0.w"][2, 3] += 1e-6
    assert build_manifest(1, SourceBytes(state), chunk_size=64).digest != base


def test_the_job_config_offers_exactly_the_digests_a_receiver_can_check():
    from typing import get_args

    from rolectl.roles.config import TransportConfig

    offered = get_args(TransportConfig.model_fields["digest"].annotation)
    assert set(offered) == set(DIGEST_ALGORITHMS)
    assert TransportConfig().digest == DEFAULT_DIGEST_ALGORITHM == "xxh3-128"


@pytest.mark.parametrize("algorithm", sorted(DIGEST_ALGORITHMS))
def test_manifest_round_trips_through_json(algorithm):
    source = SourceBytes(mixed_state())
    manifest = build_manifest(3, source, chunk_size=40, algorithm=algorithm, extra={"first_seq": 7})
    again = Manifest.from_bytes(manifest.to_bytes(), where="test")
    assert again == manifest
    assert again.digest.startswith(f"{algorithm}:")


def test_manifest_with_a_forged_chunk_list_is_corrupt():
    manifest = build_manifest(3, SourceBytes(mixed_state()), chunk_size=40)
    data = manifest.to_json()
    data["chunk_digests"][1] = "00" * len(manifest.chunk_digests[1])
    with pytest.raises(CorruptWeights, match="manifest chunk list hashes to"):
        Manifest.from_json(data, where="stream X")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="other/1"), "format is 'other/1'"),
        (lambda d: d.update(nbytes=1), "nbytes 1 but the header covers"),
        (lambda d: d["chunk_digests"].pop(), "chunk digests for"),
        (lambda d: d.pop("header"), "malformed manifest"),
    ],
)
def test_malformed_manifests_are_corrupt_with_the_reason(mutate, message):
    data = build_manifest(3, SourceBytes(mixed_state()), chunk_size=40).to_json()
    mutate(data)
    with pytest.raises(CorruptWeights, match=message):
        Manifest.from_json(data, where="here")


def test_a_digest_algorithm_unknown_here_is_named_with_the_ones_known():
    data = build_manifest(3, SourceBytes(mixed_state()), chunk_size=40).to_json()
    data["algorithm"] = "md17"
    with pytest.raises(TransferError, match="'md17' is not known to this rolectl.*available: blake3, sha256, "
                       "xxh3-128") as info:
        Manifest.from_json(data, where="here")
    assert type(info.value) is TransferError  # not corruption: this process cannot check it


def test_manifest_that_is_not_json_is_corrupt():
    with pytest.raises(CorruptWeights, match="here: manifest is not JSON"):
        Manifest.from_bytes(b"\x00garbage", where="here")


def test_check_chunk_names_version_chunk_and_tensors():
    state = mixed_state()
    source = SourceBytes(state)
    manifest = build_manifest(9, source, chunk_size=32)
    start, end = manifest.chunks[2]
    data = bytearray(b"".join(source.segments(start, end)))
    manifest.check_chunk(2, [data], where="w")  # intact: no error
    data[0] ^= 1
    expected_tensors = manifest.layout.tensors_in(start, end)
    with pytest.raises(CorruptWeights) as info:
        manifest.check_chunk(2, [data], where="stream S")
    text = str(info.value)
    assert "stream S: version 9 chunk 2 of" in text and "digest mismatch" in text
    assert expected_tensors[0] in text
    with pytest.raises(CorruptWeights, match="has 3 bytes, expected"):
        manifest.check_chunk(2, [bytes(3)], where="w")


@pytest.mark.parametrize(
    "header, message",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "needs 8"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "starts at byte 4, expected 0"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, "not a multiple of its element size"),
        ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, "unknown dtype"),
        ({"a": {"dtype": "F32"}}, "malformed header entry"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "negative dimension"),
    ],
)
def test_bad_headers_are_rejected_with_what_is_wrong(header, message):
    with pytest.raises(ValueError, match=message):
        Layout.from_header(header)


def test_header_round_trips_and_ignores_safetensors_metadata():
    layout = plan_layout(mixed_state())
    header = json.loads(json.dumps(layout.header()))
    header["__metadata__"] = {"x": "y"}
    assert Layout.from_header(header) == layout


def test_sparse_and_non_tensors_are_refused():
    with pytest.raises(TypeError, match="only dense"):
        plan_layout({"s": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        plan_layout({"x": [1, 2]})


# streams (issue 27) -------------------------------------------------------------------------------


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w.bf16": torch.randn(8, 4, generator=g).bfloat16(),
        "bias.f32": torch.randn(3, generator=g),  # 12 bytes: not a multiple of 8
        "ids.i64": torch.arange(5),
        "norm.f16": torch.randn(5, generator=g).half(),  # 10 bytes
        "w.f32": torch.randn(4, 4, generator=g),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
    }


def _streamed_bytes(chunks: StreamedChunks) -> bytes:
    return b"".join(b"".join(bytes(p) for p in parts) for _, parts, _ in chunks.chunks())


def test_a_stream_is_laid_out_in_arrival_order_with_odd_sizes_last_and_aligned():
    state = _mixed()
    chunks = streamed_chunks([[(n, t)] for n, t in state.items()], chunk_size=16, algorithm="sha256")
    data = _streamed_bytes(chunks)
    layout = Layout.from_header(chunks.layout.header())  # what a receiver accepts
    starts = {s.name: s.start for s in layout.specs}
    assert [n for n in sorted(starts, key=lambda n: (starts[n], n)) if state[n].numel()] == [
        "w.bf16", "ids.i64", "w.f32", "bias.f32", "norm.f16", "flag"]
    dest = Destination(layout)
    dest.view[:] = data
    got = dest.tensors()
    assert all(torch.equal(got[n], t) for n, t in state.items())
    assert len(chunks.chunk_digests) == -(-len(data) // 16)


def test_a_mapping_streams_with_the_layout_and_digest_it_always_had():
    state = _mixed()
    chunks = streamed_chunks(state, chunk_size=16, algorithm="sha256")
    data = _streamed_bytes(chunks)
    before = build_manifest(1, SourceBytes(state), chunk_size=16, algorithm="sha256")
    now = build_manifest(1, chunks.layout, chunk_size=16, algorithm="sha256", chunk_digests=chunks.chunk_digests)
    assert now.digest == before.digest and chunks.layout == plan_layout(state)
    buf = bytearray(len(data))
    SourceBytes(state).read_into(0, memoryview(buf))
    assert bytes(buf) == data


def test_a_stream_is_read_one_bucket_at_a_time():
    made = []

    def stream():
        for k in range(5):
            made.append(k)
            yield [(f"t{k}", torch.full((8,), float(k)))]  # 32 bytes: two 16-byte chunks

    chunks = streamed_chunks(stream(), chunk_size=16, algorithm="sha256")
    seen = []
    for index, _, _ in chunks.chunks():
        seen.append((index, len(made)))
    assert seen == [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4), (8, 5), (9, 5)]


def test_a_stream_repeating_a_name_or_holding_a_non_tensor_is_refused():
    with pytest.raises(ValueError, match="'a' appears twice"):
        _streamed_bytes(streamed_chunks([[("a", torch.zeros(2))], [("a", torch.zeros(2))]],
                                        chunk_size=8, algorithm="sha256"))
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        _streamed_bytes(streamed_chunks([[("a", [1, 2])]], chunk_size=8, algorithm="sha256"))


def test_the_layout_of_a_stream_is_known_only_once_it_has_ended():
    chunks = streamed_chunks([[("a", torch.zeros(2))]], chunk_size=8, algorithm="sha256")
    with pytest.raises(RuntimeError, match="only once the stream has ended"):
        _ = chunks.layout
