"""Object store weight transport (`SyncMethod.MEMORY`): versions as chunk messages in a JetStream stream.

Theory of operation
-------------------
- **Storage.** One stream per job (`JobNames.weights_stream`, subjects ``rft.<job>.w.>``, one message
  per subject, direct get allowed, `replicas` copies on a cluster), in server memory or in files
  (`storage`; a job's config defaults to file, which is slower because the server re-reads and
  re-checksums whole blocks per message; figures: `python -m benchmarks.weights`, docs). Versions
  are transient: each is superseded at the next sync and the trainer, who holds the weights,
  republishes.
- **Restarts.** Every publish, fetch and prune goes through `bus.retry`: timeouts, "no responders",
  a dropped data connection and "no stream listens on this subject" are retried (publish for
  `publish_retry_s`, 300 s; fetch and prune for `fetch_retry_s`, 60 s), and an attempt caught by an
  outage starts again as soon as the connection is back (`reconnected`). File storage keeps every
  version across a server restart. Memory storage loses them: the first publish after the restart
  re-creates the stream (the trainer never fails for it), and a fetch of a version published
  before the restart raises `WeightsNotFound` saying so; the explorer keeps the weights it has
  until the next version (never wrong ones). Memory costs K x model size of server RAM (K versions
  kept by `prune`, 2 by default).
- **Layout.** Version N is chunk messages ``rft.<job>.w.N.c.<i>`` (raw stream
  bytes, see `format`) followed by the manifest ``rft.<job>.w.N.m`` (layout, chunk digests, root
  digest, stream sequences of the chunks). The manifest is published only after every chunk is
  acknowledged as stored, and readers look a version up *by its manifest*, so a partial upload is
  never visible. Re-publishing a version first purges its subjects.
- **Junk.** Anyone allowed to publish on ``rft.<job>.w.>`` can store junk there. A manifest that
  does not parse (or is not for its subject's version, or fails its own root digest) is not a
  version: `versions`/`latest` skip it and count it in `junk_manifests`. `prune(keep, announced=...)`
  keeps only the newest `keep` of the versions announced in the event stream and removes everything
  else, so junk with high version numbers never pushes real versions out. (Only server permissions,
  see `rolectl auth init`, stop junk from *replacing* a stored manifest; a fetch then fails its
  digest check and the explorer keeps its weights.)
- **Publish.** Chunks are `nc.max_payload` bytes; many are in flight at once (`window_bytes`), acks
  are gathered as they come, never one round trip per chunk. Each chunk goes out as the tensors' own
  memory (scatter-gather `sendmsg`), hashed just before it is sent. A bucket stream is read one
  bucket at a time as its chunks go out (`format.StreamedChunks`), so the publisher holds about two
  buckets; the manifest, which needs every offset and chunk digest, is last anyway.
- **Fetch.** `$JS.API.DIRECT.GET` batch requests by stream sequence (no consumer to create, so N
  explorers cost the server nothing extra), a few requests in flight so the server never queues more
  than `window_bytes` for us (it drops "slow consumers" past its `max_pending`, 64 MiB by default).
  Each chunk is received straight into the freshly allocated destination buffer, its digest checked
  at once; the manifest's chunk list was checked against the root digest first, so when the last
  chunk passes the whole version is verified. On any failure the buffer is dropped: the caller gets
  `CorruptWeights` / `WeightsNotFound` / `TransferError` and no tensors.
- **Data connection.** nats-py parses every inbound byte in Python, a few KiB at a time, which
  is too slow for bulk bytes. They go over a second NATS connection to the same server
  (`_wire_client`), driven from a worker thread that receives straight into the tensors and hashes
  each piece while it is in cache. It connects as the nats-py client did (user/password, token,
  nkey or JWT; TLS with the client's context); where it cannot be used (websocket) the transport
  falls back to the nats-py connection for everything, same semantics: one windowed driver runs
  either (`data_plane`), following an I/O-free plan of the fetch (`fetch_plan`).
- **Striped fetch.** A fetch can be split over several data connections (`fetch_connections`),
  each fetching a contiguous part of the version's stream sequences in its own thread into the one
  destination. Under TLS one connection is one stream of records that the server encrypts on one
  core and the receiver decrypts on one thread; several connections spread that work over cores
  (OpenSSL and the digests release the GIL). By default a TLS client uses one connection per two
  CPUs, 2 to 4, and a plain one a single connection. A chunk a part did not get (stored out of
  order, or its connection dropped) is fetched after the parts, on one connection, as without
  striping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import StorageType
from nats.js.errors import NotFoundError

from rolectl.sync_protocol import SyncMethod

from ..errors import BusClosed, RetriesExhausted
from ..retry import is_transient, retry_transient
from ..streams import stream_differences, weights_stream_config
from ..subjects import JobNames
from ._wire_client import DataConnection, Transient
from .base import CorruptWeights, TransferError, WeightsNotFound, WeightsRef, WeightsSource, restartable
from .data_plane import DataPlanes
from .delta import ChunkDecoder, DeltaChunks, DeltaInfo, DeltaPublisher, HeldVersion, delta_info, stored_version
from .fetch_plan import ChunkPlan, DeltaPlan, MissingChunks, StreamGone
from .format import (
    DEFAULT_DIGEST_ALGORITHM,
    Destination,
    Manifest,
    StreamedChunks,
    build_manifest,
    streamed_chunks,
)
from .host_memory import SpareBuffer

__all__ = ["ObjectStoreTransport"]

T = TypeVar("T")

_API = "$JS.API"


class ObjectStoreTransport:
    """Publish / fetch weight versions through a per-job JetStream stream (see module docstring).

    `nc` is a connected nats-py client; the transport makes its own JetStream context and never
    closes `nc`. `storage` is "memory" (this class's default, used by tests and benchmarks; faster)
    or "file" (a job config's default: keeps versions across a server restart; see the module
    docstring). The publisher calls `prune` to bound storage; `timeout` bounds every
    wait for bulk bytes, `api_timeout` every control request.
    `reconnected` (e.g. `BusConnection.reconnect_signal`) lets a publish or fetch caught by an
    outage start again as soon as the connection is back, instead of after `api_timeout`.
    `data_connection=False` forces the nats-py path (slower; used where the plain data connection
    cannot be opened, and by tests to cover both paths). `fetch_connections` splits one fetch over
    that many data connections (None: by the client's TLS settings and this host's CPUs, see
    `data_plane.fetch_connections_for`).
    """

    method = SyncMethod.MEMORY

    def __init__(
        self,
        nc: Client,
        job: str,
        *,
        storage: str = "memory",
        replicas: int = 1,
        chunk_size: int | None = None,
        window_bytes: int = 32 * 1024 * 1024,
        request_bytes: int = 8 * 1024 * 1024,
        timeout: float = 30.0,
        data_connection: bool = True,
        algorithm: str | None = None,
        publish_retry_s: float = 300.0,
        fetch_retry_s: float = 60.0,
        api_timeout: float = 5.0,
        reconnected: Callable[[], Awaitable[Any]] | None = None,
        keyframe_interval: int = 1,
        delta_codec: str | None = None,
        fetch_connections: int | None = None,
    ):
        if fetch_connections is not None and (not isinstance(fetch_connections, int) or fetch_connections < 1):
            raise ValueError(f"fetch_connections must be an int >= 1 or None (automatic), got {fetch_connections!r}")
        self._nc = nc
        # Control-plane requests (stream info, purge, manifest lookups) get a short timeout of their
        # own: one in flight when the server dies is never answered, and the retry should come
        # after seconds, not after the bulk-transfer `timeout`.
        self._api_timeout = min(api_timeout, timeout)
        self._js = nc.jetstream(timeout=self._api_timeout)
        self.names = JobNames(job)
        self._storage = StorageType(storage)
        self._replicas = replicas
        self._chunk_size = chunk_size
        self._window_bytes = window_bytes
        self._request_bytes = request_bytes
        self._planes = DataPlanes(nc, api_subject=self._direct_get_subject, timeout=timeout,
                                  window_bytes=window_bytes, wire=data_connection,
                                  fetch_connections=fetch_connections)
        self._algorithm = algorithm or DEFAULT_DIGEST_ALGORITHM
        self._reconnected = reconnected
        self._publish_retry_s = publish_retry_s
        self._fetch_retry_s = fetch_retry_s
        self._stream_ready = False
        self._closed = False
        self.junk_manifests = 0  # manifests seen that are not versions (unparsable, mislabelled)
        # Delta versions (see `delta`): the publisher's encoder and base, the receiver's held version.
        self._deltas = DeltaPublisher(keyframe_interval, delta_codec)
        self._spare = SpareBuffer()
        self._held: HeldVersion | None = None
        self.last_publish: dict[str, Any] = {}  # what the last publish stored (kind, bytes; see WeightsRef.stored)
        self.last_fetch: dict[str, Any] = {}  # how the last fetch got its version (route, bytes, connections)

    # public API -----------------------------------------------------------------------------------

    @property
    def stream(self) -> str:
        return self.names.weights_stream

    @property
    def chunk_size(self) -> int:
        """Bytes per chunk message: the server's max_payload unless a smaller size was asked for."""
        limit = self._nc.max_payload
        return min(self._chunk_size or limit, limit)

    async def publish(self, version: int, tensors: WeightsSource) -> WeightsRef:
        """Store `tensors` (a mapping or a bucket stream, see `base`) as `version`; returns once the
        manifest (published last) is stored. A stream is consumed one bucket at a time while its
        chunks go out. An upload that a server restart interrupts starts again from a fresh stream;
        a one-shot iterator cannot give one, so that publish raises TransferError instead."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0 (the trainer step), got {version!r}")
        where = f"publish of version {version} to stream {self.stream}"
        can_restart = restartable(tensors)
        previous: StreamedChunks | DeltaChunks | None = None

        def open_stream(chunk_size: int) -> StreamedChunks | DeltaChunks:
            nonlocal previous
            if previous is not None and previous.buckets_read and not can_restart:
                raise TransferError(
                    f"{where} was interrupted after its one-shot bucket stream was partly consumed, "
                    "and cannot start again; pass a mapping, a list of buckets, or a callable that "
                    "makes a fresh stream (e.g. lambda: engine.iter_weight_buckets(n))"
                )
            inner = streamed_chunks(tensors, chunk_size=chunk_size, algorithm=self._algorithm, where=where)
            previous = self._deltas.wrap(version, inner)
            return previous

        async def stream_lost(exc: BaseException) -> None:
            # A restarted in-memory server lost the stream: look it up (and re-create it) again.
            self._stream_ready = False

        return await self._retrying(
            lambda: self._publish_once(version, open_stream), what=where,
            retry_for=self._publish_retry_s, before_retry=stream_lost,
        )

    async def _publish_once(
        self, version: int, open_stream: Callable[[int], StreamedChunks | DeltaChunks],
    ) -> WeightsRef:
        self._check_connected()
        await self._ensure_stream()
        # Leftovers of a crashed upload, or an older upload of the same version, must not mix in.
        await self._purge_version(version)
        chunk_size = self.chunk_size
        where = f"publish of version {version} to stream {self.stream}"

        def subject(index: int) -> str:
            return self.names.weights_chunk(version, index)

        chunks, seqs = await self._planes.publish(lambda: open_stream(chunk_size), subject, chunk_size, where)
        extra: dict[str, Any] = {"stream": self.stream}
        if seqs:
            extra.update(first_seq=min(seqs.values()), last_seq=max(seqs.values()))
        if isinstance(chunks, DeltaChunks):
            extra.update(chunks.manifest_extra())
        manifest = build_manifest(
            version, chunks.layout, chunk_size=chunk_size, algorithm=self._algorithm,
            chunk_digests=chunks.chunk_digests, extra=extra,
        )
        payload = manifest.to_bytes()
        if len(payload) > self._nc.max_payload:
            raise TransferError(
                f"{where}: manifest is {len(payload)} bytes, over the server's max_payload "
                f"{self._nc.max_payload} ({len(manifest.chunks)} chunks); raise max_payload in the server config"
            )
        await self._js.publish(self.names.weights_manifest(version), payload, stream=self.stream)
        self._deltas.commit(chunks, manifest)
        stored = stored_version(chunks, manifest.nbytes)
        self.last_publish = {"version": version, "nbytes": manifest.nbytes, **dataclasses.asdict(stored)}
        return WeightsRef(
            version=version,
            location=f"nats-js://{self.stream}/{self.names.weights_manifest(version)}",
            nbytes=manifest.nbytes,
            digest=manifest.digest,
            stored=stored,
        )

    async def fetch(self, ref: WeightsRef, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fetch `ref` into fresh tensors, every chunk digest-checked; nothing is returned on failure.

        On CPU the tensors are views into one fresh buffer (no copy after the socket); `clone()` a
        tensor you keep on its own, or the whole buffer stays alive with it.
        """
        self._check_open()
        return await self._retrying(
            lambda: self._fetch_once(ref, device), what=f"fetch of version {ref.version} from stream {self.stream}",
            retry_for=self._fetch_retry_s,
        )

    async def _fetch_once(self, ref: WeightsRef, device: str | torch.device) -> dict[str, torch.Tensor]:
        self._check_connected()
        manifest = await self._manifest(ref.version)
        if manifest is None:
            raise WeightsNotFound(
                f"version {ref.version} is not in stream {self.stream} (never published, pruned, "
                "or its upload did not finish); fetch the latest announced version"
            )
        if manifest.digest != ref.digest:
            raise WeightsNotFound(
                f"version {ref.version} in stream {self.stream} has digest {manifest.digest}, but the "
                f"announced ref says {ref.digest}: it was republished; fetch the latest announced ref"
            )
        device = torch.device(device)
        self._planes.connections_opened = 0
        info = delta_info(manifest, where=f"stream {self.stream}")
        if info is None:
            pin = device.type == "cuda"
            dest = Destination(manifest.layout, pin_memory=pin, reuse=self._spare.take(manifest.nbytes, pin_memory=pin))
            await self._fetch_chunks(manifest, dest, None)
            route, moved, versions = "full", manifest.nbytes, [manifest.version]
        elif self._held is not None and self._held.is_base_of(info):
            dest = Destination(manifest.layout, pin_memory=device.type == "cuda")
            held, self._held = self._held, None  # a failure below leaves nothing held
            await self._fetch_chunks(manifest, dest, (info, held.view))
            route, moved, versions = "delta", info.stored_bytes, [manifest.version]
        else:
            dest, moved, versions = await self._fetch_chain(manifest, info, device)
            route = "keyframe"
        self.last_fetch = {
            "version": manifest.version, "route": route, "versions": versions, "bytes_moved": moved,
            "nbytes": manifest.nbytes, "data_connections": self._planes.connections_opened,
            "refused": None if route != "keyframe" else (
                f"holds version {self._held.version}, the delta is on version {info.base}"  # type: ignore[union-attr]
                if self._held is not None else "holds no version"),
        }
        self._held = HeldVersion(manifest.version, manifest.digest, dest.flat) if self._deltas.enabled else None
        return self._spare.hand_out(dest, device, reusable=not self._deltas.enabled)  # a held version is no spare

    def recycle(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """The caller is done with the tensors of the last CPU fetch (it copied them into its model):
        the next fetch of that size writes into their memory. Tensors of any other memory are left
        alone (False)."""
        return self._spare.give_back(tensors)

    async def _fetch_chain(
        self, manifest: Manifest, info: DeltaInfo, device: torch.device,
    ) -> tuple[Destination, int, list[int]]:
        """Fetch the keyframe `manifest` descends from, then apply each delta after it in place (each
        result chunk checked); WeightsNotFound if a link of the chain is gone."""
        chain: list[tuple[Manifest, DeltaInfo | None]] = [(manifest, info)]
        link: DeltaInfo | None = info
        while link is not None:
            base = await self._manifest(link.base)
            newest = chain[-1][0].version
            if base is None or base.digest != link.base_digest:
                raise WeightsNotFound(
                    f"version {manifest.version} is stored as a delta, and version {link.base} it "
                    f"builds on (from version {newest}) is not in stream {self.stream} (pruned, or "
                    "republished); fetch the latest announced version")
            link = delta_info(base, where=f"stream {self.stream}")
            chain.append((base, link))
            if len(chain) > 10_000:
                raise CorruptWeights(f"stream {self.stream}: version {manifest.version}'s delta chain does not end")
        chain.reverse()
        keyframe = chain[0][0]
        dest = Destination(keyframe.layout, pin_memory=device.type == "cuda")
        await self._fetch_chunks(keyframe, dest, None)
        moved = keyframe.nbytes
        for step, step_info in chain[1:]:
            assert step_info is not None
            if step.nbytes == dest.layout.nbytes:  # in place: the buffer is ours until handed out
                dest.layout = step.layout
                await self._fetch_chunks(step, dest, (step_info, dest.view))
            else:
                previous, dest = dest, Destination(step.layout, pin_memory=device.type == "cuda")
                await self._fetch_chunks(step, dest, (step_info, previous.view))
            moved += step_info.stored_bytes
        return dest, moved, [m.version for m, _ in chain]

    async def _fetch_chunks(self, manifest: Manifest, dest: Destination,
                            delta: tuple[DeltaInfo, memoryview] | None) -> None:
        """Land every chunk of `manifest` in `dest` (decoded onto a base when `delta` is given)."""
        where = f"stream {self.stream}"
        subjects = self.names.weights_chunks(manifest.version)
        plan: ChunkPlan
        if delta is None:
            plan = ChunkPlan(manifest, dest, subjects, self._request_bytes, self._window_bytes, where)
        else:
            decoder = ChunkDecoder(manifest, delta[0], dest.view, delta[1], where)
            plan = DeltaPlan(manifest, dest, subjects, self._request_bytes, self._window_bytes, where, decoder)
        try:
            try:
                if not plan.done:
                    await self._planes.fetch(plan)
            except BaseException:
                if isinstance(plan, DeltaPlan):
                    await asyncio.to_thread(plan.decoding.abandon)
                raise
            if isinstance(plan, DeltaPlan):
                await asyncio.to_thread(plan.decoding.finish)  # CorruptWeights of the first bad chunk
        except MissingChunks as exc:
            if await self._manifest(manifest.version) is None:
                raise WeightsNotFound(
                    f"version {manifest.version} was pruned from stream {self.stream} while it was being "
                    "fetched; fetch the latest announced version"
                ) from None
            raise CorruptWeights(
                f"{where}: version {manifest.version} chunks {exc.missing[:10]} are missing from the stream "
                f"although its manifest is there; republish version {manifest.version}"
            ) from None

    async def latest(self) -> WeightsRef | None:
        """The newest complete version (one whose manifest is stored), or None."""
        self._check_open()
        for version in reversed(await self.versions()):
            manifest = await self._parsed_manifest(version)
            if manifest is not None:
                return WeightsRef(
                    version=version,
                    location=f"nats-js://{self.stream}/{self.names.weights_manifest(version)}",
                    nbytes=manifest.nbytes,
                    digest=manifest.digest,
                )
        return None

    async def versions(self) -> list[int]:
        """Complete versions stored, oldest first: those whose manifest parses and checks out
        (partial uploads have no manifest, junk has no valid one: neither is listed)."""
        out = []
        for version in sorted(await self._versions_of(self.names.all_weights_manifests)):
            if await self._parsed_manifest(version) is not None:
                out.append(version)
        return out

    async def prune(self, keep: int = 2, *, announced: Iterable[int] | None = None) -> list[int]:
        """Delete all but the newest `keep` versions; return the deleted ones, oldest first.

        With `announced` (the versions the event stream announced; what the trainer passes), the
        newest `keep` of them are kept and every other version in the stream is deleted: older
        ones, crashed uploads and junk, whatever its version number. Call it only from the one
        publisher, after announcing (an upload in progress would be deleted too). Without it, the
        newest `keep` complete versions are kept (and older partial uploads deleted).
        """
        self._check_open()
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        announced = None if announced is None else list(announced)  # read once, retried maybe twice
        return await self._retrying(lambda: self._prune_once(keep, announced),
                                    what=f"prune of stream {self.stream}", retry_for=self._fetch_retry_s)

    async def _prune_once(self, keep: int, announced: Iterable[int] | None) -> list[int]:
        if announced is not None:
            kept = set(sorted(set(announced))[-keep:]) if keep else set()
            kept |= await self._chains_of(kept)
            stored = set(await self._versions_of(self.names.all_weights_manifests))
            stored |= set(await self._versions_of(self.names.all_weights_first_chunks))
            doomed = sorted(stored - kept)
            for version in doomed:
                await self._purge_version(version)
            return doomed
        complete = await self.versions()
        doomed = complete[: max(len(complete) - keep, 0)]
        needed = await self._chains_of(set(complete[len(doomed):]))
        doomed = [v for v in doomed if v not in needed]
        # A partial upload older than the newest complete version is a crashed publish: clean it.
        # Newer ones may be uploads in progress and are left alone.
        newest = complete[-1] if complete else -1
        partial = set(await self._versions_of(self.names.all_weights_first_chunks)) - set(complete)
        for version in sorted(set(doomed) | {v for v in partial if v < newest}):
            await self._purge_version(version)
        return doomed

    async def _chains_of(self, versions: set[int]) -> set[int]:
        """The versions the deltas among `versions` build on, down to their keyframes (pruning must
        keep them, or the kept versions could not be rebuilt)."""
        needed: set[int] = set()
        for version in versions:
            manifest = await self._parsed_manifest(version)
            while manifest is not None:
                try:
                    info = delta_info(manifest, where=f"stream {self.stream}")
                except CorruptWeights:
                    break
                if info is None or info.base in needed or info.base in versions:
                    break
                needed.add(info.base)
                manifest = await self._parsed_manifest(info.base)
        return needed

    async def aclose(self) -> None:
        """Stop accepting calls. The nats-py client belongs to the caller and stays open."""
        self._closed = True

    async def __aenter__(self) -> ObjectStoreTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # control plane (nats-py) ----------------------------------------------------------------------

    @property
    def _direct_get_subject(self) -> str:
        return f"{_API}.DIRECT.GET.{self.stream}"

    async def _retrying(
        self, call: Callable[[], Awaitable[T]], *, what: str, retry_for: float,
        before_retry: Callable[[BaseException], Awaitable[Any]] | None = None,
    ) -> T:
        """`call()` through `bus.retry.retry_transient`: a server restart or a leader election costs
        a stall, not the caller; a TransferError names the last failure if it lasts `retry_for` s."""
        try:
            return await retry_transient(
                call, what=what, retry_for=retry_for, is_closed=lambda: self._nc.is_closed,
                transient=lambda exc: isinstance(exc, Transient) or is_transient(exc),
                before_retry=before_retry, interrupt=self._reconnected,
            )
        except RetriesExhausted as exc:
            raise TransferError(str(exc)) from exc.last
        except BusClosed as exc:
            raise TransferError(f"{what}: the NATS connection is closed") from exc

    def _check_connected(self) -> None:
        if not self._nc.is_connected:
            raise Transient("the NATS connection is reconnecting")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("object store transport is closed; make a new ObjectStoreTransport")

    async def ensure_stream(self) -> None:
        """Create the weights stream, or check the existing one (what `rolectl provision` does)."""
        await self._ensure_stream()

    async def _ensure_stream(self) -> None:
        if self._stream_ready:
            return
        try:
            info = await self._js.stream_info(self.stream)
        except NotFoundError:
            config = weights_stream_config(self.names, storage=self._storage, replicas=self._replicas,
                                           max_msg_size=self._nc.max_payload)
            self._deltas.forget()  # a new stream holds no base: the next version is a keyframe
            try:
                await self._js.add_stream(config)
            except Exception as exc:  # noqa: BLE001 - re-raised as our typed error with the reason
                if is_transient(exc):
                    raise  # e.g. not enough cluster nodes up yet for the replicas: retried
                raise TransferError(
                    f"could not create weights stream {self.stream}: {exc or type(exc).__name__}; is "
                    "JetStream enabled on the server (nats-server -js)? With per-identity permissions "
                    "only admin creates streams: run `rolectl provision` with the admin identity first"
                ) from exc
        else:
            want = weights_stream_config(self.names, storage=self._storage, replicas=self._replicas,
                                         max_msg_size=self._nc.max_payload)
            differences = stream_differences(want, info.config)
            if differences:  # the same rule as the job's other streams
                detail = "; ".join(f"{name}: expected {a!r}, found {b!r}" for name, a, b in differences)
                raise TransferError(f"stream {self.stream} exists with a different configuration ({detail}); "
                                    "delete it (it holds only weights, republished on the next step)")
        self._stream_ready = True

    async def _purge_version(self, version: int) -> None:
        with contextlib.suppress(NotFoundError):
            await self._js.purge_stream(self.stream, subject=self.names.weights_version(version))

    async def _versions_of(self, subjects_filter: str) -> list[int]:
        try:
            info = await self._js.stream_info(self.stream, subjects_filter=subjects_filter)
        except NotFoundError:
            return []
        out = []
        for subject in (info.state.subjects or {}):
            token = subject[len(self.names.prefix) + 3 :].split(".", 1)[0]  # after "<prefix>.w."
            if token.isdigit():
                out.append(int(token))
        return out

    async def _parsed_manifest(self, version: int) -> Manifest | None:
        """`_manifest(version)`, with junk (unparsable or mislabelled) counted and taken as absent."""
        try:
            return await self._manifest(version)
        except CorruptWeights:
            self.junk_manifests += 1
            return None

    async def _manifest(self, version: int) -> Manifest | None:
        """The stored manifest of `version` (verified against its own root digest), or None."""
        subject = self.names.weights_manifest(version)
        try:
            msg = await self._nc.request(f"{self._direct_get_subject}.{subject}", b"", timeout=self._api_timeout)
        except NoRespondersError:
            # No stream answers: none was ever made (nothing published yet), a restarted in-memory
            # server lost it, or a restarting server is still recovering it (then: retry).
            try:
                await self._js.stream_info(self.stream)
            except NotFoundError:
                return None
            raise StreamGone(f"stream {self.stream} exists but no server answers direct gets yet") from None
        except NatsTimeoutError:
            raise Transient(
                f"no answer from {self._direct_get_subject} within {self._api_timeout} s looking up "
                f"version {version}; is the server overloaded or restarting?"
            ) from None
        status = (msg.headers or {}).get("Status")
        if status == "404":
            return None
        if status:
            raise TransferError(f"direct get of {subject} failed: status {status} {msg.headers}")
        manifest = Manifest.from_bytes(msg.data, where=f"stream {self.stream} manifest {subject}")
        if manifest.version != version:
            raise CorruptWeights(
                f"stream {self.stream}: manifest under {subject} is for version {manifest.version}"
            )
        return manifest

    # data plane -----------------------------------------------------------------------------------

    async def _in_thread(self, work: Callable[[DataConnection], T]) -> T:
        """Run `work` on a fresh wire connection in a worker thread (see `DataPlanes.on_wire`)."""
        return await self._planes.on_wire(work)
