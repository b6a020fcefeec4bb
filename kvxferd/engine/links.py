"""The ``links`` engine call on the engine side: ``Client.links()`` and ``AsyncClient.links()``.

A sender daemon answers with each registered receiver's link as its link probe measured
it (kvxferd/transfer/link_probes.py: state, GB/s or nil, transport, when); a receiver
daemon with its sender links, each "unmeasured" (the sender measures; ask its daemon).
The gateway's side is the role adapters' ``links`` (roles.py). The call is engine
protocol version 5 only (``engine_protocol.V5_ONLY``): a daemon that predates it answers
``Error(unknown_message)``, raised here as :class:`EngineRejected`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvxferd.engine import engine_protocol as ep
from kvxferd.engine.errors import EngineRejected


def _build(call_id: int, _deadline_ms: int) -> ep.Links:
    return ep.Links(call_id=call_id)


def _links(reply: ep.ToEngine) -> list[ep.LinkInfo]:
    if isinstance(reply, ep.LinksReply):
        return list(reply.links)
    if isinstance(reply, ep.Error):
        raise EngineRejected(reply.reason, f"links: {reply.detail}")
    raise EngineRejected(ep.EngineReason.MALFORMED, f"links: unexpected reply {reply!r}"[:300])


class LinksCall:
    """What ``Client`` gets ``links()`` from (its ``_call``: one request, its reply)."""

    _call: Callable[..., ep.ToEngine]

    def links(self) -> list[ep.LinkInfo]:
        """Each link of the daemon and its last measured speed, by peer (module docstring)."""
        return _links(self._call(_build))


class AsyncLinksCall:
    """What ``AsyncClient`` gets ``links()`` from."""

    _call: Callable[..., Awaitable[ep.ToEngine]]

    async def links(self) -> list[ep.LinkInfo]:
        """See :meth:`LinksCall.links`."""
        return _links(await self._call(_build))
