"""The vLLM connector's decode-first params and receipts, on the scheduler side and in the proxy.

Stand-ins for vLLM's Request, blocks and scheduler output (as tests_vllm/test_scheduler.py);
the flow itself, with real vLLM engines and daemons, is tests_vllm/test_decode_first.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvxferd.integrations.vllm.metadata import (
    ParamsError,
    Receipt,
    RemoteKv,
    chosen_transfer,
)
from kvxferd.integrations.vllm.proxy import Instance, decode_first_params
from kvxferd.integrations.vllm.scheduler import SchedulerSide

pytestmark = pytest.mark.timeout(60)

BS = 32
SENDER = "tcp://10.0.0.1:5555"
TOKEN = "Tok_en-0123456789abcdef"


class Status(enum.Enum):
    RUNNING = 0
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_ABORTED = 3


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int = 0
    status: Status = Status.RUNNING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class Manager:
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return (self.blocks[rid],)


@dataclass
class Out:
    num_scheduled_tokens: dict[str, int]


def producer() -> tuple[SchedulerSide, Manager]:
    s = SchedulerSide(producer=True, consumer=False, block_size=BS, sender=SENDER)
    m = Manager()
    s.bind_kv_cache_manager(m)
    return s, m


def consumer(recompute: bool = True) -> SchedulerSide:
    return SchedulerSide(
        producer=False, consumer=True, block_size=BS, sender=None, recompute=recompute
    )


def prefill(s: SchedulerSide, m: Manager, params: dict[str, Any]) -> tuple[Any, Req]:
    r = Req("r1", list(range(40)), params)
    m.blocks["r1"] = [3, 4]
    s.update_state_after_alloc(r, Blocks([3, 4]), 0)
    return s.build_connector_meta(Out({"r1": 40})), r


def test_decode_first_prefill_publishes_under_the_routers_id_and_token() -> None:
    """A prefill given a transfer id and token publishes under exactly those, and its output names them."""
    s, m = producer()
    params = {"do_remote_decode": True, "kvxferd_transfer_id": "px-1", "kvxferd_token": TOKEN}
    plan, r = prefill(s, m, {**params, "kvxferd_stream": True})
    assert [(x.transfer_id, x.token, x.stream) for x in plan.saves] == [("px-1", TOKEN, True)]
    r.status = Status.FINISHED_LENGTH_CAPPED
    out = s.request_finished(r)[1]
    remote = RemoteKv.from_params(out)
    assert remote is not None and (remote.transfer_id, remote.token) == ("px-1", TOKEN)
    assert remote.decode_first and remote.stream


@pytest.mark.parametrize(
    ("tid", "token"),
    [
        ("px-1", "short"),  # under MIN_TOKEN_CHARS
        ("px-1", "x" * 129),
        ("px-1", "has space and more than 16"),
        ("px-1", TOKEN + "\n"),  # $ alone would let a trailing newline through
        ("px-1\n", TOKEN),
        ("px-1", 1234567890123456789),
        ("has space", TOKEN),
        ("x" * 257, TOKEN),
        ("", TOKEN),
        ("px-1", None),  # one without the other
        (None, TOKEN),
    ],
)
def test_a_malformed_router_transfer_is_refused_not_replaced(tid: Any, token: Any) -> None:
    """A bad transfer id or token is refused: nothing saved, and the output says why."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if tid is not None:
        params["kvxferd_transfer_id"] = tid
    if token is not None:
        params["kvxferd_token"] = token
    with pytest.raises(ParamsError):
        chosen_transfer(params)
    s, m = producer()
    plan, r = prefill(s, m, params)
    assert plan.saves == []
    r.status = Status.FINISHED_LENGTH_CAPPED
    delay, out = s.request_finished(r)
    assert out is not None and set(out) == {"kvxferd_error"}, out
    assert ("kvxferd_token" if tid == "px-1" else "kvxferd_transfer_id") in out["kvxferd_error"]


def test_decode_first_params_load_the_prompt_the_decode_side_has() -> None:
    """The proxy's params carry no token count: the decode side loads its own prompt's, in its blocks."""
    inst = Instance((SENDER, "tcp://10.0.0.2:5555"), ("", ""))
    s = consumer()
    r = Req("d1", list(range(65)), decode_first_params(inst, "px-2", TOKEN))
    assert s.get_num_new_matched_tokens(r, 0) == (65, True)
    s.update_state_after_alloc(r, Blocks([8, 6, 5, 11]), 65)
    (load,) = s.build_connector_meta(Out({})).loads
    assert load.block_ids == (8, 6, 5) and load.remote.transfer_id == "px-2"
    assert load.remote.senders == inst.senders and load.remote.token == TOKEN
    assert load.remote.decode_first and not load.remote.stream


def test_the_proxy_learns_an_instance_from_a_prefill_output() -> None:
    """A prefill output's params give the proxy the instance's senders and keys, rank order."""
    out = RemoteKv("t", SENDER, 3, 1, TOKEN, "k0", (SENDER, "tcp://b:1"), ("k0", "k1")).to_params()
    assert Instance.from_params(out) == Instance((SENDER, "tcp://b:1"), ("k0", "k1"))
    assert Instance.from_params({"kvxferd_error": "x"}) is None


def loading(s: SchedulerSide, rid: str) -> Req:
    r = Req(rid, list(range(40)), decode_first_params(Instance((SENDER,), ("",)), rid, TOKEN))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2]), 40)
    return r


def test_a_loaded_request_finishes_with_its_receipt() -> None:
    """The workers' receipts of a load reach the request's output, ranks merged: their bytes summed."""
    s = consumer()
    r = loading(s, "d1")
    one = Receipt(True, blocks=2, nbytes=1000, source=SENDER, ms=3.0)
    s.update_connector_output(set(), {"d1": one})
    s.update_connector_output({"d1"}, {"d1": Receipt(True, blocks=2, nbytes=500, ms=5.0)})
    r.status = Status.FINISHED_LENGTH_CAPPED
    out = s.request_finished(r)[1]
    assert out == {
        "kvxferd_receipt": {
            "loaded": True,
            "recomputed": False,
            "reason": None,
            "blocks": 2,
            "bytes": 1500,
            "from": SENDER,
            "ms": 5.0,
            "streamed": False,
        }
    }


def test_a_failed_load_is_receipted_recomputed_with_its_reason() -> None:
    """Under policy recompute a failed load's receipt says recomputed and why; one failed rank fails the request's load."""
    s = consumer(recompute=True)
    r = loading(s, "d1")
    s.update_connector_output(
        {"d1"},
        {"d1": Receipt(True, blocks=2, nbytes=10).merge(Receipt(False, reason="expired"))},
    )
    r.status = Status.FINISHED_LENGTH_CAPPED
    receipt = s.request_finished(r)[1]["kvxferd_receipt"]  # type: ignore[index]
    assert (receipt["loaded"], receipt["recomputed"], receipt["reason"]) == (
        False,
        True,
        "expired",
    )


def test_a_receipt_for_a_finished_request_is_not_kept() -> None:
    """Under policy fail vLLM finishes a failed request before it hands over the step's
    receipts: those are dropped, not kept for ever."""
    s = consumer(recompute=False)
    r = loading(s, "d1")
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r) == (False, None)
    s.update_connector_output({"d1"}, {"d1": Receipt(False, reason="expired")})
    assert s._receipts == {}


def test_params_for_another_prompt_are_receipted_recomputed() -> None:
    """Params describing another prompt length load nothing, and the receipt says recomputed: mismatch."""
    s = consumer()
    params = RemoteKv("t-1", SENDER, 40, 2).to_params()
    r = Req("d1", list(range(50)), params)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    r.status = Status.FINISHED_LENGTH_CAPPED
    receipt = s.request_finished(r)[1]["kvxferd_receipt"]  # type: ignore[index]
    assert (receipt["loaded"], receipt["recomputed"], receipt["reason"]) == (
        False,
        True,
        "mismatch",
    )


def test_the_receipt_counts_reach_vllm_as_deltas() -> None:
    """Each step hands vLLM's KV connector stats the loads and recomputes since the last step, once."""
    from kvxferd.integrations.vllm.counters import Stats

    st = Stats()
    st.add(loaded=2)
    st.recomputed_for("timeout")
    assert st.receipt_delta() == {"loaded": 2, "recomputed": 1, "recomputed{timeout}": 1}
    assert st.receipt_delta() == {}
    st.recomputed_for("expired")
    assert st.receipt_delta() == {"recomputed": 1, "recomputed{expired}": 1}
    assert st.snapshot()["recomputed{timeout}"] == 1
