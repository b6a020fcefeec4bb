"""An example P/D proxy: prefill on one vLLM server, decode on another, kv_transfer_params forwarded.

``python -m kvxferd.integrations.vllm proxy --prefill http://P:8100 --decode http://D:8200
--port 8000`` serves ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. the request goes to a prefill server with ``max_tokens = 1``, no streaming and
   ``kv_transfer_params = {"do_remote_decode": true}``;
2. the prefill response's ``kv_transfer_params`` (the sender daemon's endpoint and the
   transfer id) go unchanged into the original request, sent to a decode server,
   whose response (streamed or not) is the client's.

Servers are taken round-robin. It is the flow of vLLM's own disaggregated proxies, so
it works with any connector that follows it; a production router adds health checks,
retries and load-aware choice.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvxferd.integrations.vllm.proxy")

TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=10)


class Proxy:
    """Round-robin prefill and decode servers; one aiohttp session for all upstream calls."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode server")
        self._prefill: Iterator[str] = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode: Iterator[str] = itertools.cycle([u.rstrip("/") for u in decode])
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/healthz", self.healthz)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=TIMEOUT)

    async def _stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body: dict[str, Any] = await request.json()
        path = request.path
        pre = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        async with self._session.post(next(self._prefill) + path, json=pre) as r:
            if r.status != 200:
                return web.Response(
                    status=r.status, body=await r.read(), content_type="application/json"
                )
            params = (await r.json()).get("kv_transfer_params")
        dec = {**body, "kv_transfer_params": params}
        async with self._session.post(next(self._decode) + path, json=dec) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


def serve(prefill: list[str], decode: list[str], host: str, port: int) -> None:
    web.run_app(Proxy(prefill, decode).app(), host=host, port=port, print=None)
