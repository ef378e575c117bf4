"""Delta sync's pure parts: the XOR codec, the publisher's keyframe cadence, the wire-dtype cast, and
the config rules of `transport.wire_dtype` / `keyframe_interval`."""

from __future__ import annotations

import pytest
import torch

from rolectl.bus.weights.base import CorruptWeights, restartable
from rolectl.bus.weights.delta import (
    CODECS,
    DeltaPublisher,
    apply_chunk,
    cast_source,
    default_codec,
    delta_info,
    xor_into,
    xor_shuffled,
    xor_unshuffled,
)
from rolectl.bus.weights.format import build_manifest, streamed_chunks
from rolectl.roles.config import ConfigError, load_config


@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 4096])
def test_xor_is_its_own_inverse_at_any_length(n):
    g = torch.Generator().manual_seed(n)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
    out = bytearray(n)
    xor_into(memoryview(out), a, b)
    back = bytearray(n)
    xor_into(memoryview(back), bytes(out), b)
    assert bytes(back) == a


def test_zstandard_is_the_default_codec_here():
    assert default_codec() == "zstd" and "zlib" in CODECS


def _version(pub: DeltaPublisher, version: int, tensors: dict[str, torch.Tensor], chunk: int = 64):
    chunks = pub.wrap(version, streamed_chunks(tensors, chunk_size=chunk, algorithm="sha256"))
    payloads = [bytes(b"".join(parts)) for _, parts, _ in chunks.chunks()]
    manifest = build_manifest(version, chunks.layout, chunk_size=chunk, algorithm="sha256",
                              chunk_digests=chunks.chunk_digests,
                              extra=chunks.manifest_extra() if hasattr(chunks, "manifest_extra") else {})
    pub.commit(chunks, manifest)
    return manifest, payloads


def test_a_keyframe_every_interval_versions_and_none_without_deltas():
    pub = DeltaPublisher(3)
    w = torch.zeros(64)
    kinds = []
    for v in range(1, 8):
        w = w.clone()
        w[v] = v
        manifest, _ = _version(pub, v, {"w": w})
        kinds.append("delta" if "delta" in manifest.extra else "keyframe")
    assert kinds == ["keyframe", "delta", "delta", "keyframe", "delta", "delta", "keyframe"]
    off = DeltaPublisher(1)
    manifest, _ = _version(off, 1, {"w": w})
    manifest, _ = _version(off, 2, {"w": w})
    assert "delta" not in manifest.extra


def test_a_decoded_chunk_is_checked_and_a_bad_one_names_version_and_chunk():
    pub = DeltaPublisher(4)
    old = torch.arange(64, dtype=torch.float32)
    new = old.clone()
    new[20] = -1.0
    base_manifest, base_payloads = _version(pub, 1, {"w": old})
    manifest, payloads = _version(pub, 2, {"w": new})
    info = delta_info(manifest, where="test")
    assert info is not None and info.base == 1 and info.changed_bytes <= 4
    _, decompress = CODECS[info.codec]()
    base = b"".join(base_payloads)
    out = bytearray(len(base))
    for index, (a, b) in enumerate(manifest.chunks):
        apply_chunk(manifest, info, index, payloads[index], memoryview(out)[a:b], memoryview(base)[a:b],
                    decompress, where="test")
    assert bytes(out) == new.numpy().tobytes()
    a, b = manifest.chunks[1]
    wrong_base = bytearray(base)
    wrong_base[a] ^= 1  # a base that is not what the delta was made on
    with pytest.raises(CorruptWeights, match=r"version 2 chunk 1 of"):
        apply_chunk(manifest, info, 1, payloads[1], memoryview(out)[a:b], memoryview(bytes(wrong_base))[a:b],
                    decompress, where="test")
    with pytest.raises(CorruptWeights, match=r"version 2 delta chunk 1 of .* does not decompress"):
        apply_chunk(manifest, info, 1, b"\x00" * len(payloads[1]), memoryview(out)[a:b],
                    memoryview(base)[a:b], decompress, where="test")


def test_the_cast_keeps_a_stream_restartable_and_leaves_integers_alone():
    buckets = [[("w", torch.ones(2)), ("ids", torch.arange(2))]]
    cast = cast_source(buckets, torch.bfloat16)
    assert restartable(cast)
    first = [[(n, t.dtype) for n, t in b] for b in cast()]  # type: ignore[operator]
    assert first == [[("w", torch.bfloat16), ("ids", torch.int64)]]
    assert not restartable(cast_source(iter(buckets), torch.bfloat16))
    assert cast_source(buckets, None) is buckets


def _job(tmp_path, transport: str, method: str = "memory"):
    path = tmp_path / "job.yaml"
    path.write_text(f"job: j\nsynchronizer: {{sync_method: {method}}}\ntransport: {transport}\n"
                    "model: {engine: tiny}\n")
    return load_config(path)


def test_wire_dtype_and_keyframe_interval_are_checked(tmp_path):
    cfg = _job(tmp_path, "{wire_dtype: bfloat16, keyframe_interval: 8}")
    assert cfg.transport.wire_dtype == "bfloat16" and cfg.transport.keyframe_interval == 8
    with pytest.raises(ConfigError, match="transport.wire_dtype.*pull methods"):
        _job(tmp_path, "{wire_dtype: bfloat16}", method="nccl")
    with pytest.raises(ConfigError, match="keyframe_interval"):
        _job(tmp_path, "{keyframe_interval: 0}")
    with pytest.raises(ConfigError, match="wire_dtype"):
        _job(tmp_path, "{wire_dtype: int8}")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 13, 4096])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_grouped_xor_is_undone_exactly(n, width):
    g = torch.Generator().manual_seed(n + width)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
    grouped = xor_shuffled(a, b, width).tobytes()
    out = bytearray(n)
    xor_unshuffled(memoryview(out), b, grouped, width)
    assert bytes(out) == a
    xor_unshuffled(memoryview(out), None, xor_shuffled(a, bytes(n), width).tobytes(), width)
    assert bytes(out) == a
