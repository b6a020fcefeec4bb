"""An example P/D proxy: prefill on one vLLM server, decode on another, kv_transfer_params forwarded.

``python -m kvxferd.integrations.vllm proxy --prefill http://P:8100 --decode http://D:8200
--port 8000 [--mode prefill-first|decode-first]`` serves ``POST /v1/completions`` and
``POST /v1/chat/completions``. Two flows:

* ``prefill-first`` (the default): the request goes to a prefill server with
  ``max_tokens = 1``, no streaming and ``kv_transfer_params = {"do_remote_decode": true}``;
  the prefill response's ``kv_transfer_params`` (the sender daemons, the transfer id, the
  fetch token) go unchanged into the original request, sent to a decode server, whose
  response (streamed or not) is the client's. It is the flow of vLLM's own
  disaggregated proxies, so it works with any connector that follows it.
* ``decode-first``: the proxy chooses the transfer id, the fetch token and the prefill
  server up front and sends both requests at once: the prefill one with
  ``{"do_remote_decode": true, "kvxferd_transfer_id": X, "kvxferd_token": T}``, the
  original one to the decode server with ``{"do_remote_prefill": true,
  "kvxferd_decode_first": true, X, T, the prefill instance's senders and keys}``. The
  decode side allocates its blocks and fetches at once; the fetch parks at the sender
  daemon until the prefill publishes, so the transfer starts the moment the prefill's
  KV exists instead of after a round trip through the proxy. Both servers must run the
  kvxferd connector. The proxy learns a prefill server's sender endpoints and keys from
  its first response: the first request sent to each prefill server runs prefill-first,
  and every prefill response after refreshes them (a sender daemon restarted on another
  endpoint is named from the next request on). A ``kvxferd_stream`` flag in the
  client's ``kv_transfer_params`` is passed to both sides.

prefill-first stays the default: it works with any connector of vLLM's P/D flow, and the
decode server holds no blocks while a prefill queues; decode-first saves the proxy's
round trip and the prefill's response time from time to first token but holds the
decode's blocks from the start.

Bounds (``TIMEOUTS``): a connect to a server ``CONNECT_S``; a whole upstream call
``--timeout-s`` (600 s). Decode-first: the prefill's answer is awaited at most
``PREFILL_AFTER_DECODE_S`` after the decode's response ended (a prefill still running
then is dropped, which aborts it in vLLM); a client that goes away drops both calls.

One log line per request (logger ``kvxferd.integrations.vllm.proxy``, INFO): ``request
{json}`` with the request id, the flow, the servers, the transfer id and the decode
side's receipt (``loaded``, ``recomputed``, ``reason``, ``ms``, ``bytes``, ``streamed``;
docs/vllm.md). vLLM returns ``kv_transfer_params`` only in a response that is not
streamed: a streamed one is logged with ``"receipt": null``.

Servers are taken round-robin; a production router adds health checks, retries and
load-aware choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from kvxferd.integrations.vllm.metadata import (
    DECODE_FIRST,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    ERROR,
    RECEIPT,
    SENDER,
    SENDER_KEY,
    SENDER_KEYS,
    SENDERS,
    STREAM,
    TOKEN,
    TRANSFER_ID,
    RemoteKv,
)

log = logging.getLogger("kvxferd.integrations.vllm.proxy")

Mode = Literal["prefill-first", "decode-first"]
MODES: tuple[Mode, ...] = ("prefill-first", "decode-first")
CONNECT_S = 10.0
TIMEOUT_S = 600.0  # a whole upstream call (a long generation streams for minutes)
PREFILL_AFTER_DECODE_S = 30.0  # decode-first: the prefill's answer after the decode ended
MAX_RECEIPT_BODY = 16 << 20  # a non-streamed response read for its receipt, at most


@dataclass(frozen=True, slots=True)
class Instance:
    """A prefill server's sender daemons, rank order, and their CURVE keys ("" when off)."""

    senders: tuple[str, ...]
    keys: tuple[str, ...]

    @classmethod
    def from_params(cls, params: Any) -> Instance | None:
        """From a prefill response's kv_transfer_params (None when they name no transfer)."""
        remote = RemoteKv.from_params(params) if isinstance(params, dict) else None
        if remote is None:
            return None
        if remote.senders:
            return cls(remote.senders, remote.sender_keys)
        return cls((remote.sender,), (remote.sender_key,))


def decode_first_params(inst: Instance, transfer_id: str, token: str) -> dict[str, Any]:
    """The decode request's kv_transfer_params, built before the prefill ran.

    No token or block count: the decode side takes its own prompt's (the proxy does not
    tokenize; both servers tokenize the same prompt with the same model).
    """
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        DECODE_FIRST: True,
        TRANSFER_ID: transfer_id,
        TOKEN: token,
        SENDER: inst.senders[0],
        SENDER_KEY: inst.keys[0],
        SENDERS: list(inst.senders),
        SENDER_KEYS: list(inst.keys),
    }


class Proxy:
    """Round-robin prefill and decode servers; one aiohttp session for all upstream calls."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        mode: Mode = "prefill-first",
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode server")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self._prefill: Iterator[str] = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode: Iterator[str] = itertools.cycle([u.rstrip("/") for u in decode])
        self._instances: dict[str, Instance] = {}  # prefill URL -> its senders, as last seen
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_S)
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
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def _stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        p, d = next(self._prefill), next(self._decode)
        inst = self._instances.get(p)
        if self.mode == "decode-first" and inst is not None:
            return await self._decode_first(request, body, p, d, inst)
        return await self._prefill_first(request, body, p, d)

    def _prefill_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        return pre

    async def _prefill_first(
        self, request: web.Request, body: dict[str, Any], p: str, d: str
    ) -> web.StreamResponse:
        assert self._session is not None
        pre = self._prefill_body(body, {DO_REMOTE_DECODE: True, **_stream_flag(body)})
        async with self._session.post(p + request.path, json=pre) as r:
            if r.status != 200:
                return web.Response(
                    status=r.status, body=await r.read(), content_type="application/json"
                )
            params = (await r.json()).get("kv_transfer_params")
        self._learn(p, params)
        tid = params.get(TRANSFER_ID) if isinstance(params, dict) else None
        dec = {**body, "kv_transfer_params": params}
        return await self._relay(request, d, dec, {"flow": "prefill-first", "transfer_id": tid}, p)

    async def _decode_first(
        self, request: web.Request, body: dict[str, Any], p: str, d: str, inst: Instance
    ) -> web.StreamResponse:
        tid, token = uuid.uuid4().hex, secrets.token_urlsafe(16)
        flag = _stream_flag(body)
        pre = self._prefill_body(
            body, {DO_REMOTE_DECODE: True, TRANSFER_ID: tid, TOKEN: token, **flag}
        )
        dec = {**body, "kv_transfer_params": {**decode_first_params(inst, tid, token), **flag}}
        prefill = asyncio.create_task(self._prefill_only(p, request.path, pre, tid))
        try:
            resp = await self._relay(
                request, d, dec, {"flow": "decode-first", "transfer_id": tid}, p
            )
        except BaseException:  # the client went away or the decode call failed
            prefill.cancel()  # dropping the call aborts the prefill request in vLLM
            raise
        # The decode has its answer: the prefill's is only read for its senders and its
        # log line; one still running after PREFILL_AFTER_DECODE_S is dropped (aborted).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(prefill, PREFILL_AFTER_DECODE_S)
        return resp

    async def _prefill_only(self, p: str, path: str, pre: dict[str, Any], tid: str) -> None:
        """Decode-first: the prefill call; its senders refresh what the proxy knows."""
        assert self._session is not None
        try:
            async with self._session.post(p + path, json=pre) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("prefill %s for transfer %s failed: %s", p, tid, e)
            return
        params = None
        with contextlib.suppress(ValueError, AttributeError):
            params = json.loads(text).get("kv_transfer_params")
        if status != 200 or (isinstance(params, dict) and ERROR in params):
            why = params.get(ERROR) if isinstance(params, dict) else text[:200]
            log.warning("prefill %s refused transfer %s (HTTP %d): %s", p, tid, status, why)
            return
        self._learn(p, params)

    def _learn(self, p: str, params: Any) -> None:
        inst = Instance.from_params(params)
        if inst is not None:
            self._instances[p] = inst

    async def _relay(
        self,
        request: web.Request,
        d: str,
        dec: dict[str, Any],
        line: dict[str, Any],
        p: str,
    ) -> web.StreamResponse:
        """Send ``dec`` to the decode server and stream its response to the client; log one line."""
        assert self._session is not None
        async with self._session.post(d + request.path, json=dec) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            await resp.prepare(request)
            keep = r.content_type == "application/json"
            kept = bytearray()
            async for chunk in r.content.iter_any():
                if keep and len(kept) + len(chunk) <= MAX_RECEIPT_BODY:
                    kept += chunk
                await resp.write(chunk)
            await resp.write_eof()
        answer: dict[str, Any] = {}
        if keep:
            with contextlib.suppress(ValueError):
                answer = json.loads(bytes(kept)) or {}
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        receipt = kv.get(RECEIPT) if isinstance(kv, dict) else None
        log.info(
            "request %s",
            json.dumps(
                {
                    "request_id": answer.get("id") if isinstance(answer, dict) else None,
                    **line,
                    "prefill": p,
                    "decode": d,
                    "status": r.status,
                    "receipt": receipt,
                }
            ),
        )
        return resp


def _stream_flag(body: dict[str, Any]) -> dict[str, Any]:
    """The client's ``kvxferd_stream`` (layer streaming), passed on to both sides."""
    kv = body.get("kv_transfer_params")
    return {STREAM: True} if isinstance(kv, dict) and kv.get(STREAM) is True else {}


def serve(
    prefill: list[str],
    decode: list[str],
    host: str,
    port: int,
    mode: Mode = "prefill-first",
    timeout_s: float = TIMEOUT_S,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(Proxy(prefill, decode, mode, timeout_s).app(), host=host, port=port, print=None)
