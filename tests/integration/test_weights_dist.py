"""Integration: TorchDistTransport over gloo with real explorer processes (the trainer is this process).

Each explorer is this file run as a script (`python test_weights_dist.py '<json spec>'`): it
receives the rounds of its spec and prints one JSON line per round (outcome, bit-exactness,
whether the destination stayed untouched, groups formed so far). Rounds travel as plain decision
maps (`sync_protocol.to_plain`), never pickled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # when run as an explorer script
    sys.path.insert(0, str(_ROOT))

from rolectl.bus.logging import setup_logging  # noqa: E402
from rolectl.bus.server import free_port  # noqa: E402
from rolectl.bus.weights import CorruptWeights, PeerLost, TransferError  # noqa: E402
from rolectl.bus.weights.host_memory import PinnedStaging  # noqa: E402
from rolectl.bus.weights.torch_dist import TorchDistTransport  # noqa: E402
from rolectl.sync_protocol import MemberRef, RankAssignment, RendezvousReady, Role, SyncMethod  # noqa: E402
from tests.support.rendezvous import rendezvous_from_plain, rendezvous_to_plain  # noqa: E402

KIB = 1024
_RESULT = "RESULT "
# Small buckets so even this small state dict takes several packed and direct broadcasts.
SMALL = {"bucket_bytes": 128 * KIB, "direct_min_bytes": 256 * KIB}


# --------------------------------------------------------------------------------------------------
# state dicts: deterministic per version, mixed dtypes and shapes


def _layout(kind: str) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if kind == "many":  # 50 MiB in 200 small fp32 tensors: many buckets, a long broadcast
        return [(f"block.{i}", torch.float32, (256, 256)) for i in range(200)]
    return [
        ("embed.weight", torch.float32, (512, 256)),  # 512 KiB: direct
        ("layers.0.qkv", torch.bfloat16, (256, 384)),  # packed
        ("layers.0.qkv.bias", torch.bfloat16, (384,)),
        ("layers.0.norm", torch.float32, (256,)),
        ("layers.0.mlp", torch.float32, (256, 300)),  # 300 KiB: direct (dest non-contiguous on rank 1)
        ("layers.1.qkv", torch.bfloat16, (256, 384)),
        ("head.weight", torch.float32, (300, 256)),  # source non-contiguous on the trainer
        ("step", torch.int64, ()),
        ("positions", torch.int64, (1000,)),
        ("empty", torch.float32, (0, 4)),
        ("mask", torch.bool, (17,)),
        ("big.bf16", torch.bfloat16, (700, 512)),  # 700 KiB bf16: direct
    ]


def _state_dict(version: int, kind: str = "mixed") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + version)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in _layout(kind):
        if dtype == torch.int64:
            t = torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randn(shape, generator=gen).to(dtype)
            if t.numel() > 3:  # special values must survive bit for bit
                t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        if name == "head.weight":
            t = t.t().contiguous().t()  # same values, transposed strides
        out[name] = t
    return out


def _destination(kind: str, *, local_rank: int, bad: str | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape in _layout(kind):
        if name == bad:
            shape = (*shape[:-1], shape[-1] + 1) if shape else (2,)
        out[name] = torch.zeros(shape, dtype=dtype)
        if name == "layers.0.mlp" and local_rank == 1:
            out[name] = torch.zeros(shape[::-1], dtype=dtype).t()  # non-contiguous destination
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k]))
        for k in a
    )


def _all_zero(d: dict[str, torch.Tensor]) -> bool:
    return all(not _bits(t).any() for t in d.values())


# --------------------------------------------------------------------------------------------------
# the explorer process


class _KillOnCopy(torch.Tensor):
    """A destination tensor that SIGKILLs its process when the transport copies into it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__torch_function__(func, types, args, kwargs or {})


async def _explorer_main(spec: dict) -> None:
    setup_logging("info", stream=sys.stderr)  # stdout carries the result lines only
    torch.set_num_threads(1)
    me = MemberRef(role=Role.EXPLORER, id=spec["member"], incarnation=0)
    async with TorchDistTransport(**spec["transport"]) as transport:
        for plain in spec["rounds"]:
            ready = rendezvous_from_plain(plain)
            kind = spec.get("kind", "mixed")
            dests = [
                _destination(kind, local_rank=j,
                             bad=(spec.get("bad") if j == spec["ranks"] - 1
                                  and ready.round in spec.get("bad_rounds", ()) else None))
                for j in range(spec["ranks"])
            ]
            if spec.get("kill_on_copy"):
                name = spec["kill_on_copy"]
                dests[0][name] = dests[0][name].as_subclass(_KillOnCopy)
            started = time.monotonic()
            try:
                nbytes = await transport.receive(ready, me, dests[0], also_into=dests[1:])
                outcome = "ok"
            except TransferError as exc:
                nbytes, outcome = 0, type(exc).__name__
            expected = _state_dict(ready.version, kind)
            print(_RESULT + json.dumps({
                "round": ready.round,
                "outcome": outcome,
                "nbytes": nbytes,
                "exact": all(_same_bits({k: v.contiguous() for k, v in d.items()}, expected) for d in dests),
                "unchanged": all(_all_zero(d) for d in dests),
                "groups_formed": transport.groups_formed,
                "seconds": time.monotonic() - started,
            }), flush=True)


# --------------------------------------------------------------------------------------------------
# the trainer side: this process


class _Explorer:
    """An explorer process and the result lines it prints."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def result(self, timeout: float = 30.0) -> dict:
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
            if not line:
                err = await asyncio.wait_for(self.proc.stderr.read(), timeout)
                raise AssertionError(f"explorer exited ({self.proc.returncode}): {err.decode()[-2000:]}")
            if line.startswith(_RESULT.encode()):
                return json.loads(line[len(_RESULT):])

    async def finish(self, timeout: float = 30.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def _spawn(spec: dict) -> _Explorer:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, json.dumps(spec),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(_ROOT),
    )
    return _Explorer(proc)


def _explorer(i: int) -> MemberRef:
    return MemberRef(role=Role.EXPLORER, id=f"e{i}", incarnation=0)


def _ready(round_: int, version: int, epoch: int, port: int, ranks: list[int]) -> RendezvousReady:
    participants, offset = [], 1
    for i, n in enumerate(ranks):
        participants.append(RankAssignment(member=_explorer(i), rank_offset=offset, ranks=n))
        offset += n
    return RendezvousReady.for_group(
        round=round_, cause_seq=round_, method=SyncMethod.NCCL, version=version, epoch=epoch,
        master_addr="127.0.0.1", master_port=port, participants=participants,
    )


def _spec(i: int, rounds: list[RendezvousReady], ranks: int, **extra) -> dict:
    transport = {"timeout": 5.0, "connect_timeout": 60.0, **SMALL, **extra.pop("transport", {})}
    return {"member": f"e{i}", "ranks": ranks, "rounds": [rendezvous_to_plain(r) for r in rounds],
            "transport": transport, **extra}


@pytest.fixture
async def explorers():
    """Explorer processes started by a test; any left running are killed at the end."""
    started: list[_Explorer] = []

    async def spawn(spec: dict) -> _Explorer:
        e = await _spawn(spec)
        started.append(e)
        return e

    yield spawn
    for e in started:
        e.kill()
        await e.finish()


# --------------------------------------------------------------------------------------------------
# tests


@pytest.mark.timeout(60)
async def test_round_trip_is_bit_exact_to_two_explorers_of_two_ranks(explorers):
    port = free_port()
    ready = _ready(1, 7, 1, port, [2, 2])
    # Explorer 1 stages every bucket before touching its destination (atomic_receive).
    procs = [await explorers(_spec(i, [ready], ranks=2, transport={"atomic_receive": i == 1})) for i in range(2)]
    sent = _state_dict(7)
    async with TorchDistTransport(timeout=5.0, connect_timeout=60.0, **SMALL) as trainer:
        nbytes = await trainer.send(ready, sent)
        assert trainer.backend == "gloo"
    assert nbytes == sum(t.numel() * t.element_size() for t in sent.values())
    for p in procs:
        got = await p.result()
        assert got["outcome"] == "ok" and got["exact"] and got["nbytes"] == nbytes
        assert await p.finish() == 0


@pytest.mark.timeout(60)
async def test_group_is_reused_within_an_epoch_and_re_formed_at_a_new_one(explorers):
    port1, port2 = free_port(), free_port()
    rounds = [_ready(1, 1, 1, port1, [2, 1]), _ready(2, 2, 1, port1, [2, 1]), _ready(3, 3, 2, port2, [2, 1])]
    procs = [await explorers(_spec(i, rounds, ranks=n)) for i, n in enumerate([2, 1])]
    async with TorchDistTransport(timeout=5.0, connect_timeout=60.0, **SMALL) as trainer:
        formed = []
        for ready in rounds:
            await trainer.send(ready, _state_dict(ready.version))
            formed.append((trainer.epoch, trainer.groups_formed))
    assert formed == [(1, 1), (1, 1), (2, 2)]
    for p in procs:
        lines = [await p.result() for _ in rounds]
        assert [(x["outcome"], x["exact"]) for x in lines] == [("ok", True)] * 3
        assert [x["groups_formed"] for x in lines] == [1, 1, 2]
        assert await p.finish() == 0


@pytest.mark.timeout(60)
async def test_layout_mismatch_is_corrupt_everywhere_copies_nothing_and_keeps_the_group(explorers):
    port = free_port()
    rounds = [_ready(1, 1, 1, port, [2, 1]), _ready(2, 2, 1, port, [2, 1])]
    # Round 1: explorer 0's second rank expects another shape for one tensor; round 2 it is right.
    procs = [await explorers(_spec(0, rounds, ranks=2, bad="layers.0.norm", bad_rounds=[1])),
             await explorers(_spec(1, rounds, ranks=1))]
    async with TorchDistTransport(timeout=5.0, connect_timeout=60.0, **SMALL) as trainer:
        with pytest.raises(CorruptWeights):
            await trainer.send(rounds[0], _state_dict(1))
        assert trainer.epoch == 1  # a rejected layout leaves the group in step
        await trainer.send(rounds[1], _state_dict(2))
        assert trainer.groups_formed == 1
    for p in procs:
        rejected, accepted = await p.result(), await p.result()
        assert rejected["outcome"] == "CorruptWeights" and rejected["unchanged"]
        assert accepted["outcome"] == "ok" and accepted["exact"] and accepted["groups_formed"] == 1
        assert await p.finish() == 0


@pytest.mark.timeout(60)
async def test_a_peer_killed_mid_broadcast_is_peer_lost_quickly_and_the_next_epoch_works(explorers):
    port1, port2 = free_port(), free_port()
    timeout = 5.0
    first = _ready(1, 1, 1, port1, [2, 1])
    # After explorer 0 dies, the synchronizer re-forms with the survivor alone (now at rank 1).
    survivor_next = RendezvousReady.for_group(
        round=2, cause_seq=2, method=SyncMethod.NCCL, version=2, epoch=2, master_addr="127.0.0.1",
        master_port=port2,
        participants=(RankAssignment(member=_explorer(1), rank_offset=1, ranks=1),),
    )
    big = {"bucket_bytes": 1 << 20, "direct_min_bytes": 8 << 20}
    victim = await explorers(_spec(0, [first], ranks=2, kind="many", kill_on_copy="block.40",
                                   transport={**big, "timeout": timeout}))
    survivor = await explorers(_spec(1, [first, survivor_next], ranks=1, kind="many",
                                     transport={**big, "timeout": timeout}))
    async with TorchDistTransport(timeout=timeout, connect_timeout=60.0, **big) as trainer:
        started = time.monotonic()
        with pytest.raises(PeerLost):
            await trainer.send(first, _state_dict(1, "many"))
        # found by the group timeout, not hung: the bound includes forming the group and the
        # transfer up to the kill, which on a loaded machine take a while
        assert time.monotonic() - started < 3 * timeout + 15
        assert trainer.epoch is None  # the broken group was dropped
        assert await victim.finish() == -signal.SIGKILL
        lost = await survivor.result()
        assert lost["outcome"] == "PeerLost"
        await trainer.send(survivor_next, _state_dict(2, "many"))
        assert trainer.epoch == 2
    again = await survivor.result()
    assert again["outcome"] == "ok" and again["exact"]
    assert await survivor.finish() == 0


@pytest.mark.timeout(60)
async def test_a_hung_peer_is_peer_lost_after_the_timeout_not_a_hang(explorers):
    port = free_port()
    timeout = 3.0
    rounds = [_ready(1, 1, 1, port, [1]), _ready(2, 2, 1, port, [1])]
    hung = await explorers(_spec(0, rounds, ranks=1, transport={"timeout": timeout}))
    async with TorchDistTransport(timeout=timeout, connect_timeout=60.0, **SMALL) as trainer:
        await trainer.send(rounds[0], _state_dict(1))
        assert (await hung.result())["outcome"] == "ok"
        hung.proc.send_signal(signal.SIGSTOP)  # alive but silent: only the timeout can tell
        started = time.monotonic()
        with pytest.raises(PeerLost):
            await trainer.send(rounds[1], _state_dict(2))
        elapsed = time.monotonic() - started
    hung.proc.send_signal(signal.SIGCONT)
    # not before the timeout (a hung peer looks alive until then), and not a hang: the upper
    # bound leaves room for a loaded machine
    assert timeout * 0.5 < elapsed < timeout + 30, elapsed


def test_staging_buffer_is_reused_across_rounds_and_grows_with_headroom():
    staging = PinnedStaging()
    first = staging.buffer(1000)
    assert first.numel() == 1000 and first.dtype == torch.uint8
    assert staging.buffer(800).data_ptr() == first.data_ptr()  # smaller: the same memory
    grown = staging.buffer(1001)
    assert staging.capacity >= 1001 + 1000 // 8 - 1  # grown by at least 1/8, not byte by byte
    assert staging.buffer(1100).data_ptr() == grown.data_ptr()
    staging.close()
    assert staging.capacity == 0


# --------------------------------------------------------------------------------------------------
# sending from a bucket stream (issue 27): the layout first, then the buckets as they come


def _stream(version: int, kind: str, per_bucket: int, made: list[int], sent: list[int]):
    """The state dict of `version` as a bucket stream of fresh tensors; records, as each bucket is
    made, how many of the tensor bytes made before it had been broadcast."""
    tensors = list(_state_dict(version, kind).items())
    produced = 0
    for i in range(0, len(tensors), per_bucket):
        made.append(produced - sent[0])
        bucket = [(name, t.clone()) for name, t in tensors[i : i + per_bucket]]
        produced += sum(t.numel() * t.element_size() for _, t in bucket)
        yield bucket


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,per_bucket", [("mixed", 3), ("many", 4)])
async def test_a_bucket_stream_with_its_layout_arrives_bit_exact_and_is_read_lazily(
        explorers, monkeypatch, kind, per_bucket):
    from rolectl.bus.weights import dist_rounds

    sent = [0]
    real = dist_rounds.RankLink._broadcast

    def counting(self, t, channel=0):
        work = real(self, t, channel)
        if t.numel() > 64:  # data, not the header length / verdict
            sent[0] += t.numel()
        return work

    monkeypatch.setattr(dist_rounds.RankLink, "_broadcast", counting)
    port = free_port()
    ready = _ready(1, 3, 1, port, [1])
    proc = await explorers(_spec(0, [ready], ranks=1, kind=kind))
    made: list[int] = []
    async with TorchDistTransport(timeout=5.0, connect_timeout=60.0, **SMALL) as trainer:
        nbytes = await trainer.send(ready, _stream(3, kind, per_bucket, made, sent), layout=_layout(kind))
    expected = _state_dict(3, kind)
    assert nbytes == sum(t.numel() * t.element_size() for t in expected.values())
    got = await proc.result()
    assert got["outcome"] == "ok" and got["exact"] and got["nbytes"] == nbytes
    assert await proc.finish() == 0
    # never more than two of the stream's buckets ahead of the broadcasts (the header is not counted)
    largest = max(sum(t.numel() * t.element_size() for t in list(expected.values())[i : i + per_bucket])
                  for i in range(0, len(expected), per_bucket))
    assert len(made) == -(-len(expected) // per_bucket)
    assert max(made) <= 2 * largest, (max(made), largest)
    assert sent[0] >= nbytes - 64 * len(expected)  # the count of broadcast bytes does count


@pytest.mark.timeout(60)
async def test_a_stream_that_differs_from_its_declared_layout_fails_the_round(explorers):
    port = free_port()
    ready = _ready(1, 3, 1, port, [1])
    proc = await explorers(_spec(0, [ready], ranks=1))
    layout = _layout("mixed")
    wrong = [list(_state_dict(3).items())[:-1]]  # the last tensor is missing
    async with TorchDistTransport(timeout=3.0, connect_timeout=60.0, **SMALL) as trainer:
        with pytest.raises(TransferError, match="stream ended after 11 tensors; its declared layout has 12"):
            await trainer.send(ready, iter(wrong), layout=layout)
        assert trainer.epoch is None  # the explorer got part of a version: the group is dropped
    got = await proc.result()
    assert got["outcome"] == "PeerLost"


@pytest.mark.timeout(60)
async def test_a_stream_without_its_layout_is_gathered_first_and_still_arrives(explorers):
    port = free_port()
    ready = _ready(1, 4, 1, port, [1])
    proc = await explorers(_spec(0, [ready], ranks=1))
    async with TorchDistTransport(timeout=5.0, connect_timeout=60.0, **SMALL) as trainer:
        await trainer.send(ready, _stream(4, "mixed", 5, [], [0]))
    got = await proc.result()
    assert got["outcome"] == "ok" and got["exact"]


if __name__ == "__main__":
    asyncio.run(_explorer_main(json.loads(sys.argv[1])))
