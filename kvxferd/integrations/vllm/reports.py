"""Reports: the request ids the worker side owes vLLM in get_transfer_results.

Engine thread only (no lock). vLLM frees or reuses a request's blocks once it is
reported, so each id is reported once and only when the daemons are done with it.

Send side, zero copy only (vLLM frees a held prefill request's blocks late)::

    hold()          save() handed the request's own blocks to a publish     -> holding
    publish_ended() its publish ended and no read can touch the blocks       -> sent
    take(finished)  vLLM said it finished (this call or an earlier one)      -> finished
                    in sent and finished: reported in finished_sending, once, and
                    forgotten by all three; a finished id nobody holds is not kept

Receive side: :meth:`load_ended` adds the request to ``finished_recving`` (and, when its
load failed, to ``failed_recving``, a subset); :meth:`take` hands both over and empties
them. :meth:`receipt` keeps an ended load's receipt until :meth:`take_receipts` hands it
to the scheduler side (the connector's worker metadata of the same step).
"""

from __future__ import annotations

from collections.abc import Collection

from kvxferd.integrations.vllm.metadata import Receipt


class Reports:
    """finished_sending / finished_recving / failed_recving, between two get_transfer_results."""

    def __init__(self) -> None:
        # Zero copy: req ids whose blocks a publish holds (saved, not yet reported), those
        # whose publish ended, and those vLLM said finished; a request is reported in
        # finished_sending once it is in both of the last two.
        self.holding: set[str] = set()
        self.sent: set[str] = set()
        self.finished: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.receipts: dict[str, Receipt] = {}

    def hold(self, req_id: str) -> None:
        self.holding.add(req_id)

    def publish_ended(self, req_id: str) -> None:
        self.sent.add(req_id)

    def load_ended(self, req_id: str, *, failed: bool = False) -> None:
        self.finished_recving.add(req_id)
        if failed:
            self.failed_recving.add(req_id)

    def receipt(self, req_id: str, r: Receipt) -> None:
        self.receipts[req_id] = r

    def take_receipts(self) -> dict[str, Receipt]:
        """The receipts of loads ended since the last call."""
        out, self.receipts = self.receipts, {}
        return out

    def any_recving(self) -> bool:
        """Whether a load's end waits to be reported."""
        return bool(self.finished_recving or self.failed_recving)

    def take(self, finished_req_ids: Collection[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call."""
        holding = self.holding
        self.finished.update(r for r in finished_req_ids if r in holding)
        sending = self.sent & self.finished
        self.sent -= sending
        self.finished -= sending
        holding -= sending
        done, failed = self.finished_recving, self.failed_recving
        self.finished_recving, self.failed_recving = set(), set()
        return sending, done, failed
