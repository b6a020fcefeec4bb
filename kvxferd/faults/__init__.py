"""``kvxferd faults``: real daemons through kills, stops, a non-reading peer, a partition,
SIGTERM under load and a soak; the figures go into docs/reliability.md.

Modules: :mod:`~kvxferd.faults.harness` (daemons, engines, session records),
:mod:`~kvxferd.faults.scenarios` (one fresh cluster per scenario, the bounds),
:mod:`~kvxferd.faults.report` (the table), :mod:`~kvxferd.faults.nonreader` (the peer
that never reads, a child process).
"""

from kvxferd.faults.command import add_arguments, main_faults

__all__ = ["add_arguments", "main_faults"]
