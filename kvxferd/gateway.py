"""The engine gateway: a local engine drives this daemon's Sender or Receiver through one ROUTER socket.

The daemon creates one :class:`Gateway` around its service and runs it on its
asyncio loop::

    gw = Gateway(sender, settings.service.engine_socket,
                 max_inflight=settings.service.max_client_inflight)
    await gw.start()            # bind; serve until stop
    gw.refuse_new("draining")   # the drain began: publish/fetch refused, the rest still served
    await gw.stop(timeout=2.0)  # cancel outstanding calls (each gets an Error), close the socket

Where things run::

    what                         runs on                   owns
    ---------------------------  ------------------------  -------------------------------------
    serve task, call tasks       the loop start() ran on   the ROUTER (zmq.asyncio), _handles,
                                                           _calls, _refusing; no lock: only this
                                                           loop touches them
    publish / fetch / cancel     kvxferd-gw-quick threads  nothing; they call the service
    close(timeout)               kvxferd-gw-close threads  nothing; they may block up to timeout
    Wait                         the loop (wait_async)     the awaiting future, on this loop

A call that may block never runs on the loop. Calls served at once are bounded
by ``max_inflight``: one more gets ``Error(busy)`` at once, it is never queued.
Describe and Poll answer inline and are not counted. A malformed frame gets
``Error(malformed)`` (or the ProtocolError's reason), is counted in ``stats``,
and never stops the serve task.

A handle id comes from a counter that is never reused; a handle belongs to the
connection (routing id) that created it, and any other connection gets
``Error(unknown_handle)``. Close forgets a handle only when it reports the
memory safe; otherwise the handle stays so the engine can Poll or Close again.

Known limit: ZMQ does not say when an engine disconnects, so handles of an
engine that died stay in the table (bounded by ``max_handles``) until the
service ends their sessions (publish_ttl / kv_transfer_timeout) and the daemon
stops.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import msgspec
import zmq
import zmq.asyncio

from kvxferd import engine_protocol as ep
from kvxferd.control import process_context
from kvxferd.errors import ProtocolError, RejectedError
from kvxferd.guard import Guard
from kvxferd.pool import KvPool
from kvxferd.receiver import Receiver, RxHandle
from kvxferd.sender import Sender, TxHandle
from kvxferd.session import Fence, RxOutcome, TxOutcome
from kvxferd.stats import Stats

log = logging.getLogger("kvxferd.gateway")

T = TypeVar("T")

MAX_HANDLES = 65_536  # live handles across all engines; one more publish/fetch gets BUSY
QUICK_THREADS = 8  # publish / fetch / cancel: short calls, never wait on a peer
CLOSE_THREADS = 32  # close(timeout): may block up to the engine's timeout


@dataclass(slots=True)
class _Entry:
    owner: bytes  # routing id of the engine connection that created the handle
    handle: TxHandle | RxHandle


class _UnknownHandle(Exception):
    pass


class Gateway:
    """Serves the engine protocol for one Sender or Receiver, on the loop ``start`` ran on."""

    def __init__(
        self,
        service: Sender | Receiver,
        endpoint: str,
        *,
        max_inflight: int = 1024,
        socket_mode: int = 0o600,
        max_handles: int = MAX_HANDLES,
        max_frame_bytes: int = ep.MAX_FRAME_BYTES,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self.service = service
        self.role: Literal["sender", "receiver"] = (
            "sender" if isinstance(service, Sender) else "receiver"
        )
        self.requested_endpoint = endpoint
        self.endpoint: str | None = None  # the bound address, once started
        self.max_inflight = max_inflight
        self.socket_mode = socket_mode
        self.max_handles = max_handles
        self.max_frame_bytes = max_frame_bytes
        self.stats = Stats()
        self.guard = Guard(self.stats, log)  # unexpected errors of its threads
        self.last_progress = time.monotonic()  # the serve task took a message or ticked
        self._handle_ids = itertools.count(1)
        self._handles: dict[int, _Entry] = {}
        self._calls: dict[asyncio.Task[None], int] = {}  # call task -> call id
        self._refusing: ep.EngineReason | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._ipc_path: str | None = None
        self._quick: ThreadPoolExecutor | None = None
        self._slow: ThreadPoolExecutor | None = None
        self._pool_info: ep.PoolInfo | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        """Bind the ROUTER and start serving on the running loop; the bound endpoint."""
        if self._sock is not None:
            raise RuntimeError("gateway already started")
        self._loop = asyncio.get_running_loop()
        self._pool_info = _pool_info(self.service)
        ctx = zmq.asyncio.Context.shadow(process_context().underlying)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone engine fails, is counted
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        endpoint = self.requested_endpoint
        try:
            if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
                self._ipc_path = endpoint[len("ipc://") :]
                parent = os.path.dirname(os.path.abspath(self._ipc_path))
                os.makedirs(parent, mode=_dir_mode(self.socket_mode), exist_ok=True)
            elif endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                endpoint = endpoint[:-2] + ":*"
            sock.bind(endpoint)
            if self._ipc_path is not None:
                # libzmq creates the file with the umask's mode; narrow it before serving.
                os.chmod(self._ipc_path, self.socket_mode)
        except BaseException:
            sock.close(linger=0)
            raise
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = bound.decode() if isinstance(bound, bytes) else str(bound)
        self._sock = sock
        self._quick = ThreadPoolExecutor(
            max_workers=min(self.max_inflight, QUICK_THREADS), thread_name_prefix="kvxferd-gw-quick"
        )
        self._slow = ThreadPoolExecutor(
            max_workers=min(self.max_inflight, CLOSE_THREADS), thread_name_prefix="kvxferd-gw-close"
        )
        self._serve_task = self._loop.create_task(self._serve(), name="kvxferd-gateway")
        log.info("engine gateway (%s) serving at %s", self.role, self.endpoint)
        return self.endpoint

    def refuse_new(self, reason: str | ep.EngineReason = ep.EngineReason.DRAINING) -> None:
        """From now on Publish/Fetch get ``Error(reason)``; Wait/Poll/Cancel/Close still work.

        ``reason`` is ``"draining"`` or ``"shutting_down"``. Safe to call from any thread.
        """
        r = ep.EngineReason(reason)
        if r not in (ep.EngineReason.DRAINING, ep.EngineReason.SHUTTING_DOWN):
            raise ValueError(f"refuse_new reason must be draining or shutting_down, not {r}")
        self._refusing = r

    def broken(self) -> str | None:
        """Why the gateway is not live (a caught unexpected error, its serve task ended), or None."""
        why = self.guard.broken()
        task = self._serve_task
        if why is None and task is not None and task.done() and self._sock is not None:
            return "gateway serve task ended"
        return why

    @property
    def refusing(self) -> ep.EngineReason | None:
        return self._refusing

    @property
    def calls_in_flight(self) -> int:
        return len(self._calls)

    @property
    def handle_count(self) -> int:
        return len(self._handles)

    async def stop(self, timeout: float) -> None:
        """Stop serving: outstanding calls are cancelled (each engine gets Error(shutting_down)),
        then the socket is closed; returns within ``timeout`` (plus a loop turn).

        Must be awaited on the loop the gateway was started on.
        """
        sock = self._sock
        if sock is None:
            return
        if self._refusing is None:
            self._refusing = ep.EngineReason.SHUTTING_DOWN
        tasks: list[asyncio.Task[Any]] = list(self._calls)
        if self._serve_task is not None:
            tasks.append(self._serve_task)
        for t in tasks:
            t.cancel()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, timeout))
            if late:
                log.warning("gateway stop: %d tasks still running after %.1fs", len(late), timeout)
        self._sock = None
        sock.close(linger=0)
        for ex in (self._quick, self._slow):
            if ex is not None:  # running calls end on their own bounds; queued ones are dropped
                ex.shutdown(wait=False, cancel_futures=True)
        self._handles.clear()
        log.info("engine gateway stopped (%s)", self.endpoint)

    # -- serving ------------------------------------------------------------------------
    async def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), 1.0)
            except TimeoutError:
                self.last_progress = time.monotonic()
                continue
            except zmq.ZMQError as e:
                if sock.closed:
                    return
                self.stats.add("recv_errors")
                log.warning("gateway: receive failed: %s", e)
                await asyncio.sleep(0.01)  # never spin on a persistent error
                continue
            self.last_progress = time.monotonic()
            try:
                self._on_frames(frames)
            except Exception:  # a bug on one message must not stop the gateway
                log.exception("gateway: message failed")
                self.stats.add("internal_errors")

    def _on_frames(self, frames: list[bytes]) -> None:
        rid, body = frames[0], frames[1:]
        try:
            msg = ep.decode_to_gateway(body, self.max_frame_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            call_id = ep.salvage_call_id(body)
            self._reply(
                rid,
                ep.Error(
                    call_id=call_id, reason=ep.EngineReason(e.reason.value), detail=e.detail[:1024]
                ),
            )
            return
        tag = msg.__struct_config__.tag
        self.stats.add(f"calls_{tag}")
        if isinstance(msg, ep.Describe):
            assert self._pool_info is not None
            self._reply(rid, msgspec.structs.replace(self._pool_info, call_id=msg.call_id))
            return
        if isinstance(msg, ep.Poll):
            self._reply(rid, self._poll(rid, msg))
            return
        if len(self._calls) >= self.max_inflight:
            self.stats.add("rejected_busy")
            self._reply(
                rid,
                ep.Error(
                    call_id=msg.call_id,
                    reason=ep.EngineReason.BUSY,
                    detail=f"{self.max_inflight} calls in flight (max_inflight)",
                ),
            )
            return
        assert self._loop is not None
        task = self._loop.create_task(self._call(rid, msg))
        self._calls[task] = msg.call_id
        task.add_done_callback(self._call_done)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.stats.add("internal_errors")

    def _reply(self, rid: bytes, msg: ep._Msg) -> None:
        sock = self._sock
        if sock is None:
            self.stats.add("reply_dropped")
            return
        # NOBLOCK: the send happens now and its future is already done; the loop never waits.
        fut = cast(
            "asyncio.Future[object]", sock.send_multipart([rid, ep.encode(msg)], flags=zmq.NOBLOCK)
        )
        if fut.exception() is not None:  # the engine is gone or not reading
            self.stats.add("reply_dropped")

    async def _call(self, rid: bytes, msg: ep.ToGateway) -> None:
        reply: ep._Msg
        try:
            reply = await self._dispatch(rid, msg)
        except asyncio.CancelledError:
            self._reply(
                rid,
                ep.Error(
                    call_id=msg.call_id,
                    reason=ep.EngineReason.SHUTTING_DOWN,
                    detail="the gateway is stopping",
                ),
            )
            raise
        except _UnknownHandle:
            self.stats.add("rejected_unknown_handle")
            reply = ep.Error(
                call_id=msg.call_id,
                reason=ep.EngineReason.UNKNOWN_HANDLE,
                detail="no such handle on this connection",
            )
        except RejectedError as e:
            self.stats.add(f"rejected_{e.reason}")
            reply = ep.Error(
                call_id=msg.call_id, reason=ep.EngineReason(e.reason.value), detail=e.detail[:1024]
            )
        except Exception as e:
            log.exception("gateway: %s call failed", msg.__struct_config__.tag)
            self.stats.add("internal_errors")
            reply = ep.Error(
                call_id=msg.call_id, reason=ep.EngineReason.INTERNAL, detail=repr(e)[:1024]
            )
        self._reply(rid, reply)

    async def _dispatch(self, rid: bytes, msg: ep.ToGateway) -> ep._Msg:
        if isinstance(msg, ep.Publish | ep.Fetch):
            refusal = self._refusal(msg)
            if refusal is not None:
                return refusal
            if isinstance(msg, ep.Publish):
                sender = self.service
                assert isinstance(sender, Sender)
                fn: Callable[[], TxHandle | RxHandle] = functools.partial(
                    sender.publish,
                    msg.request_id,
                    msg.block_ids,
                    aux=msg.aux,
                    expected_fetches=msg.expected_fetches,
                )
            else:
                receiver = self.service
                assert isinstance(receiver, Receiver)
                layers = None
                if msg.layer_begin or msg.layer_end:
                    end = msg.layer_end or receiver.pool.layout.num_layers
                    layers = (msg.layer_begin, end)
                fn = functools.partial(
                    receiver.fetch,
                    msg.request_id,
                    msg.sender_endpoint,
                    msg.block_ids,
                    layers=layers,
                    want_aux=msg.want_aux,
                    timeout_ms=msg.timeout_ms or None,
                )
            handle = await self._blocking(self._quick, fn, on_orphan=_cancel_handle)
            hid = next(self._handle_ids)
            self._handles[hid] = _Entry(rid, handle)
            return ep.Handle(call_id=msg.call_id, handle_id=hid)
        if isinstance(msg, ep.Wait):
            entry = self._entry(rid, msg.handle_id)
            value = await entry.handle.wait_async(msg.timeout_ms / 1000)
            if value is None:
                return ep.Pending(call_id=msg.call_id)
            return _outcome(msg.call_id, entry.handle, value)
        if isinstance(msg, ep.Cancel):
            entry = self._entry(rid, msg.handle_id)
            await self._blocking(self._quick, entry.handle.cancel)
            return ep.Ok(call_id=msg.call_id)
        if isinstance(msg, ep.Close):
            entry = self._entry(rid, msg.handle_id)
            safe = await self._blocking(
                self._slow, functools.partial(entry.handle.close, msg.timeout_ms / 1000)
            )
            if safe and self._handles.get(msg.handle_id) is entry:
                del self._handles[msg.handle_id]
            return ep.Closed(call_id=msg.call_id, safe=bool(safe))
        raise AssertionError(f"unexpected message {type(msg).__name__}")  # Describe/Poll inline

    def _refusal(self, msg: ep.Publish | ep.Fetch) -> ep.Error | None:
        want = "sender" if isinstance(msg, ep.Publish) else "receiver"
        if want != self.role:
            reason, detail = ep.EngineReason.WRONG_ROLE, f"this daemon is a {self.role}"
        elif self._refusing is not None:
            reason, detail = (
                self._refusing,
                f"the daemon is {self._refusing.value.replace('_', ' ')}",
            )
        elif len(self._handles) >= self.max_handles:
            reason, detail = ep.EngineReason.BUSY, f"{self.max_handles} handles open (max_handles)"
        else:
            return None
        self.stats.add(f"rejected_{reason}")
        return ep.Error(call_id=msg.call_id, reason=reason, detail=detail)

    def _entry(self, rid: bytes, handle_id: int) -> _Entry:
        entry = self._handles.get(handle_id)
        if entry is None or entry.owner != rid:
            raise _UnknownHandle
        return entry

    def _poll(self, rid: bytes, msg: ep.Poll) -> ep._Msg:
        entry = self._handles.get(msg.handle_id)
        if entry is None or entry.owner != rid:
            self.stats.add("rejected_unknown_handle")
            return ep.Error(
                call_id=msg.call_id,
                reason=ep.EngineReason.UNKNOWN_HANDLE,
                detail="no such handle on this connection",
            )
        completion = entry.handle.session.completion
        value = completion.value() if completion.done() else None
        if value is None:
            return ep.Pending(call_id=msg.call_id)
        return _outcome(msg.call_id, entry.handle, value)

    async def _blocking(
        self,
        executor: ThreadPoolExecutor | None,
        fn: Callable[[], T],
        *,
        on_orphan: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``fn`` on a gateway thread; if this call is cancelled, ``on_orphan`` gets its result."""
        assert self._loop is not None and executor is not None
        fut = self._loop.run_in_executor(executor, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if on_orphan is not None:
                fut.add_done_callback(functools.partial(_orphaned, on_orphan))
            raise


def _orphaned(on_orphan: Callable[[T], None], fut: asyncio.Future[T]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    try:
        on_orphan(fut.result())
    except Exception:
        log.exception("gateway: cleaning up an orphaned call failed")


def _cancel_handle(handle: TxHandle | RxHandle) -> None:
    """A publish/fetch whose caller was cancelled (gateway stopping): end it, nobody holds it."""
    handle.cancel()


def _outcome(call_id: int, handle: TxHandle | RxHandle, value: TxOutcome | RxOutcome) -> ep.Outcome:
    if isinstance(handle, TxHandle):
        assert isinstance(value, TxOutcome)
        tx = handle.session
        return ep.Outcome(
            call_id=call_id,
            state=value.state.value,  # type: ignore[arg-type]
            reason=ep.engine_reason(value.reason),
            detail=value.detail[:1024],
            nbytes=sum(sl.nbytes for sl in tx.slices()),
            in_doubt=value.in_doubt,
            reusable=tx.drained,
        )
    assert isinstance(value, RxOutcome)
    rx = handle.session
    return ep.Outcome(
        call_id=call_id,
        state=value.state.value,  # type: ignore[arg-type]
        reason=ep.engine_reason(value.reason),
        detail=value.detail[:1024],
        nbytes=value.nbytes,
        aux=value.aux,
        in_doubt=rx.fence is Fence.IN_DOUBT,
        reusable=rx.blocks_reusable,
    )


def _dir_mode(socket_mode: int) -> int:
    """Mode of a socket directory we create: the owner always; group/other only if the socket lets them."""
    mode = 0o700
    if socket_mode & 0o060:
        mode |= 0o050
    if socket_mode & 0o006:
        mode |= 0o005
    return mode


def _pool_info(service: Sender | Receiver) -> ep.PoolInfo:
    pool: KvPool = service.pool
    s = pool.settings
    kv_bytes = s.kv_bytes
    aux_bytes = s.aux_slots * s.aux_slot_bytes
    on_cpu = s.device == "cpu"
    layout = ep.PoolLayout(
        num_layers=s.num_layers,
        num_blocks=s.num_blocks,
        block_bytes=s.block_bytes,
        dtype=s.dtype,
        aux_slots=s.aux_slots,
        aux_slot_bytes=s.aux_slot_bytes,
        kv_offset=0,
        aux_offset=kv_bytes if on_cpu else 0,
    )
    if isinstance(service, Sender):
        role: Literal["sender", "receiver"] = "sender"
        endpoint, daemon_id = service.endpoint, service.sender_id
    else:
        role, endpoint, daemon_id = "receiver", service.result_endpoint, service.receiver_id
    return ep.PoolInfo(
        call_id=0,
        role=role,
        shm_name=pool.shm_name,
        shm_bytes=aux_bytes + (kv_bytes if on_cpu else 0),
        layout=layout,
        device="cpu" if on_cpu else "cuda",
        cuda_device=0 if on_cpu else s.cuda_device,
        cuda_ipc_handle=None if on_cpu else cuda_ipc_handle(pool),
        endpoint=endpoint,
        daemon_id=daemon_id,
    )


def cuda_ipc_handle(pool: KvPool) -> bytes:  # pragma: no cover - needs a GPU
    """The KV tensor's CUDA IPC handle, msgpack-encoded (see docs/engine-api.md, "GPU pools").

    ``UntypedStorage._share_cuda_()`` gives the fields ``torch.multiprocessing``
    would hand over; we send them as a typed msgspec struct. The daemon keeps
    the pool (and so the allocation) alive for its whole life.
    """
    kv = pool.kv
    storage = kv.untyped_storage()
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return ep.encode_cuda_ipc(
        ep.CudaIpcHandle(
            device=int(device),
            handle=bytes(handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync_required),
            tensor_offset=int(kv.storage_offset()),
            shape=[int(d) for d in kv.shape],
            stride=[int(d) for d in kv.stride()],
        )
    )
