"""The scheduler side's plans, with stand-ins for vLLM's Request, blocks and scheduler output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvxferd.integrations.vllm.metadata import RemoteKv
from kvxferd.integrations.vllm.scheduler import SchedulerSide

pytestmark = pytest.mark.timeout(60)

BS = 32
SENDER = "tcp://10.0.0.1:5555"


class Status(enum.Enum):
    RUNNING = 0
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_STOPPED = 2
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


def consumer() -> SchedulerSide:
    return SchedulerSide(producer=False, consumer=True, block_size=BS, sender=None)


def test_save_is_planned_in_the_step_that_completes_the_prompt() -> None:
    """A chunked prefill is saved once, in its last chunk's step, with the prompt's blocks only."""
    s, m = producer()
    r = Req("r1", list(range(70)), {"do_remote_decode": True})
    m.blocks["r1"] = [4, 9, 2, 7]  # one more than the prompt's 3 blocks
    s.update_state_after_alloc(r, Blocks(m.blocks["r1"]), 0)
    assert s.build_connector_meta(Out({"r1": 64})).saves == []
    r.num_computed_tokens = 64
    plan = s.build_connector_meta(Out({"r1": 6}))
    assert [(x.req_id, x.block_ids) for x in plan.saves] == [("r1", (4, 9, 2))]
    assert s.build_connector_meta(Out({"r1": 1})).saves == []


def test_finished_prefill_returns_params_and_frees_its_blocks() -> None:
    """A length-capped prefill returns kv_transfer_params naming its transfer and its fetch token; vLLM frees its blocks at once."""
    s, m = producer()
    r = Req("r1", list(range(33)), {"do_remote_decode": True})
    m.blocks["r1"] = [1, 2]
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    save = s.build_connector_meta(Out({"r1": 33})).saves[0]
    r.status = Status.FINISHED_LENGTH_CAPPED
    delay, params = s.request_finished(r)
    assert delay is False
    # The fetch token the worker publishes with travels to the decode side in the params.
    assert len(save.token) >= 16
    assert RemoteKv.from_params(params) == RemoteKv(
        save.transfer_id, SENDER, 33, 2, save.token, "", (SENDER,), ("",)
    )
    assert params is not None and params["kvxferd_senders"] == [SENDER]


def test_aborted_prefill_after_its_save_is_unpublished() -> None:
    """A prefill aborted after its prompt was saved returns no params and unpublishes the transfer."""
    s, m = producer()
    r = Req("r1", list(range(10)), {"do_remote_decode": True})
    m.blocks["r1"] = [3]
    s.update_state_after_alloc(r, Blocks([3]), 0)
    tid = s.build_connector_meta(Out({"r1": 10})).saves[0].transfer_id
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r) == (False, None)
    assert s.build_connector_meta(Out({})).unpublish == [tid]


def test_plain_requests_are_left_alone() -> None:
    """Requests without kv_transfer_params plan nothing on either side."""
    for s in (producer()[0], consumer()):
        r = Req("r1", [1, 2, 3], None)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, Blocks([1]), 0)
        assert s.build_connector_meta(Out({"r1": 3})).empty()
        r.status = Status.FINISHED_LENGTH_CAPPED
        assert s.request_finished(r) == (False, None)


def remote_params(n: int) -> dict[str, Any]:
    return RemoteKv("t-1", SENDER, n, -(-n // BS)).to_params()


def test_decode_loads_the_prompt_once() -> None:
    """A decode request loads its prompt's tokens asynchronously, into its first blocks, once."""
    s = consumer()
    r = Req("d1", list(range(65)), remote_params(65))
    assert s.get_num_new_matched_tokens(r, 0) == (65, True)
    s.update_state_after_alloc(r, Blocks([8, 6, 5, 11]), 65)
    plan = s.build_connector_meta(Out({}))
    assert [(x.req_id, x.block_ids, x.skip) for x in plan.loads] == [("d1", (8, 6, 5), 0)]
    assert s.get_num_new_matched_tokens(r, 65) == (0, False)  # do_remote_prefill is now off
    s.update_state_after_alloc(r, Blocks([8, 6, 5, 11]), 0)
    assert s.build_connector_meta(Out({})).empty()


def test_local_prefix_hit_skips_its_blocks() -> None:
    """Blocks already computed locally are fetched but marked to skip."""
    s = consumer()
    r = Req("d1", list(range(100)), remote_params(100))
    assert s.get_num_new_matched_tokens(r, 64) == (36, True)
    s.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 36)
    assert s.build_connector_meta(Out({})).loads[0].skip == 2


def test_params_for_another_prompt_are_not_loaded() -> None:
    """Params whose token count does not match the prompt load nothing and release the remote KV."""
    s = consumer()
    r = Req("d1", list(range(50)), remote_params(40))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    plan = s.build_connector_meta(Out({}))
    assert plan.loads == [] and [x.transfer_id for x in plan.release] == ["t-1"]


def test_abort_while_loading_cancels_the_load() -> None:
    """A decode request finished while loading is cancelled on the worker; after its report, nothing more."""
    s = consumer()
    r = Req("d1", list(range(10)), remote_params(10))
    s.update_state_after_alloc(r, Blocks([1]), 10)
    s.build_connector_meta(Out({}))
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r) == (False, None)
    assert s.build_connector_meta(Out({})).cancel_loads == ["d1"]


def test_abort_before_allocation_releases_the_remote_kv() -> None:
    """A decode request aborted before it was scheduled releases the prefill side's transfer."""
    s = consumer()
    r = Req("d1", list(range(10)), remote_params(10))
    r.status = Status.FINISHED_ABORTED
    s.request_finished(r)
    assert [x.transfer_id for x in s.build_connector_meta(Out({})).release] == ["t-1"]


def test_remote_params_must_be_complete() -> None:
    """Params missing a kvxferd field, or with wrong types, are not a remote prefill."""
    good = remote_params(5)
    assert RemoteKv.from_params(good) is not None
    for key in ("kvxferd_transfer_id", "kvxferd_sender", "kvxferd_num_tokens"):
        assert RemoteKv.from_params({k: v for k, v in good.items() if k != key}) is None
    assert RemoteKv.from_params({**good, "kvxferd_num_blocks": "x"}) is None
    assert RemoteKv.from_params({**good, "do_remote_prefill": False}) is None


def test_zero_copy_reports_held_requests_once_and_keeps_no_other_ids() -> None:
    """finished_sending names a held request only after vLLM said it finished, and finished ids of other requests are not kept."""
    from kvxferd.integrations.vllm.settings import ConnectorSettings
    from kvxferd.integrations.vllm.worker import WorkerSide, _Sent

    w = WorkerSide(
        ConnectorSettings(engine_socket="ipc:///nonexistent/kvxferd.sock", zero_copy=True),
        producer=True,
        consumer=False,
    )
    try:
        w.attachment.daemon = object()  # type: ignore[assignment]  # results() only checks it is there
        w.reports.hold("held")  # what save() records for a published request
        w._done.put(_Sent("held"))  # its publish ended and was closed
        assert w.results({"other-1", "other-2"}) == (set(), set(), set())  # not finished yet
        assert w.reports.finished == set()  # ids of requests nobody holds are not kept
        assert w.results({"held"})[0] == {"held"}
        assert w.results(set())[0] == set()  # reported once
        assert not (w.reports.holding or w.reports.sent or w.reports.finished)
    finally:
        w.io.client.close_client()


def test_a_step_that_schedules_nothing_is_idle() -> None:
    """A step with no token scheduled runs no forward: its plan says so (the worker may then
    wait a moment for a load in flight and report it in this step)."""
    s = consumer()
    assert s.build_connector_meta(Out({})).idle
    assert not s.build_connector_meta(Out({"r1": 3})).idle
