"""One engine call, from its frame to its reply: decoded, checked, run against the service.

The gateway (gateway.py) hands every frame an engine sent to :meth:`Calls.serve` on its
io thread; the reply goes back through the gateway's ``reply`` now, or later from
waits.py for a call that waits. What a call does::

    call      runs                                          replies
    --------  --------------------------------------------  -------------------------------
    Describe  the engine's topology record, if any          PoolInfo
    Publish   the role's adapter (roles.py) starts it under  Handle; with ``wait_ms``, waited
    / Fetch   a new handle, or the key's open handle         on as a Wait of that handle
              (handles.py)                                   (closing it when ``close``)
    Lookup    the key's open handle, shared                  Handle
    Poll      -                                              Pending or Outcome
    Wait      waits.py, unless ``timeout_ms`` is 0           Pending or Outcome (later)
    Cancel    the handle's cancel                            Ok
    Close     waits.py: cancel if open, then close           Closed (once its writes ended)
    Progress  the streamed publish's mark (roles.py)         nothing, ever (a bad mark is
                                                             counted; it fails the publish)
    Links     the role's links (roles.py)                   LinksReply

Calls in flight are bounded by ``max_inflight``: while that many wait, one more
(inline or not) gets ``Error(busy)`` at once, it is never queued. Describe, Poll and
Links are not counted. A malformed frame gets ``Error(malformed)`` (or the ProtocolError's
reason) and is counted in ``stats``; an unexpected exception in a call goes through
``guard`` (logged, counted, the gateway's ``broken()`` names it) and the engine gets
``Error(internal)``; the io thread goes on.

Deadlines. A call's ``deadline_unix_ms`` is when its engine stops waiting. A call whose
deadline has passed is not executed: it is checked when the frame is decoded (a daemon
that was frozen reads its calls late) and right before the service is called, and gets
``Error(timeout)`` (``rejected_timeout``). A Close waits at most until its deadline.

After ``refusing`` is set (the drain), a Publish/Fetch of a free key gets
``Error(refusing)``; everything else is still served.

Owner: the gateway's io thread, the only thread that calls in (no lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.handles import Entry, HandleTable
from kvxferd.engine.roles import Role
from kvxferd.engine.waits import Call, Expired, Waits, before, expired, now_ms
from kvxferd.errors import ProtocolError, RejectedError
from kvxferd.stats import Stats
from kvxferd.transfer.guard import Guard
from kvxferd.transfer.receiver import Receiver
from kvxferd.transfer.sender import Sender


class _UnknownHandle(Exception):
    pass


class Calls:
    """Serves each engine call of one gateway: a reply now, or a wait that answers later."""

    def __init__(
        self,
        service: Sender | Receiver,
        adapter: Role,
        handles: HandleTable,
        waits: Waits,
        stats: Stats,
        guard: Guard,
        reply: Callable[[bytes, ep._Msg], None],
        *,
        max_inflight: int,
        max_frame_bytes: int,
    ) -> None:
        self.service = service
        self.adapter = adapter
        self.handles = handles
        self.waits = waits
        self.stats = stats
        self.guard = guard
        self._reply = reply
        self.max_inflight = max_inflight
        self.max_frame_bytes = max_frame_bytes
        self.refusing: ep.EngineReason | None = None  # set by the drain (``refuse_new``)
        self.pool_info: ep.PoolInfo | None = None  # what Describe answers, set at start

    def serve(self, rid: bytes, body: bytes) -> None:
        """Serve one frame of connection ``rid``; a bug is answered Error(internal)."""
        try:
            self._serve(rid, body)
        except Exception:
            self.guard.caught("gateway")
            self.stats.add("internal_errors")
            self._reply(
                rid,
                ep.Error(
                    call_id=ep.salvage_call_id([body]),
                    reason=ep.EngineReason.INTERNAL,
                    detail="the daemon failed on this message (a bug; see its log)",
                ),
            )

    def _serve(self, rid: bytes, body: bytes) -> None:
        try:
            msg = ep.decode_to_gateway([body], self.max_frame_bytes)
        except ProtocolError as e:
            self.stats.add(f"rejected_{e.reason}")
            self._reply(
                rid,
                ep.Error(
                    call_id=ep.salvage_call_id([body]),
                    reason=ep.EngineReason(e.reason.value),
                    detail=e.detail[:1024],
                ),
            )
            return
        tag = msg.__struct_config__.tag
        self.stats.add(f"calls_{tag}")
        if isinstance(msg, ep.Progress):  # never answered, never counted in flight
            self._progress(rid, msg)
            return
        deadline = getattr(msg, "deadline_unix_ms", 0)
        if deadline and now_ms() >= deadline:
            self.stats.add("rejected_timeout")
            self._reply(rid, expired(msg.call_id, "it arrived"))
            return
        if isinstance(msg, ep.Describe):
            self._reply(rid, self._describe(msg))
            return
        if isinstance(msg, ep.Poll):
            self._reply(rid, self._poll(rid, msg))
            return
        if isinstance(msg, ep.Links):
            self._reply(rid, self.adapter.links(msg.call_id))
            return
        if len(self.waits) >= self.max_inflight:
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
        try:
            reply = self._call(rid, msg)
        except Exception as e:
            reply = self._call_error(msg, e)
        if reply is not None:
            self._reply(rid, reply)

    def _call(self, rid: bytes, msg: ep.ToGateway) -> ep._Msg | None:
        """The reply of a call, or None when it waits (its reply comes from waits.py)."""
        if isinstance(msg, ep.Publish | ep.Fetch):
            return self._start(rid, msg)
        if isinstance(msg, ep.Lookup):
            return self._lookup(rid, msg)
        if isinstance(msg, ep.Wait):
            entry = self._entry(rid, msg.handle_id)
            if msg.timeout_ms == 0 and not entry.handle.session.completion.done():
                return ep.Pending(call_id=msg.call_id)
            return self.waits.wait(
                Call(
                    rid,
                    msg.call_id,
                    msg.handle_id,
                    entry,
                    msg.close,
                    time.monotonic() + msg.timeout_ms / 1000,
                    msg.deadline_unix_ms,
                    "wait",
                )
            )
        if isinstance(msg, ep.Cancel):
            entry = self._entry(rid, msg.handle_id)
            before(msg.deadline_unix_ms, entry.handle.cancel)
            return ep.Ok(call_id=msg.call_id)
        if isinstance(msg, ep.Close):
            entry = self._entry(rid, msg.handle_id)
            call = Call(
                rid,
                msg.call_id,
                msg.handle_id,
                entry,
                True,
                time.monotonic() + msg.timeout_ms / 1000,
                msg.deadline_unix_ms,
                "close",
            )
            return self.waits.begin_close(call)
        raise AssertionError(f"unexpected message {type(msg).__name__}")

    # -- publish / fetch ----------------------------------------------------------------------
    def _start(self, rid: bytes, msg: ep.Publish | ep.Fetch) -> ep._Msg | None:
        """Publish or Fetch: the handle of the open call with this key, or a new one; with
        ``wait_ms``, waited on in the same call."""
        adapter = self.adapter
        if not adapter.serves(msg):
            return self._refuse(
                msg.call_id, ep.EngineReason.WRONG_ROLE, f"this daemon is a {adapter.name}"
            )
        if (problem := adapter.malformed(msg)) is not None:
            return self._refuse(msg.call_id, ep.EngineReason.MALFORMED, problem)
        key, digest = adapter.key(msg), adapter.digest(msg)
        if (work := self.handles.open_work(key)) is not None:
            if work.digest != digest:
                return self._refuse(
                    msg.call_id,
                    ep.EngineReason.DUPLICATE,
                    f"request {msg.request_id} is already {adapter.opened} with other parameters",
                )
            return self._started_reply(rid, msg, self.handles.retried(rid, key))
        if self.refusing is not None:
            return self._refuse(
                msg.call_id,
                self.refusing,
                f"the daemon is {self.refusing.value.replace('_', ' ')}",
            )
        if self.handles.full:
            return self._refuse(
                msg.call_id,
                ep.EngineReason.BUSY,
                f"{self.handles.max_handles} handles open (max_handles)",
            )
        if (problem := adapter.token_problem(msg)) is not None:
            return self._refuse(msg.call_id, ep.EngineReason.MALFORMED, problem)
        token = adapter.new_token(msg)
        handle = before(msg.deadline_unix_ms, adapter.start(msg, token))
        return self._started_reply(rid, msg, self.handles.open(rid, handle, key, digest, token))

    def _started_reply(self, rid: bytes, msg: ep.Publish | ep.Fetch, hid: int) -> ep._Msg | None:
        """The Handle; for a waiting call, its Outcome (now or later)."""
        entry = self.handles[hid]
        if not msg.wait_ms:
            return self.adapter.handle_reply(msg, hid, entry.token)
        return self.waits.wait(
            Call(
                rid,
                msg.call_id,
                hid,
                entry,
                msg.close,
                time.monotonic() + msg.wait_ms / 1000,
                msg.deadline_unix_ms,
                "start",
            )
        )

    def _progress(self, rid: bytes, msg: ep.Progress) -> None:
        """A streamed publish's mark: no reply; a bad one is counted (here when the handle is
        unknown to this connection or the daemon is a receiver, else by the sender) and
        fails the publish."""
        entry = self.handles.owned(rid, msg.handle_id)
        why = "unknown" if entry is None else self.adapter.mark(entry.handle, msg.layers_ready)
        if why is not None:
            self.stats.add(f"stream_marks_refused_{why}")

    def orphaned(self, rid: bytes, live: set[bytes]) -> None:
        """Connection ``rid`` closed: the handles no live connection holds any more are told
        (a streamed publish still open is aborted: roles.py ``orphaned``)."""
        for entry in self.handles.orphaned(rid, live):
            self.adapter.orphaned(entry.handle)

    def _describe(self, msg: ep.Describe) -> ep._Msg:
        """PoolInfo; with a topology, the engine declares its rank's record first."""
        assert self.pool_info is not None
        if msg.topology is not None:
            try:
                self.service.declare_topology(msg.topology)
            except RejectedError as e:
                return self._refuse(msg.call_id, ep.EngineReason(e.reason.value), e.detail)
        return msgspec.structs.replace(
            self.pool_info, call_id=msg.call_id, topology=self.service.topology
        )

    def _lookup(self, rid: bytes, msg: ep.Lookup) -> ep._Msg:
        """The open call with this key, shared with this connection."""
        problem = self.adapter.lookup_problem(msg)
        if problem is not None:
            return self._refuse(msg.call_id, ep.EngineReason.MALFORMED, problem)
        found = self.handles.share(rid, self.adapter.key(msg))
        if found is not None:
            return ep.Handle(call_id=msg.call_id, handle_id=found)
        return self._refuse(
            msg.call_id,
            ep.EngineReason.UNKNOWN_HANDLE,
            f"no open {self.adapter.opens} of request {msg.request_id}",
        )

    def _refuse(self, call_id: int, reason: ep.EngineReason, detail: str) -> ep.Error:
        self.stats.add(f"rejected_{reason}")
        return ep.Error(call_id=call_id, reason=reason, detail=detail)

    def _entry(self, rid: bytes, handle_id: int) -> Entry:
        entry = self.handles.owned(rid, handle_id)
        if entry is None:
            raise _UnknownHandle
        return entry

    def _poll(self, rid: bytes, msg: ep.Poll) -> ep._Msg:
        entry = self.handles.owned(rid, msg.handle_id)
        if entry is None:
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
        return self.adapter.outcome(msg.call_id, entry.handle, value)

    def _call_error(self, msg: ep.ToGateway, e: Exception) -> ep.Error:
        """The Error reply for a call that raised ``e`` (counted; a bug is logged as one)."""
        if isinstance(e, _UnknownHandle):
            self.stats.add("rejected_unknown_handle")
            return ep.Error(
                call_id=msg.call_id,
                reason=ep.EngineReason.UNKNOWN_HANDLE,
                detail="no such handle on this connection",
            )
        if isinstance(e, Expired):
            self.stats.add("rejected_timeout")
            return expired(msg.call_id, "the gateway got to it")
        if isinstance(e, RejectedError):
            self.stats.add(f"rejected_{e.reason}")
            return ep.Error(
                call_id=msg.call_id, reason=ep.EngineReason(e.reason.value), detail=e.detail[:1024]
            )
        try:
            raise e
        except Exception:
            self.guard.caught(f"gateway {msg.__struct_config__.tag} call")
        self.stats.add("internal_errors")
        return ep.Error(call_id=msg.call_id, reason=ep.EngineReason.INTERNAL, detail=repr(e)[:1024])
