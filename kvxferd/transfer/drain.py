"""What a drain dropped: the ``drain_dropped_*`` counters, the shutdown reports, their words.

The drain itself is each service's own bounded sequence (sender/drain.py;
receiver/shutdown.py: its ``shutdown_report``), run on state only that service owns. What both
share lives here: the counters a drain adds (in ``Stats``; /metrics shows them while
it runs), the report each ``shutdown`` returns, and the counts as the daemon's last log
line says them (daemon.py)::

    sender    3 published requests never fetched, 1 transfer cut, 0 in doubt
    sender    0 published requests never fetched, 0 transfers cut, 0 in doubt, 50 moved
    receiver  1 fetch cut, 0 in doubt

A report is *complete* when nothing was dropped, nothing is in doubt and every thread
joined: the daemon then exits 0.
"""

from __future__ import annotations

from dataclasses import dataclass

# Counters (Stats) of what a drain dropped; /metrics shows them while the drain runs.
# sender: published, ended with no fetch
DROPPED_NEVER_FETCHED = "drain_dropped_never_fetched"
# sender: ended with a fetch attached and not finished; receiver: a fetch the drain ended
# before its Result came
DROPPED_CUT = "drain_dropped_cut"
# sender: a write still in flight at the end; receiver: a fetch whose blocks were in doubt
# at the end
DROPPED_IN_DOUBT = "drain_dropped_in_doubt"


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What a shutdown achieved within its bound, and what its drain dropped.

    ``never_fetched`` and ``transfers_cut`` count the requests the drain ended
    (``failed``/``shutting_down``): still open at ``drain_timeout_ms``, or closed or
    cancelled by their engine while the drain ran. ``requests_in_doubt`` counts the
    requests with a write still in flight at the end (a cut request may be one too).
    """

    drain_complete: bool  # the drain ended no request: each was fetched (or ended) in time
    drained: bool  # every admitted write returned before the deadline
    writes_in_doubt: int  # writes still in flight (their memory was kept registered)
    threads_joined: bool
    elapsed_s: float
    never_fetched: int = 0  # published, no fetch attached when the drain ended it
    transfers_cut: int = 0  # a fetch attached, not finished when the drain ended it
    requests_in_doubt: int = 0  # requests with a write still in flight at the end
    moved: int = 0  # requests handed over to another sender (sender/handover.py)

    @property
    def complete(self) -> bool:
        """Nothing dropped, nothing in doubt, every thread joined: the daemon exits 0."""
        return self.drain_complete and self.drained and self.threads_joined

    def counts(self) -> str:
        """The drain's counts as the daemon's last log line says them."""
        return drain_counts(
            self.never_fetched, self.transfers_cut, self.requests_in_doubt, self.moved
        )


def drain_counts(never_fetched: int, cut: int, in_doubt: int, moved: int = 0) -> str:
    """``"3 published requests never fetched, 1 transfer cut, 0 in doubt"`` (and
    ``", 50 moved"`` after a handover moved some)."""
    return (
        f"{never_fetched} published request{'' if never_fetched == 1 else 's'} never fetched, "
        f"{cut} transfer{'' if cut == 1 else 's'} cut, {in_doubt} in doubt"
        + (f", {moved} moved" if moved else "")
    )


@dataclass(frozen=True, slots=True)
class RxShutdownReport:
    """What a receiver's shutdown achieved within its bound, and what its drain dropped."""

    fetches_cut: int  # open fetches the drain ended (at its deadline, or an engine's cancel)
    in_doubt: int  # fetches whose blocks a write may still reach (memory kept registered)
    blocks_safe: bool  # no outcome in doubt: memory deregistered
    threads_joined: bool
    elapsed_s: float

    @property
    def complete(self) -> bool:
        """Nothing dropped, nothing in doubt, the io thread joined: the daemon exits 0."""
        return self.fetches_cut == 0 and self.blocks_safe and self.threads_joined

    def counts(self) -> str:
        """The drain's counts as the daemon's last log line says them."""
        return rx_drain_counts(self.fetches_cut, self.in_doubt)


def rx_drain_counts(cut: int, in_doubt: int) -> str:
    """``"1 fetch cut, 0 in doubt"``: a receiver's :func:`drain_counts`."""
    return f"{cut} fetch{'' if cut == 1 else 'es'} cut, {in_doubt} in doubt"
