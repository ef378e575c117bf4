"""Integration: CudaIpcTransport between this process (trainer) and an explorer process on the same GPU.

The handle channel is the explorer's stdin/stdout carrying length-prefixed byte frames (the roles
use NATS request/reply instead). Needs a CUDA device; skipped only when there is none.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:  # when run as an explorer script
    sys.path.insert(0, str(_ROOT))

from rolectl.bus.logging import setup_logging  # noqa: E402
from rolectl.bus.weights import CorruptWeights, PeerLost, TransferError  # noqa: E402
from rolectl.bus.weights.cuda_ipc import CudaIpcTransport, HandleRequest  # noqa: E402
from rolectl.sync_protocol import MemberRef, RankAssignment, RendezvousReady, Role, SyncMethod  # noqa: E402
from tests.support.rendezvous import rendezvous_from_plain, rendezvous_to_plain  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXPLORER = MemberRef(role=Role.EXPLORER, id="e0", incarnation=0)


def _layout() -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [
        ("embed", torch.float32, (1024, 512)),
        ("qkv", torch.bfloat16, (512, 1536)),
        ("norm", torch.float32, (512,)),
        ("step", torch.int64, ()),
        ("positions", torch.int64, (4096,)),
        ("empty", torch.bfloat16, (0, 8)),
    ]


def _state_dict(version: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + version)
    out = {}
    for name, dtype, shape in _layout():
        if dtype == torch.int64:
            t = torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)
        else:
            t = torch.randn(shape, generator=gen).to(dtype)
        out[name] = t.to(device)
    return out


def _ready(round_: int, version: int) -> RendezvousReady:
    return RendezvousReady.for_group(
        round=round_, cause_seq=round_, method=SyncMethod.CUDA_IPC, version=version, epoch=1,
        master_addr="127.0.0.1", master_port=1,
        participants=(RankAssignment(member=EXPLORER, rank_offset=1, ranks=1),),
    )


def _frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    return await reader.readexactly(n)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------------------------------
# the explorer process: frames in on stdin, frames out on stdout


async def _explorer_main(spec: dict) -> None:
    setup_logging("info", stream=sys.stderr)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)

    def write(data: bytes) -> None:
        sys.stdout.buffer.write(_frame(data))
        sys.stdout.buffer.flush()

    async def recv_handles() -> HandleRequest:
        payload = await _read_frame(reader)

        async def reply(data: bytes) -> None:
            write(data)

        return HandleRequest(payload=payload, reply=reply)

    async with CudaIpcTransport(recv_handles=recv_handles, timeout=30.0) as transport:
        for plain in spec["rounds"]:
            ready = rendezvous_from_plain(plain)
            into = {name: torch.zeros(shape, dtype=dtype, device="cuda:0") for name, dtype, shape in _layout()}
            if spec.get("bad") and ready.round == 1:
                into["norm"] = torch.zeros(513, device="cuda:0")
            try:
                nbytes, outcome = await transport.receive(ready, EXPLORER, into), "ok"
            except TransferError as exc:
                nbytes, outcome = 0, type(exc).__name__
            expected = _state_dict(ready.version, "cpu")
            exact = all(torch.equal(_bits(into[k]), _bits(v)) for k, v in expected.items() if into[k].shape == v.shape)
            unchanged = all(not _bits(t).any() for t in into.values())
            write(json.dumps({"outcome": outcome, "nbytes": nbytes, "exact": exact, "unchanged": unchanged}).encode())


# --------------------------------------------------------------------------------------------------
# trainer side


class _Explorer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send_handles(self, member: MemberRef, payload: bytes) -> bytes:
        assert member == EXPLORER
        self.proc.stdin.write(_frame(payload))
        await self.proc.stdin.drain()
        return await _read_frame(self.proc.stdout)

    async def result(self) -> dict:
        return json.loads(await asyncio.wait_for(_read_frame(self.proc.stdout), 30))


@pytest.fixture
async def spawn():
    procs: list[asyncio.subprocess.Process] = []

    async def start(rounds: list[RendezvousReady], **extra) -> _Explorer:
        spec = {"rounds": [rendezvous_to_plain(r) for r in rounds], **extra}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, json.dumps(spec), cwd=str(_ROOT),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        procs.append(proc)
        return _Explorer(proc)

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.timeout(60)
async def test_two_versions_arrive_bit_exact_through_reused_buckets(spawn):
    rounds = [_ready(1, 1), _ready(2, 2)]
    explorer = await spawn(rounds)
    async with CudaIpcTransport(send_handles=explorer.send_handles, bucket_bytes=1 << 20, timeout=30.0) as trainer:
        sent = await trainer.send(rounds[0], _state_dict(1, "cuda:0"))
        first = await explorer.result()
        pointers = [b.data_ptr() for b in trainer._buckets]
        await trainer.send(rounds[1], _state_dict(2, "cuda:0"))
        second = await explorer.result()
        assert [b.data_ptr() for b in trainer._buckets] == pointers  # no reallocation per version
    assert sent == sum(t.numel() * t.element_size() for t in _state_dict(1, "cpu").values())
    for got in (first, second):
        assert got["outcome"] == "ok" and got["exact"] and got["nbytes"] == sent
    assert await explorer.proc.wait() == 0


@pytest.mark.timeout(60)
async def test_layout_mismatch_is_corrupt_on_both_sides_and_copies_nothing(spawn):
    rounds = [_ready(1, 1), _ready(2, 2)]
    explorer = await spawn(rounds, bad=True)
    async with CudaIpcTransport(send_handles=explorer.send_handles, timeout=30.0) as trainer:
        with pytest.raises(CorruptWeights):
            await trainer.send(rounds[0], _state_dict(1, "cuda:0"))
        rejected = await explorer.result()
        await trainer.send(rounds[1], _state_dict(2, "cuda:0"))
        accepted = await explorer.result()
    assert rejected["outcome"] == "CorruptWeights" and rejected["unchanged"]
    assert accepted["outcome"] == "ok" and accepted["exact"]


@pytest.mark.timeout(60)
async def test_an_explorer_that_never_confirms_is_peer_lost_after_the_timeout():
    async def silent(member: MemberRef, payload: bytes) -> bytes:
        await asyncio.Event().wait()  # the request is never answered
        return b""

    timeout = 2.0
    async with CudaIpcTransport(send_handles=silent, timeout=timeout) as trainer:
        started = time.monotonic()
        with pytest.raises(PeerLost):
            await trainer.send(_ready(1, 1), _state_dict(1, "cuda:0"))
        assert time.monotonic() - started < timeout + 5
        assert trainer._buckets == []  # a late reader may still map them: never reused


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
async def test_a_bucket_stream_arrives_bit_exact_packed_as_it_comes(spawn, device):
    # A stream of CPU tensors (what a sharded engine's gather hands out) is copied to the GPU buckets.
    rounds = [_ready(1, 1), _ready(2, 2)]
    explorer = await spawn(rounds)
    made = []

    def stream(version):
        for name, t in _state_dict(version, device).items():
            made.append(name)
            yield [(name, t)]

    async with CudaIpcTransport(send_handles=explorer.send_handles, bucket_bytes=1 << 20, timeout=30.0) as trainer:
        sent = await trainer.send(rounds[0], stream(1))
        first = await explorer.result()
        sent_again = await trainer.send(rounds[1], lambda: stream(2))
        second = await explorer.result()
    assert sent == sent_again == sum(t.numel() * t.element_size() for t in _state_dict(1, "cpu").values())
    assert made == [name for name, _, _ in _layout()] * 2
    for got in (first, second):
        assert got["outcome"] == "ok" and got["exact"] and got["nbytes"] == sent
    assert await explorer.proc.wait() == 0


if __name__ == "__main__":
    asyncio.run(_explorer_main(json.loads(sys.argv[1])))
