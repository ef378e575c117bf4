"""Build the weight transport a job's config asks for, wired to the role's NATS connection."""

from __future__ import annotations

import asyncio

import torch

from rolectl.bus.weights.base import PullTransport, RendezvousTransport
from rolectl.roles.config import JobConfig
from rolectl.sync_protocol import MemberRef, SyncMethod

__all__ = ["make_pull_transport", "make_rendezvous_transport", "wire_dtype"]


def wire_dtype(cfg: JobConfig) -> torch.dtype | None:
    """The dtype weights travel in (`transport.wire_dtype`), or None for the trainer's own."""
    name = cfg.transport.wire_dtype
    return None if name is None else getattr(torch, name)


def make_pull_transport(cfg: JobConfig, conn) -> PullTransport:
    """Object store (`memory`) or shared-directory checkpoint (`checkpoint`)."""
    method = cfg.synchronizer.sync_method
    if method is SyncMethod.MEMORY:
        from rolectl.bus.weights.object_store import ObjectStoreTransport

        # The trainer prunes to `trainer.keep_versions` after each publish.
        return ObjectStoreTransport(conn.nc, cfg.job, storage=cfg.transport.object_store_storage,
                                    replicas=cfg.nats.replicas, reconnected=conn.reconnect_signal,
                                    keyframe_interval=cfg.transport.keyframe_interval,
                                    fetch_connections=cfg.transport.fetch_connections,
                                    algorithm=cfg.transport.digest)
    if method is SyncMethod.CHECKPOINT:
        from rolectl.bus.weights.checkpoint import CheckpointTransport

        return CheckpointTransport(cfg.weights_checkpoint_dir, keyframe_interval=cfg.transport.keyframe_interval,
                                   algorithm=cfg.transport.digest)
    raise ValueError(f"{method.value} is not a pull method")


async def make_rendezvous_transport(cfg: JobConfig, session) -> RendezvousTransport:
    """torch.distributed broadcast (`nccl`: nccl on GPUs, gloo on CPU) or CUDA IPC (`cuda_ipc`)."""
    method = cfg.synchronizer.sync_method
    if cfg.transport.wire_dtype is not None:
        raise ValueError(f"transport.wire_dtype applies to the pull methods (memory, checkpoint), not to "
                         f"{method.value}: remove it, or set model.dtype for what the explorers load")
    timeout = cfg.transport.group_timeout_s
    if method is SyncMethod.NCCL:
        from rolectl.bus.weights.torch_dist import TorchDistTransport

        return TorchDistTransport(bucket_bytes=cfg.transport.bucket_size_mb * 1024 * 1024,
                                  timeout=timeout, log=session.log)
    if method is SyncMethod.CUDA_IPC:
        from rolectl.bus.weights.cuda_ipc import CudaIpcTransport, HandleRequest

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
        return CudaIpcTransport(send_handles=send_handles, recv_handles=recv_handles,
                                bucket_bytes=cfg.transport.bucket_size_mb * 1024 * 1024,
                                timeout=timeout, log=session.log)
    raise ValueError(f"{method.value} is not a rendezvous method")
