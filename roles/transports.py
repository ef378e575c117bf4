"""Build the weight transport a job's config asks for, wired to the role's NATS connection."""

from __future__ import annotations

import asyncio
from typing import Any

from bus.server import free_port
from bus.weights.base import PullTransport
from roles.config import JobConfig
from sync_protocol import MemberRef, RendezvousReady, SyncMethod

__all__ = ["make_pull_transport", "make_rendezvous_transport", "RendezvousAdapter"]


def make_pull_transport(cfg: JobConfig, conn) -> PullTransport:
    """Object store (`memory`) or shared-directory checkpoint (`checkpoint`)."""
    method = cfg.synchronizer.sync_method
    if method is SyncMethod.MEMORY:
        from bus.weights.object_store import ObjectStoreTransport

        # The trainer prunes to `trainer.keep_versions` after each publish.
        return ObjectStoreTransport(conn.nc, cfg.job, storage=cfg.transport.object_store_storage,
                                    replicas=cfg.nats.replicas, reconnected=conn.reconnect_signal)
    if method is SyncMethod.CHECKPOINT:
        from bus.weights.checkpoint import CheckpointTransport

        return CheckpointTransport(cfg.weights_checkpoint_dir)
    raise ValueError(f"{method.value} is not a pull method")


class RendezvousAdapter:
    """A rendezvous transport plus what the roles need around it: the port a trainer offers for
    the next group, and (explorers) extra local ranks to receive into."""

    def __init__(self, transport: Any, method: SyncMethod):
        self.transport = transport
        self.method = method

    def offer_port(self) -> int:
        # A fresh port per offer: used only when the decision starts a new group epoch (the
        # current group is reused otherwise), so a stale TCPStore port is never reused.
        return free_port("0.0.0.0")

    async def send(self, ready: RendezvousReady, tensors) -> int:
        return await self.transport.send(ready, tensors)

    async def receive(self, ready: RendezvousReady, me: MemberRef, into, *, also_into=()) -> int:
        if self.method is SyncMethod.NCCL:
            return await self.transport.receive(ready, me, into, also_into=also_into)
        nbytes = await self.transport.receive(ready, me, into)
        for extra in also_into:  # one GPU: the other local ranks copy from the first
            for name, tensor in extra.items():
                tensor.copy_(into[name])
        return nbytes

    async def aclose(self) -> None:
        await self.transport.aclose()


async def make_rendezvous_transport(cfg: JobConfig, session) -> RendezvousAdapter:
    """torch.distributed broadcast (`nccl`: nccl on GPUs, gloo on CPU) or CUDA IPC (`cuda_ipc`)."""
    method = cfg.synchronizer.sync_method
    timeout = cfg.transport.group_timeout_s
    if method is SyncMethod.NCCL:
        from bus.weights.torch_dist import TorchDistTransport

        transport = TorchDistTransport(bucket_bytes=cfg.transport.bucket_size_mb * 1024 * 1024,
                                       timeout=timeout, log=session.log)
        return RendezvousAdapter(transport, method)
    if method is SyncMethod.CUDA_IPC:
        from bus.weights.cuda_ipc import CudaIpcTransport, HandleRequest

        nc = session.conn.nc
        names = session.conn.names

        def subject_of(member: MemberRef) -> str:
            return names.cuda_ipc(member.id)

        async def send_handles(member: MemberRef, payload: bytes) -> bytes:
            reply = await nc.request(subject_of(member), payload, timeout=timeout)
            return reply.data

        inbox: asyncio.Queue = asyncio.Queue()

        async def on_request(msg) -> None:
            await inbox.put(HandleRequest(payload=msg.data, reply=msg.respond))

        async def recv_handles() -> HandleRequest:
            return await inbox.get()

        if session.role.value == "explorer":
            # Subscribed before the explorer can appear in any rendezvous decision.
            await nc.subscribe(subject_of(session.me), cb=on_request)
        transport = CudaIpcTransport(send_handles=send_handles, recv_handles=recv_handles,
                                     bucket_bytes=cfg.transport.bucket_size_mb * 1024 * 1024,
                                     timeout=timeout, log=session.log)
        return RendezvousAdapter(transport, method)
    raise ValueError(f"{method.value} is not a rendezvous method")
