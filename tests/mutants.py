"""``make mutants``: revert each guarded fix for a moment and check that its tests fail.

Each :class:`Mutant` is a hand-written revert of one fix the project guards (the
sender races of seed 004, the wake-up rule of seed 001, and issue 9's fixes item
by item: bad endpoints and guarded threads, in-doubt writes and their resolution
on the wire, engine call deadlines and keys, sender restarts, peer isolation,
deadlines end to end, leaks): a few exact text replacements and the tests that
must catch it, preferably fast race or wire tests. The runner copies the working
tree (tracked and untracked, not ignored files) into ``--jobs`` temporary
directories, checks that every named test passes there unchanged (the baseline),
then runs the mutants side by side, one at a time in each copy: it applies the
replacements, runs only that mutant's tests, and puts the files back.

One line per mutant, in list order; a killed mutant names the test that caught it::

    killed    seed004-2-reopen            7.9 s  tests failed, as they must
              test_failed_session_refuses_a_queued_slice_and_stays_failed - AssertionError: ...
    survived  seed001-owner-loop          6.1 s  the tests PASSED with the fix reverted
    stale     seed004-4-cancel-unlocked   0.0 s  old text not found in kvxferd/transfer/session.py

A mutant whose tests pass is run again, up to three runs in all: one caught only on
a later run says so on its line (its test is timing-dependent and should be
tightened); one that passes all three is *survived*.

The exit code is 0 only when every mutant was killed. A *stale* mutant (its old
text is no longer in the file, or is there more than once) fails the run too:
the code it guarded moved, so the mutant must be rewritten to follow it. Keep the
old texts short and specific, so ordinary edits around them do not make them stale
(tests/test_faults_mutants.py checks this in ``make test``). A *broken* mutant
(pytest could not even collect, e.g. a revert that is not valid Python) fails too.

Run: ``python tests/mutants.py`` (``--list``, ``--only NAME``, ``--jobs N``,
``-v`` to see each run's failures, ``--keep`` to keep the copies,
``--skip-baseline`` when pytest has just passed every named test, as in ``make test``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.context
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST_TIMEOUT_S = 60  # per test (pytest-timeout): a hang under a mutant counts as a failure
RUN_TIMEOUT_S = 240  # per mutant run, as a last resort
# Mutants run side by side, each in its own copy of the tree: most of a failing run is a
# test waiting out its bound, so several at once cut the wall time even on 2 cores
# (71 mutants on 2 cores: 406 s two at a time, 358 s three at a time; 114 mutants, forked
# from the preloaded server: 317 s three at a time, 425 s as fresh processes).
DEFAULT_JOBS = 3


@dataclass(frozen=True)
class Edit:
    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # the fix it reverts
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


RACES = "tests/test_races.py::"
STREAM = "tests/test_streaming.py::"
SURVIVOR_TRIES = 3  # runs of a mutant's tests before it counts as survived
TXRACES = "tests/test_sender_races.py::"
RXWIRE = "tests/test_receiver_wire.py::"
GATEWAY = "tests/test_gateway.py::"
VERSIONS = "tests/test_versions.py::"
PREFLIGHT = "tests/test_preflight.py::"
JOURNAL = "tests/test_journal.py::"
READINESS = "tests/test_readiness.py::"
DRAIN = "tests/test_drain.py::"
DISCOVERY_DAEMONS = "tests/test_discovery_daemons.py::"
HANDOVER = "tests/test_handover.py::"
INCARNATIONS = "tests/test_incarnations.py::"
FUZZ = "tests/test_fuzz_frames.py::"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "seed004-1-shared-dealer",
        "workers send Results on the shared DEALER pool instead of their own DEALERs",
        (
            Edit(
                "kvxferd/transfer/worker_outbox.py",
                "send_bounded(sock, out.frame)",
                "self.host._shared.send(endpoint, out.frame)  # type: ignore[attr-defined]",
            ),
        ),
        (RACES + "test_workers_send_results_only_on_their_own_dealers",),
    ),
    Mutant(
        "seed004-2-reopen",
        "admission no longer refuses a write of an ended session (a failed session is reopened)",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "if self._state in TX_TERMINAL:\n                reason = self._refusal_reason()",
                "if False:\n                reason = self._refusal_reason()",
            ),
        ),
        (RACES + "test_failed_session_refuses_a_queued_slice_and_stays_failed",),
    ),
    Mutant(
        "seed004-3-drained-ignores-writes",
        "an ended session counts as drained while an admitted write is in flight",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "return self._state in TX_TERMINAL and self._writes_in_flight == 0",
                "return self._state in TX_TERMINAL",
            ),
        ),
        (RACES + "test_failed_session_keeps_its_source_until_the_other_write_returns",),
    ),
    Mutant(
        "seed004-4-admission-unlocked",
        "admission checks the session's state without the lock that commits its ending",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "with self._lock:\n            if self._state in TX_TERMINAL:\n"
                "                reason = self._refusal_reason()",
                "with threading.Lock():\n            if self._state in TX_TERMINAL:\n"
                "                reason = self._refusal_reason()",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-4-cancel-unlocked",
        "cancel commits the session's ending without the lock admission runs under",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "with self._lock:\n"
                "            committed = self._commit_locked(TxOutcome(TxState.CANCELLED,",
                "with threading.Lock():\n"
                "            committed = self._commit_locked(TxOutcome(TxState.CANCELLED,",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-4-fail-unlocked",
        "fail commits the session's ending without the lock admission runs under",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "with self._lock:\n"
                "            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))",
                "with threading.Lock():\n"
                "            committed = self._commit_locked(TxOutcome(TxState.FAILED, reason, detail))",
            ),
        ),
        (RACES + "test_an_ending_during_an_admission_waits_for_it",),
    ),
    Mutant(
        "seed004-5-completion-overwrites",
        "a later outcome (a completion) overwrites the first terminal outcome",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "if self._state in TX_TERMINAL:\n            return False\n"
                "        self._state, self._outcome = outcome.state, outcome",
                "self._state, self._outcome = outcome.state, outcome",
            ),
        ),
        (RACES + "test_completion_never_overwrites_the_first_ending",),
    ),
    Mutant(
        "seed004-6-unbounded-send",
        "DEALER sends block without a deadline (SNDTIMEO -1)",
        (
            Edit(
                "kvxferd/transfer/control.py",
                "sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)",
                "sock.setsockopt(zmq.SNDTIMEO, -1)",
            ),
        ),
        (
            RACES + "test_shutdown_is_bounded_when_a_worker_send_blocks",
            RACES + "test_shutdown_is_bounded_when_a_receiver_never_reads_its_parked_refusals",
        ),
    ),
    Mutant(
        "seed004-7-thread-count",
        "a thread count below 1 is accepted",
        (
            Edit("kvxferd/config.py", "if value < 1:", "if value < -(10**9):"),
            Edit(
                "kvxferd/config.py",
                "DEFAULT_NUM_THREADS,\n        ge=1,",
                "DEFAULT_NUM_THREADS,\n        ge=-(10**9),",
            ),
        ),
        (RACES + "test_num_threads_rejects_non_positive_or_non_numeric_values",),
    ),
    Mutant(
        "seed004-8-build-failure-keeps-admission",
        "a write that was never posted does not give its admission back",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "            self._writes_in_flight -= 1\n"
                "            sl.writes_in_flight -= 1\n"
                "            self._fail_slice_locked(sl, reason, detail)",
                "            self._fail_slice_locked(sl, reason, detail)",
            ),
        ),
        (RACES + "test_build_failure_releases_its_admission_before_reporting",),
    ),
    Mutant(
        "seed001-owner-loop",
        "every asyncio waiter is woken through the first waiter's loop",
        (
            Edit(
                "kvxferd/transfer/waiters.py",
                "loop.call_soon_threadsafe(_resolve, fut, value)",
                "futures[0][0].call_soon_threadsafe(_resolve, fut, value)",
            ),
        ),
        ("tests/test_waiters.py::test_each_waiter_wakes_on_its_own_loop",),
    ),
    Mutant(
        "issue9-endpoint-wildcard",
        "a wildcard host (tcp://0.0.0.0:P, tcp://*:P) is accepted as an endpoint to dial",
        (Edit("kvxferd/endpoints.py", "if host in _WILDCARDS:", "if False:"),),
        ("tests/test_endpoints.py",),
    ),
    Mutant(
        "issue9-endpoint-source-syntax",
        "libzmq's source syntax tcp://a:1;b:2 is accepted",
        (Edit("kvxferd/endpoints.py", 'if ";" in endpoint:', "if False:"),),
        ("tests/test_endpoints.py",),
    ),
    Mutant(
        "issue9-guard-counts",
        "an exception caught in a long-lived loop is not counted",
        (Edit("kvxferd/transfer/guard.py", 'self._stats.add("thread_errors")', "pass"),),
        ("tests/test_faults_guard.py",),
    ),
    Mutant(
        "issue9-guard-liveness",
        "an exception caught in a long-lived loop does not make the component report itself broken",
        (
            Edit(
                "kvxferd/transfer/guard.py",
                "if self._first is None:\n                import sys",
                "if False:\n                import sys",
            ),
        ),
        ("tests/test_faults_guard.py",),
    ),
    # -- issue 9, item 1: no argument kills a thread --------------------------------------
    Mutant(
        "issue9-rx-bad-endpoint-refused",
        "the receiver's fetch() does not refuse an endpoint it will not dial (bad_endpoint)",
        (
            Edit(
                "kvxferd/endpoints.py",
                "        problem = connect_problem(endpoint)\n        if problem is not None:\n            verdict",
                "        problem = None\n        if problem is not None:\n            verdict",
            ),
        ),
        (
            RXWIRE
            + "test_a_bad_endpoint_is_refused_on_the_callers_thread_and_later_fetches_complete",
        ),
    ),
    Mutant(
        "issue9-tx-result-endpoint-checked",
        "the sender accepts a Register whose result_endpoint zmq would misuse",
        (
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "why = connect_problem(msg.result_endpoint)",
                "why = None",
            ),
        ),
        (TXRACES + "test_a_result_endpoint_zmq_would_misuse_is_refused_as_bad_endpoint",),
    ),
    Mutant(
        "issue9-rx-io-connect-error",
        "a connect error in the receiver's _link() escapes instead of failing that fetch",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "except zmq.ZMQError as e:  # connect_problem let it through",
                "except ImportError as e:  # connect_problem let it through",
            ),
        ),
        (RXWIRE + "test_a_connect_error_on_the_io_thread_fails_only_that_fetch",),
    ),
    Mutant(
        "issue9-rx-io-guarded",
        "an unexpected exception in the receiver's io turn is not caught (the io thread dies)",
        (
            Edit(
                "kvxferd/transfer/receiver/core.py",
                'except Exception:\n                    self.guard.caught("rx-io")',
                'except ImportError:\n                    self.guard.caught("rx-io")',
            ),
        ),
        (
            "tests/test_health.py::test_receiver_io_error_is_caught_fetches_go_on_and_healthz_is_503",
        ),
    ),
    Mutant(
        "issue9-listener-guarded",
        "an unexpected exception while the sender's listener handles a message ends the listener",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                'except Exception:\n                    s.guard.caught("listener")',
                'except ImportError:\n                    s.guard.caught("listener")',
            ),
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "except Exception:  # a bug on one message must not kill the listener",
                "except ImportError:  # a bug on one message must not kill the listener",
            ),
        ),
        (TXRACES + "test_a_listener_bug_is_counted_and_reported_and_the_listener_goes_on",),
    ),
    Mutant(
        "issue9-worker-guarded",
        "an unexpected exception in a worker's task or turn ends the worker",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "except Exception:\n                    self.host.guard.caught(self.name)",
                "except ImportError:\n                    self.host.guard.caught(self.name)",
            ),
            Edit(
                "kvxferd/transfer/worker.py",
                'except Exception:\n            self.host.guard.caught(f"{self.name}: task")',
                'except ImportError:\n            self.host.guard.caught(f"{self.name}: task")',
            ),
        ),
        (TXRACES + "test_a_worker_bug_is_counted_and_reported_and_the_worker_goes_on",),
    ),
    Mutant(
        "issue9-liveness-service-broken",
        "liveness ignores an error the service's threads caught (Guard.broken)",
        (Edit("kvxferd/service/probes.py", "why = service.broken()", "why = None"),),
        ("tests/test_health.py::test_sender_liveness_fails_naming_an_error_its_threads_caught",),
    ),
    Mutant(
        "issue9-liveness-gateway-broken",
        "liveness ignores a broken engine gateway",
        (
            Edit(
                "kvxferd/service/probes.py", 'why = f"gateway: {gw}" if gw else None', "why = None"
            ),
        ),
        ("tests/test_health.py::test_liveness_fails_naming_a_broken_gateway",),
    ),
    # -- item 2: nothing is reused while a write may land ----------------------------------
    Mutant(
        "issue9-status-check-raises",
        "a NIXL status check that raises counts as a finished (failed) write",
        (
            Edit(
                "kvxferd/transfer/worker_writes.py",
                'return self._try_release(w, "NIXL status check raised" + w.error)',
                "w.xfer.release()\n                w.over = True\n"
                "                return Change.FAILED",
            ),
        ),
        (TXRACES + "test_a_status_check_that_raises_keeps_the_write_in_flight_until_nixl_answers",),
    ),
    Mutant(
        "issue9-in-doubt-release-false",
        "a write whose release() said False counts as finished",
        (
            Edit(
                "kvxferd/transfer/worker_writes.py",
                "        if released:\n            w.over = True",
                "        if True:\n            w.over = True",
            ),
        ),
        (TXRACES + "test_a_refused_release_keeps_the_write_in_flight_until_released",),
    ),
    Mutant(
        "issue9-unsolicited-cancel-ack",
        "an in-doubt write that ends sends no CancelAck(in_doubt=false)",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "if doubted and sl.writes_in_flight == 0:",
                "if False:",
            ),
        ),
        (TXRACES + "test_a_stalled_write_that_ends_is_resolved_on_the_wire",),
    ),
    Mutant(
        "issue9-receiver-late-cancel-ack",
        "the receiver ignores a late or unsolicited CancelAck for a fetch in doubt",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "found = fetches.by_id.get(msg.fetch_id) or rx.doubts.by_id.get(msg.fetch_id)",
                "found = fetches.by_id.get(msg.fetch_id)",
            ),
        ),
        (
            RXWIRE + "test_an_unsolicited_cancel_ack_releases_an_in_doubt_result",
            RXWIRE + "test_a_late_cancel_ack_releases_an_in_doubt_fence_and_its_aux_slot",
        ),
    ),
    Mutant(
        "issue9-cancel-ack-clears-doubt",
        "a CancelAck(in_doubt=false) does not release a fence already in doubt",
        (
            Edit(
                "kvxferd/transfer/session.py",
                "elif self.fence is Fence.IN_DOUBT and not in_doubt:",
                "elif False:",
            ),
        ),
        (RXWIRE + "test_a_late_cancel_ack_releases_an_in_doubt_fence_and_its_aux_slot",),
    ),
    Mutant(
        "issue9-in-doubt-cancel-resent",
        "the receiver does not ask again (Cancel) about fetches in doubt",
        (
            Edit(
                "kvxferd/transfer/receiver/core.py",
                "self.fetches.check_deadlines(now)\n        self.doubts.retry(now)",
                "self.fetches.check_deadlines(now)",
            ),
        ),
        (RXWIRE + "test_cancel_is_resent_for_an_in_doubt_fetch_until_answered",),
    ),
    Mutant(
        "issue9-quarantined-aux-reclaimed",
        "an aux slot quarantined by a fetch in doubt is not given back when the doubt is resolved",
        (
            Edit(
                "kvxferd/transfer/receiver/in_doubt.py",
                "            rx.aux_slots.give_back([f.aux_slot])\n"
                '            rx.stats.add("aux_slots_released")\n'
                '        rx.stats.add("in_doubt_resolved")',
                '            pass\n        rx.stats.add("in_doubt_resolved")',
            ),
        ),
        (RXWIRE + "test_a_late_cancel_ack_releases_an_in_doubt_fence_and_its_aux_slot",),
    ),
    Mutant(
        "issue9-shutdown-asks-in-doubt",
        "the receiver's shutdown does not ask again about fetches in doubt before giving up on them",
        (Edit("kvxferd/transfer/receiver/shutdown.py", "rx._command(cmd.RetryInDoubt())", "pass"),),
        (RXWIRE + "test_shutdown_resends_cancel_and_is_safe_once_the_sender_answers",),
    ),
    Mutant(
        "issue9-aux-readiness",
        "readiness stays green with no free aux slot",
        (
            Edit(
                "kvxferd/service/probes.py",
                "if view.aux_free == 0:  # every fetch with aux",
                "if False:  # every fetch with aux",
            ),
        ),
        ("tests/test_health.py::test_receiver_readiness_fails_when_no_aux_slot_is_free",),
    ),
    # -- item 3: an engine call that timed out did not happen, or can be found again -------
    Mutant(
        "issue9-gateway-deadline",
        "the gateway closes a handle for a Wait(close) whose engine had given up (its deadline)",
        (
            Edit(
                "kvxferd/engine/waits.py",
                "if left is not None and left <= 0:  # the engine gave up",
                "if False:  # the engine gave up",
            ),
        ),
        (GATEWAY + "test_a_wait_whose_engine_gave_up_does_not_close_the_handle",),
    ),
    Mutant(
        "issue9-gateway-deadline-on-arrival",
        "the gateway serves a call that arrived after its deadline",
        (
            Edit(
                "kvxferd/engine/calls.py",
                "if deadline and now_ms() >= deadline:",
                "if False:",
            ),
        ),
        (GATEWAY + "test_expired_calls_are_refused_when_decoded",),
    ),
    Mutant(
        "issue9-idempotent-publish",
        "a retried Publish/Fetch with the same key runs again instead of returning the same handle",
        (
            Edit(
                "kvxferd/engine/handles.py",
                "return work if work is not None and work.handle_id in self._handles else None",
                "return None",
            ),
        ),
        (
            GATEWAY + "test_a_recreated_client_finds_its_work_by_key_and_closes_it",
            GATEWAY + "test_publish_retried_while_the_first_is_queued_gets_the_same_handle",
        ),
    ),
    # issue9-idempotent-while-running is gone with issue 12: the gateway calls the service
    # inline, so a key is taken and settled in one step and no retry can see it running.
    Mutant(
        "issue9-lookup",
        "Lookup does not find an open Publish/Fetch by its key",
        (
            Edit(
                "kvxferd/engine/calls.py",
                "found = self.handles.share(rid, self.adapter.key(msg))",
                "found = None",
            ),
        ),
        (GATEWAY + "test_a_recreated_client_finds_its_work_by_key_and_closes_it",),
    ),
    Mutant(
        "issue9-client-deadline",
        "the engine client sends calls without their absolute deadline (deadline_unix_ms 0)",
        (
            Edit(
                "kvxferd/engine/requests.py",
                "return time.time_ns() // 1_000_000 + int(bound_s * 1000)",
                "return 0",
            ),
        ),
        (GATEWAY + "test_publish_queued_past_its_deadline_never_runs",),
    ),
    Mutant(
        "issue9-async-close-fails-calls",
        "AsyncClient.close_client leaves a stopped loop's calls waiting until their own timeout",
        (
            Edit(
                "kvxferd/engine/async_client.py",
                "pending, self.pending = self.pending, {}",
                "pending: dict[int, Any] = {}",
            ),
        ),
        (GATEWAY + "test_async_close_client_fails_a_stopped_loops_calls_when_it_runs_again",),
    ),
    # -- item 4: a sender restart loses no fetch --------------------------------------------
    Mutant(
        "issue9-sender-restart-resend",
        "the receiver does not send open fetches again to a new sender incarnation",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "if stale or (known and known != msg.sender_id):",
                "if False:",
            ),
        ),
        (RXWIRE + "test_a_new_sender_incarnation_gets_every_open_fetch_again",),
    ),
    Mutant(
        "issue9-refused-register-peer-restarted",
        "fetches sent to a sender whose new incarnation refuses the Register do not fail peer_restarted",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "self.sender_restarted(link, stale, resend=msg.ok)",
                "self.sender_restarted(link, stale, resend=True)",
            ),
        ),
        (
            RXWIRE
            + "test_a_new_incarnation_that_refuses_the_register_fails_open_fetches_peer_restarted",
        ),
    ),
    Mutant(
        "issue9-restart-releases-old-fences",
        "fences toward a sender incarnation that is gone stay up after a new one answers",
        (Edit("kvxferd/transfer/receiver/messages.py", "elif f.release():", "elif False:"),),
        (RXWIRE + "test_a_new_sender_incarnation_gets_every_open_fetch_again",),
    ),
    # -- item 5: one bad peer never slows another -------------------------------------------
    Mutant(
        "issue9-worker-lanes",
        "a worker starts no task while any write is in progress (not just its own peer's)",
        (
            Edit(
                "kvxferd/transfer/worker_lanes.py",
                "while lane and not writes.lane_busy(rid):",
                "while lane and not writes.lanes_held():",
            ),
        ),
        (TXRACES + "test_a_write_held_toward_one_peer_never_holds_another_peers_write",),
    ),
    Mutant(
        "issue9-outbox-blocking",
        "workers send Results blocking (up to worker_send_timeout) instead of through the outbox",
        (
            Edit(
                "kvxferd/transfer/worker_outbox.py",
                "sock = connect_dealer(endpoint, self.host.socket_limits, 0, server_key=key)",
                "sock = connect_dealer(\n"
                "                endpoint,\n"
                "                self.host.socket_limits,\n"
                "                self.host.settings.deadlines.worker_send_timeout_ms,\n"
                "                server_key=key,\n"
                "            )",
            ),
            Edit(
                "kvxferd/transfer/worker_outbox.py",
                "if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:",
                "if False:",
            ),
        ),
        (TXRACES + "test_results_to_a_receiver_that_does_not_read_never_delay_another",),
    ),
    Mutant(
        "issue9-publish-sends",
        "publish sends a parked fetch's refusal on the caller's thread",
        (
            Edit(
                "kvxferd/transfer/sender/api.py",
                "self._lane_for(session, p.peer.receiver_id).put(ReplyTask(p.peer, outcome))",
                "self.drain._reply_shared(p.peer, outcome)",
            ),
        ),
        (TXRACES + "test_publish_never_sends_on_the_callers_thread",),
    ),
    # -- item 6: deadlines end to end -------------------------------------------------------
    Mutant(
        "issue9-sender-deadline-unix",
        "the sender ignores a fetch's deadline_unix_ms (budget counted from arrival only)",
        (Edit("kvxferd/transfer/sender/listener.py", "if msg.deadline_unix_ms > 0:", "if False:"),),
        (TXRACES + "test_a_fetch_whose_receiver_deadline_passed_starts_no_write",),
    ),
    Mutant(
        "issue9-parked-fetch-deadline",
        "a fetch parked until publish waits its pending TTL, not the receiver's deadline",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "min(now + ttl, fetch_deadline), fetch_deadline, layers",
                "now + ttl, fetch_deadline, layers",
            ),
        ),
        (TXRACES + "test_a_parked_fetch_keeps_the_receivers_deadline",),
    ),
    Mutant(
        "issue9-receiver-sends-deadline",
        "the receiver leaves RequestData.deadline_unix_ms at 0",
        (
            Edit(
                "kvxferd/transfer/receiver/fetches.py",
                "deadline_unix_ms=max(1, int((time.time() + left_s) * 1000)),",
                "deadline_unix_ms=0,",
            ),
        ),
        (RXWIRE + "test_request_data_carries_the_fetch_deadline_as_unix_ms",),
    ),
    # -- item 7: no leaks -------------------------------------------------------------------
    Mutant(
        "issue9-replaced-peer-removal",
        "a replaced peer's NIXL agent is removed while a write toward it is in flight",
        (
            Edit(
                "kvxferd/transfer/peer_agents.py", "if self._writes.get(name, 0) > 0:", "if False:"
            ),
        ),
        (TXRACES + "test_a_receiver_replaced_at_its_endpoint_loses_its_nixl_peer_after_its_write",),
    ),
    Mutant(
        "issue9-deferred-peer-removal",
        "a removal deferred under a write never runs when the write ends",
        (
            Edit(
                "kvxferd/transfer/peer_agents.py",
                "self._retiring.discard(name)\n        self._remove(name)",
                "self._retiring.discard(name)",
            ),
        ),
        (TXRACES + "test_a_receiver_replaced_at_its_endpoint_loses_its_nixl_peer_after_its_write",),
    ),
    Mutant(
        "issue9-replaced-peer-kept",
        "a receiver replaced at its result endpoint keeps its NIXL agent",
        (
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "            s.agents.retire(old.nixl_name, gone=True)\n",
                "            pass\n",
            ),
        ),
        (TXRACES + "test_a_replaced_idle_receiver_is_removed_at_once",),
    ),
    Mutant(
        "issue9-retired-lists-released",
        "a prepared list retired under a write is never released (retired lists grow)",
        (
            Edit(
                "kvxferd/transfer/dlists.py",
                "retired = self._retired.pop(key, None)",
                "retired = None",
            ),
        ),
        ("tests/test_sender_dataplane.py",),
    ),
    Mutant(
        "issue9-close-race",
        "TxHandle.close() answers from its wait instead of re-reading drained (leaks the session)",
        (
            Edit(
                "kvxferd/transfer/sender/api.py",
                "session.drained_event.wait(timeout)\n        with self._lock:",
                "drained = session.drained_event.wait(timeout)\n        with self._lock:",
            ),
            Edit(
                "kvxferd/transfer/sender/api.py",
                "drained = session.drained\n        if drained:",
                "if drained:",
            ),
        ),
        (TXRACES + "test_close_racing_the_last_write_never_leaks_the_session",),
    ),
    Mutant(
        "issue9-fetch-racing-shutdown",
        "a fetch admitted after the drain began is not refused (admission not atomic with drain)",
        (
            Edit(
                "kvxferd/transfer/receiver/fetches.py",
                "if rx._draining.is_set():\n                refusal = RejectedError(",
                "if False:\n                refusal = RejectedError(",
            ),
        ),
        (RXWIRE + "test_a_fetch_racing_shutdown_is_refused_or_ends",),
    ),
    Mutant(
        "issue9-no-deregister-in-doubt",
        "the receiver's shutdown deregisters memory while an outcome is in doubt",
        (
            Edit(
                "kvxferd/transfer/receiver/shutdown.py",
                "if safe and joined:\n        rx.agents.close()",
                "rx.agents.close()\n    if safe and joined:",
            ),
        ),
        (RXWIRE + "test_shutdown_keeps_memory_registered_while_an_outcome_is_in_doubt",),
    ),
    Mutant(
        "issue9-async-close-client",
        "AsyncClient.close_client leaves open the socket of a loop that stops before closing it",
        (
            Edit(
                "kvxferd/engine/async_client.py",
                "conn.loop.call_soon_threadsafe(conn.shutdown)\n                    handed.append(conn)",
                "conn.loop.call_soon_threadsafe(conn.shutdown)",
            ),
        ),
        (GATEWAY + "test_async_close_client_racing_a_stopping_loop_still_closes_its_socket",),
    ),
    # -- issue 10: operable at 3 a.m. ---------------------------------------------------------
    Mutant(
        "issue10-live-socket-takeover",
        "a second daemon silently takes over a live daemon's engine socket",
        (
            Edit(
                "kvxferd/service/preflight.py",
                'raise ConfigError(f"{name} = {value!r}: a live daemon is serving on this socket")',
                "return",
            ),
        ),
        (
            PREFLIGHT
            + "test_second_daemon_on_a_live_engine_socket_refuses_and_first_stays_reachable",
        ),
    ),
    Mutant(
        "issue10-port-in-use",
        "a port in use is found only by the slow set-up (exit 1, a traceback)",
        (Edit("kvxferd/service/preflight.py", "            s.bind(addr)\n", "            pass\n"),),
        (PREFLIGHT + "test_probe_port_in_use_exits_2",),
    ),
    Mutant(
        "issue10-dev-shm-size",
        "a pool larger than /dev/shm starts anyway (the engine later dies of SIGBUS)",
        (Edit("kvxferd/service/preflight.py", "if need > free:", "if False:"),),
        (PREFLIGHT + "test_pool_larger_than_dev_shm_exits_2",),
    ),
    Mutant(
        "issue10-failed-request-silent",
        "a failed request logs only at DEBUG: nothing answers what happened to it",
        (
            Edit(
                "kvxferd/transfer/journal.py",
                'level = logging.WARNING if not e.ok and e.kind != "slice" else logging.DEBUG',
                "level = logging.DEBUG",
            ),
        ),
        (JOURNAL + "test_each_failed_request_logs_one_warning_line_with_its_fields",),
    ),
    Mutant(
        "issue10-stall-logged-late",
        "a stalled write is not logged at WARNING when it stalls",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "jlog.warning(  # when it stalls",
                "jlog.debug(  # when it stalls",
            ),
        ),
        (JOURNAL + "test_a_stalled_write_logs_when_it_stalls_not_only_when_it_ends",),
    ),
    Mutant(
        "issue10-peer-label-budget",
        "one peer more than the label budget gets its own label (series grow with peers)",
        (Edit("kvxferd/transfer/journal.py", "< self.peer_labels", "<= self.peer_labels"),),
        (JOURNAL + "test_peers_past_the_label_budget_share_one_label",),
    ),
    Mutant(
        "issue10-drain-skips-unfetched",
        "a sender's drain waits only for attached writes, not for requests published and unfetched",
        (
            Edit(
                "kvxferd/transfer/sender/drain.py",
                "not x.ended\n                    or any(sl.state",
                "any(sl.state",
            ),
        ),
        (DRAIN + "test_requests_the_drain_drops_end_shutting_down_are_counted_and_exit_3",),
    ),
    Mutant(
        "issue10-engine-close-in-drain-is-cancelled",
        "an engine's close during the drain ends its request as cancelled by the engine",
        (
            Edit(
                "kvxferd/transfer/sender/drain.py",
                "if self._s._draining.is_set():\n            # An engine lets go",
                "if False:\n            # An engine lets go",
            ),
        ),
        (DRAIN + "test_requests_the_drain_drops_end_shutting_down_are_counted_and_exit_3",),
    ),
    Mutant(
        "issue10-receiver-drain-says-cancelled",
        "a receiver's drain deadline ends open fetches as cancelled by the engine",
        (
            Edit(
                "kvxferd/transfer/receiver/core.py",
                'fetches.drain_end(rx, "still open at the drain deadline (drain_timeout_ms)")',
                'fetches.cancel(rx, RxState.CANCELLED, Reason.CANCELLED, "cancelled by the engine")',
            ),
        ),
        (
            DRAIN
            + "test_a_receiver_fetch_open_at_the_drain_deadline_ends_shutting_down_and_exits_3",
        ),
    ),
    Mutant(
        "issue10-stuck-from-last-ending",
        "stuck is judged from the last ending alone: an idle daemon's first request is stuck at once",
        (
            Edit(
                "kvxferd/service/probes.py",
                "quiet = now - max(journal.last_ending, oldest)",
                "quiet = now - journal.last_ending",
            ),
        ),
        (
            READINESS
            + "test_a_write_that_never_ends_makes_both_sides_stuck_after_stuck_after_ms_only",
        ),
    ),
    Mutant(
        "issue10-stuck-never-reported",
        "readiness stays 200 while pending work sees nothing end",
        (
            Edit(
                "kvxferd/service/probes.py",
                "if quiet * 1000 >= health.stuck_after_ms:",
                "if False:",
            ),
        ),
        (
            READINESS
            + "test_a_write_that_never_ends_makes_both_sides_stuck_after_stuck_after_ms_only",
        ),
    ),
    Mutant(
        "issue10-peer-failing-ignored",
        "a peer whose failures reach the ratio leaves readiness at 200",
        (
            Edit(
                "kvxferd/service/probes.py",
                "if rate.total >= health.peer_failure_min and rate.ratio >= health.peer_failure_ratio:",
                "if False:",
            ),
        ),
        (READINESS + "test_a_peer_whose_failures_reach_the_ratio_fails_readiness_naming_it",),
    ),
    Mutant(
        "issue10-cancels-blame-the-peer",
        "cancels and our own shutdown count as the peer's failures",
        (
            Edit(
                "kvxferd/transfer/journal.py",
                "window.append((now, e.ok or e.reason in NOT_PEER_FAULTS))",
                "window.append((now, e.ok))",
            ),
        ),
        (READINESS + "test_cancels_and_our_own_shutdown_never_count_as_a_peers_failures",),
    ),
    Mutant(
        "issue10-sender-aux-unchecked",
        "a sender with no free aux slot stays ready",
        (
            Edit(
                "kvxferd/service/probes.py",
                "if view.aux_free == 0:  # every publish with aux would be refused busy",
                "if False:",
            ),
        ),
        (READINESS + "test_sender_readiness_fails_when_its_aux_slots_run_out",),
    ),
    Mutant(
        "issue10-killed-daemons-pool-kept",
        "a pool segment a killed daemon left stays in /dev/shm (each restart needs room for one more)",
        (Edit("kvxferd/service/preflight.py", "        os.unlink(path)\n", "        pass\n"),),
        (PREFLIGHT + "test_a_killed_daemons_pool_segment_is_removed_by_its_successor",),
    ),
    Mutant(
        "issue13-write-to-gone-incarnation",
        "a write toward a receiver incarnation replaced at its endpoint still starts",
        (
            Edit(
                "kvxferd/transfer/peer_agents.py",
                "            if name in self._gone:\n                return False\n",
                "",
            ),
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "                session.fail_slice(sl, Reason.PEER_RESTARTED, detail)\n"
                "                session.fail(Reason.PEER_RESTARTED, detail)\n",
                "                pass\n",
            ),
        ),
        (
            INCARNATIONS
            + "test_a_replaced_receivers_queued_fetch_is_never_written_and_ends_peer_restarted",
        ),
    ),
    Mutant(
        "issue13-parked-of-gone-incarnation-kept",
        "a replaced receiver's parked fetches stay and attach when the request is published",
        (
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "            s.parked.drop_receiver(old.receiver_id)\n",
                "",
            ),
        ),
        (INCARNATIONS + "test_a_replaced_receivers_parked_fetch_is_dropped",),
    ),
    Mutant(
        "issue13-no-invalidation",
        "a NIXL write error toward a peer leaves its registration (no fresh handshake)",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "            host.peer_failed(w.task.peer, detail)\n",
                "            pass\n",
            ),
        ),
        (INCARNATIONS + "test_a_nixl_write_error_forces_a_fresh_registration",),
    ),
    Mutant(
        "issue13-deferred-removal-not-cancelled",
        "a deferred NIXL removal runs after the same receiver registered again",
        (
            Edit(
                "kvxferd/transfer/peer_agents.py",
                '                self._retiring.discard(name)\n                self.stats.add("peer_removals_cancelled")\n',
                "                pass\n",
            ),
        ),
        (INCARNATIONS + "test_registering_again_during_a_deferred_removal_keeps_the_new_agent",),
    ),
    Mutant(
        "issue13-discovered-sender-not-dialled",
        "a receiver ignores the senders discovery reports until a fetch names one",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "                    self.open(peer.endpoint)\n",
                "                    pass\n",
            ),
        ),
        (
            DISCOVERY_DAEMONS
            + "test_daemons_advertise_on_leases_and_the_receiver_dials_what_it_discovers",
        ),
    ),
    Mutant(
        "issue13-lost-lease-still-ready",
        "a daemon whose etcd lease is lost stays ready",
        (
            Edit(
                "kvxferd/service/probes.py",
                "    if registrar is None or registrar.registered:",
                "    if True:",
            ),
        ),
        (DISCOVERY_DAEMONS + "test_a_lost_lease_turns_readiness_red_until_etcd_is_back",),
    ),
    Mutant(
        "issue14-deep-nesting-escapes",
        "a frame nested past the decoder's recursion limit raises RecursionError, not malformed",
        (
            Edit(
                "kvxferd/transfer/protocol.py",
                "    except RecursionError:  # a tagged union skips fields before the tag",
                "    except ZeroDivisionError:  # a tagged union skips fields before the tag",
            ),
        ),
        (FUZZ + "test_every_message_was_sent_and_answered_within_the_budget",),
    ),
    Mutant(
        "issue14-stray-register-reply-uncounted",
        "a RegisterReply sent to a receiver's result socket is dropped without a count",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                '                rx.stats.add(f"rejected_{Reason.UNKNOWN_MESSAGE}")',
                "                pass",
            ),
        ),
        (FUZZ + "test_every_message_that_reached_a_daemon_is_counted_exactly",),
    ),
    Mutant(
        "issue13-posted-behind-a-stalled-write",
        "a post toward a receiver whose write is stalled goes on the stalled connection",
        (
            Edit(
                "kvxferd/transfer/path_moves.py",
                '            raise PathStalled(f"a write to {peer} is stalled on its connection (path {path.index})")',
                "            pass",
            ),
        ),
        (
            "tests/test_dataplane_reconnect.py::"
            "test_a_peer_whose_write_stalls_is_moved_to_a_fresh_connection",
        ),
    ),
    Mutant(
        "issue14-revoked-key-keeps-its-connection",
        "a key removed from the allow-list keeps talking on the connection ZAP admitted",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "        if identity and not self._s.transport.admits(identity):",
                "        if False:",
            ),
        ),
        (
            "tests/test_auth.py::TestRefusedAndCounted::"
            "test_a_key_removed_from_the_allow_list_is_refused_on_its_open_connection",
        ),
    ),
    Mutant(
        "issue14-revoked-sender-still-heard",
        "a sender key the receiver removed from its allow-list still makes fetches done",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "            if sock is rx._router and identity and not rx.transport.admits(identity):",
                "            if False:",
            ),
        ),
        (
            "tests/test_auth.py::TestRefusedAndCounted::"
            "test_a_sender_key_removed_from_the_receivers_allow_list_makes_no_fetch_done[result]",
        ),
    ),
    # -- issue 22: a fetch done by the notification its sender's WRITE carried ---------------
    Mutant(
        "issue22-notification-nonce",
        "a notification without the fetch's nonce completes it",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "and hmac.compare_digest(nonce, f.nonce)",
                "and True",
            ),
        ),
        (
            "tests/test_notifications.py::"
            "test_a_notification_with_another_nonce_or_from_another_agent_completes_nothing",
        ),
    ),
    Mutant(
        "issue22-notification-agent",
        "a notification from a NIXL agent other than the fetch's sender completes it",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                'and (agent == sender or agent.startswith(sender + ".p"))',
                "and True",
            ),
        ),
        (
            "tests/test_notifications.py::"
            "test_a_notification_with_another_nonce_or_from_another_agent_completes_nothing",
        ),
    ),
    Mutant(
        "issue22-notification-revoked-key",
        "a sender key removed from the allow-list still completes fetches by notification",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "if f.sender_key and not self.rx.transport.admits(f.sender_key):",
                "if False:",
            ),
        ),
        (
            "tests/test_auth.py::TestRefusedAndCounted::"
            "test_a_sender_key_removed_from_the_receivers_allow_list_makes_no_fetch_done[notified]",
        ),
    ),
    Mutant(
        "issue22-oversized-drops-earlier-frames",
        "frames read before an oversized length prefix are dropped with the connection",
        (
            Edit(
                "kvxferd/engine/channel.py",
                '                self.error = f"a frame of {n} bytes is over the bound of {self._max}"\n'
                "                buf.clear()\n"
                "                return frames",
                '                self.error = f"a frame of {n} bytes is over the bound of {self._max}"\n'
                "                buf.clear()\n"
                "                return []",
            ),
        ),
        (
            GATEWAY
            + "test_frames_before_a_length_over_the_bound_are_answered_then_the_connection_closes",
        ),
    ),
    # -- issue 23: routes belong to keys; revocation ends the fetch ---------------------------
    Mutant(
        "issue23-route-handover",
        "a connection presenting another peer's routing id takes that peer's route",
        (
            Edit(
                "kvxferd/transfer/control.py",
                "    sock.setsockopt(zmq.ROUTER_HANDOVER, 0)",
                "    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)",
            ),
        ),
        (
            "tests/test_routes.py::test_another_key_presenting_the_victims_route_never_takes_it",
            "tests/test_authz.py::test_a_route_taken_over_by_another_key_cannot_cancel_or_fetch",
        ),
    ),
    Mutant(
        "issue23-routing-ids-unseeded",
        "libzmq's generated routing ids start from an unseeded rand(): a client can collide",
        (
            Edit(
                "kvxferd/transfer/control.py",
                "                seed_routing_ids()  # before the first ROUTER of this process",
                "                pass",
            ),
        ),
        (
            "tests/test_routes.py::"
            "test_a_client_cannot_abort_the_daemon_with_the_routing_id_libzmq_generates_next",
        ),
    ),
    Mutant(
        "issue23-refusal-dumps",
        "a configuration refusal is a multi-line dump again",
        (
            Edit(
                "kvxferd/config.py",
                """    return f"invalid {cls.__name__}: " + "; ".join(parts)""",
                """    return f"invalid {cls.__name__}:\\n  " + "\\n  ".join(parts)""",
            ),
        ),
        ("tests/test_refusals.py::test_a_refusal_is_one_line_exit_2_no_traceback",),
    ),
    Mutant(
        "issue23-ipc-missing-directory",
        "an ipc listen in a missing directory reaches ZMQ's bind (a traceback) again",
        (
            Edit(
                "kvxferd/service/preflight.py",
                """    if existing != parent and name != "service.engine_socket":""",
                """    if False:""",
            ),
        ),
        (
            "tests/test_refusals.py::test_a_refusal_is_one_line_exit_2_no_traceback"
            "[ipc-listen-in-a-missing-directory]",
        ),
    ),
    Mutant(
        "issue23-flag-refusal-usage-dump",
        "a bad command-line flag prints argparse's usage and error (two lines) again",
        (
            Edit(
                "kvxferd/cli.py",
                """        self.exit(EXIT_CONFIG, f"kvxferd: {where}{message}; see `{self.prog} --help`\\n")""",
                """        super().error(message)""",
            ),
        ),
        (
            "tests/test_refusals.py::test_a_refusal_is_one_line_exit_2_no_traceback"
            "[threads-flag-not-a-number]",
        ),
    ),
    Mutant(
        "issue23-result-router-any-key",
        "the sender dials a result endpoint expecting some other key than the Register's",
        (
            Edit(
                "kvxferd/transfer/worker_outbox.py",
                "        self._server_keys[endpoint] = peer.identity  # its result ROUTER presents",
                "        self._server_keys[endpoint] = 'x' * 40  # its result ROUTER presents",
            ),
        ),
        (
            "tests/test_protocol_conformance.py::"
            "test_with_curve_a_result_reaches_only_a_curve_result_router_with_the_register_key",
        ),
    ),
    Mutant(
        "issue23-one-pool-name-per-socket",
        "daemons of one engine socket string derive one segment name and remove it at start",
        (
            Edit(
                "kvxferd/transfer/pool.py",
                '''    return f"{daemon_shm_prefix(role, engine_socket)}-{os.getpid()}-{secrets.token_hex(4)}"''',
                "    return daemon_shm_prefix(role, engine_socket)",
            ),
            Edit(
                "kvxferd/service/preflight.py",
                "        if holder_alive(path):\n            continue  # a live daemon's pool",
                "        if False:\n            continue  # a live daemon's pool",
            ),
        ),
        ("tests/test_auth.py::test_two_daemons_on_one_engine_socket_string_keep_their_own_pools",),
    ),
    Mutant(
        "issue23-receiver-routing-id",
        "kvxferd's receiver presents its receiver id as its routing id again",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "            # A name of our own: pyzmq's default (the socket's fd) can repeat",
                "            dealer.disconnect(endpoint)\n"
                "            dealer.setsockopt(zmq.IDENTITY, rx.receiver_id.encode())\n"
                "            dealer.connect(endpoint)\n"
                "            # A name of our own: pyzmq's default (the socket's fd) can repeat",
            ),
        ),
        (
            "tests/test_routes.py::"
            "test_a_key_squatting_the_receiver_id_does_not_lock_the_receiver_out",
            "tests/test_routes.py::"
            "test_a_receiver_reconnecting_after_a_blip_takes_over_its_own_registration",
        ),
    ),
    Mutant(
        "issue23-revocation-untold",
        "a registered peer whose key left the allow-list is not told; its fetches wait",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "            self._tell_revoked()",
                "            pass",
            ),
        ),
        (
            "tests/test_revocation.py::"
            "test_revoking_the_receivers_key_ends_its_open_fetch_within_a_second",
            "tests/test_revocation.py::"
            "test_a_sender_daemon_told_by_sighup_ends_the_receivers_open_fetch",
        ),
    ),
    Mutant(
        "issue23-key-refused-only-counted",
        "the receiver only counts a Reject{not_authorized}; its fetches run to their deadline",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "                self.key_refused(link, msg.detail)",
                "                pass",
            ),
        ),
        (
            "tests/test_revocation.py::"
            "test_revoking_the_receivers_key_ends_its_open_fetch_within_a_second",
        ),
    ),
    Mutant(
        "issue23-revoked-fetch-unnamed",
        "a revoked key's RequestData gets a Reject that names no fetch",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "            if isinstance(msg, wire.RequestData):\n"
                "                self._refuse_fetch(routing_id, None, msg, Reason.NOT_AUTHORIZED, detail)",
                "            if False:\n                pass",
            ),
        ),
        (
            "tests/test_revocation.py::"
            "test_a_revoked_keys_messages_are_answered_naming_what_they_answer",
        ),
    ),
    Mutant(
        "issue23-revoked-cancel-refused",
        "a revoked key's Cancel is refused, so no CancelAck releases its receiver's blocks",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "            if isinstance(msg, wire.Cancel):\n"
                "                self._handle_one(routing_id, frame, identity, max_bytes)",
                "            if False:\n                pass",
            ),
        ),
        (
            "tests/test_revocation.py::"
            "test_revoking_the_receivers_key_ends_its_open_fetch_within_a_second",
            "tests/test_revocation.py::"
            "test_a_revoked_keys_messages_are_answered_naming_what_they_answer",
        ),
    ),
    Mutant(
        "issue23-revoked-parked-attaches",
        "a fetch parked before its key was removed is attached and written at publish",
        (
            Edit(
                "kvxferd/transfer/sender/published.py",
                "        if peer.identity != ANONYMOUS and not self._transport.admits(peer.identity):",
                "        if False:",
            ),
        ),
        (
            "tests/test_revocation.py::"
            "test_a_parked_fetch_of_a_revoked_key_is_told_and_never_attaches",
        ),
    ),
    Mutant(
        "issue23-configured-pool-name-taken-over",
        "a daemon given the pool.shm_name of a live daemon removes that daemon's segment",
        (
            Edit(
                "kvxferd/service/preflight.py",
                "        if holder_alive(path):\n            raise ConfigError(",
                "        if False:\n            raise ConfigError(",
            ),
        ),
        (
            "tests/test_pool_instances.py::"
            "test_start_up_refuses_a_configured_name_held_and_removes_one_left",
        ),
    ),
    Mutant(
        "issue23-dead-peer-waited-out",
        "a link lost and not back is never declared down: its fetches wait for their deadline",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "            if not link.down and link.lost_since is not None and now - link.lost_since >= down_s:",
                "            if False:",
            ),
        ),
        (
            "tests/test_dead_peer.py::test_a_killed_sender_ends_every_fetch_within_2s_and_is_not_redialled",
        ),
    ),
    Mutant(
        "issue23-down-link-sends",
        "a fetch toward a down link is queued (and sent once it returns) instead of failing at once",
        (
            Edit(
                "kvxferd/transfer/receiver/fetches.py",
                "        elif link.down:  # nothing is sent that could put its blocks in doubt",
                "        elif False:",
            ),
        ),
        (
            "tests/test_dead_peer.py::"
            "test_a_fetch_toward_a_down_link_fails_at_once_and_another_sender_keeps_serving",
        ),
    ),
    Mutant(
        "issue23-redial-no-backoff",
        "a lost link is redialled every 100 ms (libzmq's default), without a backoff",
        (
            Edit(
                "kvxferd/transfer/control.py",
                "        sock.setsockopt(zmq.RECONNECT_IVL_MAX, limits.reconnect_max_ms)",
                "        pass",
            ),
        ),
        ("tests/test_dead_peer.py::test_a_killed_senders_link_is_redialled_with_a_backoff",),
    ),
    Mutant(
        "issue23-doubt-waits-backoff-after-heal",
        "a link back after an outage re-asks about its doubt only when the backoff says",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                "        rx.doubts.ask_again_now(link.endpoint)\n",
                "",
            ),
        ),
        (
            "tests/test_doubt_end.py::"
            "test_a_link_back_after_a_freeze_ends_the_doubt_within_3s_and_returns_the_memory",
        ),
    ),
    Mutant(
        "issue23-removed-peer-redialled",
        "a sender discovery removed keeps its link: libzmq redials the dead port",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "        self.link_down(link, detail)\n        self.close(link)",
                "        self.link_down(link, detail)",
            ),
        ),
        (
            "tests/test_dead_peer.py::test_a_killed_sender_ends_every_fetch_within_2s_and_is_not_redialled",
        ),
    ),
    Mutant(
        "issue23-teardown-keeps-agent",
        "a link's NIXL agent handed to tear down is never destroyed: writes to it still land",
        (
            Edit(
                "kvxferd/transfer/link_agents.py",
                "        nixl, agent.agent = agent.agent, None",
                "        nixl, agent.agent = None, agent.agent",
            ),
        ),
        ("tests/test_link_agents.py::test_a_torn_down_link_agent_takes_no_write",),
    ),
    Mutant(
        "issue23-down-link-not-torn-down",
        "a link that goes down keeps its NIXL agent: its fetches stay in doubt while it is down",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "        # (InDoubt.agent_torn) ends its doubts.\n        self.tear_down(link)\n",
                "",
            ),
        ),
        (
            "tests/test_dead_peer.py::test_a_killed_sender_ends_every_fetch_within_2s_and_is_not_redialled",
        ),
    ),
    Mutant(
        "issue23-stale-register-makes-ready",
        "a RegisterReply to a Register whose agent was torn down since makes the link ready",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                '            rx.stats.add("registers_stale_agent")\n            rx.links.register(link)\n            return\n',
                "            pass\n",
            ),
        ),
        (
            "tests/test_dead_peer.py::"
            "test_a_fetch_toward_a_down_link_fails_at_once_and_another_sender_keeps_serving",
        ),
    ),
    Mutant(
        "issue23-new-agent-old-kept",
        "a receiver registering a new NIXL agent leaves its old one live at the sender",
        (
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "                    s.agents.retire(old.nixl_name, True)\n",
                "                    pass\n",
            ),
        ),
        (
            "tests/test_teardown.py::"
            "test_a_frozen_senders_late_write_never_lands_in_blocks_released_by_the_teardown",
        ),
    ),
    Mutant(
        "issue24-parked-count-out-of-step",
        "a fetch leaving the parked table keeps its identity's parked count (max_parked leaks)",
        (
            Edit(
                "kvxferd/transfer/sender/parked.py",
                '            self._ownership.count(p.peer.receiver_id, "parked", -1)\n',
                "            pass\n",
            ),
        ),
        ("tests/test_parked.py::test_every_transition_keeps_the_counts_in_step",),
    ),
    Mutant(
        "issue24-register-load-under-the-lock",
        "the data plane connects to a registering peer with its lock held (every write waits)",
        (
            Edit(
                "kvxferd/transfer/dataplane.py",
                "        peer = self._connects.probe(metadata)\n        with self._lock:\n",
                "        with self._lock:\n            peer = self._connects.probe(metadata)\n",
            ),
        ),
        (
            "tests/test_dataplane_lock.py::"
            "test_an_unreachable_register_never_delays_another_receivers_writes",
        ),
    ),
    Mutant(
        "issue24-register-connect-on-the-writers-agent",
        "the data plane connects to a registering peer from path 0's agent, whose NIXL lock"
        " every write needs, instead of a probe agent",
        (
            Edit(
                "kvxferd/transfer/dataplane.py",
                "        self._connects = PeerConnects(name, self._new_agent)",
                "        self._connects = PeerConnects(name, lambda _name: self._agent)",
            ),
        ),
        (
            "tests/test_dataplane_lock.py::"
            "test_an_unreachable_register_never_delays_another_receivers_writes",
        ),
    ),
    Mutant(
        "issue24-connect-on-the-callers-thread",
        "add_peer_async runs the connect on the caller's thread (a REGISTER toward a silent"
        " peer holds the caller for the whole TCP connect)",
        (
            Edit(
                "kvxferd/transfer/peer_connects.py",
                "        thread.start()\n",
                "        thread.run()\n",
            ),
        ),
        (
            "tests/test_dataplane_lock.py::"
            "test_a_connect_toward_a_silent_peer_leaves_the_caller_and_other_peers_free",
        ),
    ),
    Mutant(
        "issue24-closed-data-plane-unseen",
        "the probes read a closed NixlDataPlane's private flag, which the split moved into its"
        " peer table (a closed data plane reads as open)",
        (
            Edit(
                "kvxferd/transfer/views.py",
                '    return bool(getattr(dataplane, "closed", False))',
                '    return bool(getattr(dataplane, "_closed", False))',
            ),
        ),
        ("tests/test_dataplane.py::test_a_closed_data_plane_says_so_to_the_probes",),
    ),
    Mutant(
        "issue24-io-thread-leaves-tasks",
        "the vLLM io thread stops its loop with tasks pending and never closes it: the garbage"
        " collector destroys them later, inside whatever runs then",
        (
            Edit(
                "kvxferd/integrations/vllm/io_thread.py",
                'threading.Thread(target=self._run, name="kvxferd-vllm-io"',
                'threading.Thread(target=self.loop.run_forever, name="kvxferd-vllm-io"',
            ),
        ),
        (
            "tests/test_vllm_io_thread.py::"
            "test_shutdown_cancels_the_tasks_still_pending_and_closes_the_loop",
        ),
    ),
    Mutant(
        "engine-client-waits-in-select",
        "the engine client waits for its reply with select(): in an engine holding more than"
        " 1024 descriptors every call fails with ValueError",
        (
            Edit(
                "kvxferd/engine/channel.py",
                "    p = select.poll()\n    p.register(fd, select.POLLOUT if writable else select.POLLIN)\n"
                "    return bool(p.poll(max(0.0, timeout_s) * 1000.0))\n",
                "    r, w, _ = select.select([] if writable else [fd], [fd] if writable else [], [],"
                " max(0.0, timeout_s))\n    return bool(r or w)\n",
            ),
        ),
        (
            "tests/test_gateway.py::"
            "test_calls_work_from_a_process_holding_more_than_1024_descriptors",
        ),
    ),
    Mutant(
        "issue24-register-again-probed",
        "a Register sent again with the metadata of a peer already loaded is probed: toward an"
        " agent its receiver tore down since, the probe fails and the link is refused for good"
        " instead of told to register again",
        (
            Edit(
                "kvxferd/transfer/dataplane.py",
                "            return next((p for p, m in self._peers.meta.items() if m == metadata), None)",
                "            return None",
            ),
        ),
        (
            "tests/test_teardown.py::"
            "test_a_frozen_senders_late_write_never_lands_in_blocks_released_by_the_teardown",
        ),
    ),
    Mutant(
        "issue25-pacing-stuck-at-zero",
        "the receiver's notification waits double from 0 after a spin: a fetch that waits"
        " past the spin window (parked at its sender) keeps the io thread spinning a core",
        (
            Edit(
                "kvxferd/transfer/receiver/core.py",
                "        self.wait_s = min(max(self.wait_s, _NOTIF_WAIT_MIN_S) * 2, cap)",
                "        self.wait_s = min(self.wait_s * 2, cap)",
            ),
        ),
        (
            "tests/test_notification_pacing.py::test_waits_grow_again_after_the_spin_window",
            "tests/test_notification_pacing.py::"
            "test_a_fetch_parked_at_its_sender_does_not_spin_the_receiver",
        ),
    ),
    Mutant(
        "issue25-stream-digest-last-range-only",
        "a streamed slice's digest covers only its last layer range: every intact streamed"
        " fetch that asked for a digest fails digest_mismatch",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "        layers, ranges = (sl.layer_begin, sl.layer_end), None",
                "        layers, ranges = (sl.layer_end - 1 if s.streamed else sl.layer_begin,"
                " sl.layer_end), None",
            ),
        ),
        (
            "tests/test_digest.py::TestFetchDigest::"
            "test_a_streamed_publish_is_digested_over_every_layer[intact]",
        ),
    ),
    Mutant(
        "issue25-stream-done-before-last-layer",
        "a streamed fetch's first range is taken for the whole fetch: its slice is reported"
        " done (Result) after one layer, with the others missing",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                '            if ok and w.kind == "kv" and s.streamed and sl.next_layer < sl.layer_end:',
                "            if False:",
            ),
        ),
        (
            STREAM + "test_a_parked_fetch_is_written_layer_by_layer_and_done_only_after_the_last",
            STREAM + "test_a_streams_writes_go_one_range_at_a_time_in_layer_order",
        ),
    ),
    Mutant(
        "issue25-stream-notifies-before-last-layer",
        "every range of a stream carries the done notification: the receiver completes the"
        " fetch when the first layer lands",
        (
            Edit(
                "kvxferd/transfer/worker_writes.py",
                "                le >= sl.layer_end and not (s.aux_len > 0 and sl.aux_slot >= 0)",
                "                not (s.aux_len > 0 and sl.aux_slot >= 0)",
            ),
        ),
        (STREAM + "test_a_streams_writes_go_one_range_at_a_time_in_layer_order",),
    ),
    Mutant(
        "issue25-stream-holds-its-lane",
        "a stream waiting for its next layer keeps its task at the head of its receiver's lane:"
        " other requests to that receiver wait for the whole stream",
        (
            Edit(
                "kvxferd/transfer/worker_lanes.py",
                "                    if writes.session_busy(task.session.session_id):\n",
                "                    if writes.session_busy(task.session.session_id) or (\n"
                "                        task.session.streaming\n"
                "                        and task.session.layers_ready <= task.slice.next_layer\n"
                "                    ):\n",
            ),
        ),
        (STREAM + "test_another_request_to_the_same_receiver_is_written_while_a_stream_waits",),
    ),
    Mutant(
        "issue25-stream-abort-waits-for-timeout",
        "a stream that ends before its last layer tells none of its fetches: each waits for"
        " its own timeout instead of failing at once",
        (
            Edit(
                "kvxferd/transfer/sender/streams.py",
                "        self._kick(stream.readers)\n",
                "        pass\n",
            ),
        ),
        (
            STREAM + "test_cancel_mid_stream_fails_the_fetch_at_once_and_writes_nothing_after",
            STREAM + "test_an_engine_connection_closed_mid_stream_fails_the_fetch_at_once",
            STREAM + "test_a_stream_with_no_mark_for_the_stall_bound_fails_and_its_fetch_at_once",
        ),
    ),
    Mutant(
        "issue25-stream-rewrites-written-layers",
        "each range of a stream is written from the fetch's first layer, not from the first"
        " layer not yet written",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "        lb, le = sl.next_layer, min(sl.layer_end, base + s.layers_ready)",
                "        lb, le = sl.layer_begin, min(sl.layer_end, base + s.layers_ready)",
            ),
        ),
        (STREAM + "test_a_streams_writes_go_one_range_at_a_time_in_layer_order",),
    ),
    Mutant(
        "issue25-stream-result-overtakes-its-write",
        "the task that refuses an ended stream's fetch starts while a range of that fetch is"
        " still in flight: its failed Result goes out while the WRITE may still land",
        (
            Edit(
                "kvxferd/transfer/worker_lanes.py",
                "            while lane and not writes.lane_busy(rid):\n",
                "            while lane and (\n"
                "                not writes.lane_busy(rid)\n"
                "                or (isinstance(lane[0], WriteTask) and lane[0].session.ended)\n"
                "            ):\n",
            ),
            Edit(
                "kvxferd/transfer/worker_lanes.py",
                "                    if writes.session_busy(task.session.session_id):\n",
                "                    if writes.session_busy(task.session.session_id) and not (\n"
                "                        task.session.ended\n"
                "                    ):\n",
            ),
        ),
        (
            STREAM
            + "test_a_stream_cancelled_with_a_range_in_flight_fails_its_fetch_when_that_write_ends",
        ),
    ),
    Mutant(
        "issue25-connection-close-leaves-stream",
        "the gateway does nothing when an engine's connection closes: its open stream runs"
        " until the stall bound",
        (
            Edit(
                "kvxferd/engine/gateway.py",
                "        self.calls.orphaned(conn.rid, set(self._conns))",
                "        pass",
            ),
        ),
        (STREAM + "test_an_engine_connection_closed_mid_stream_fails_the_fetch_at_once",),
    ),
    Mutant(
        "issue25-decode-first-fresh-transfer-id",
        "a decode-first prefill publishes under a transfer id and token of its own, not the"
        " router's: the decode side's parked fetch never finds it",
        (
            Edit(
                "kvxferd/integrations/vllm/scheduler.py",
                "tid, token = chosen if chosen else (transfer_id(rid), secrets.token_urlsafe(16))",
                "tid, token = (transfer_id(rid), secrets.token_urlsafe(16))",
            ),
        ),
        (
            "tests/test_vllm_decode_first.py::"
            "test_decode_first_prefill_publishes_under_the_routers_id_and_token",
        ),
    ),
    Mutant(
        "issue25-router-token-unchecked",
        "a router-chosen fetch token is taken unchecked: a malformed one reaches the daemon"
        " (refused there, logged as a save failure) instead of being refused with its reason",
        (
            Edit(
                "kvxferd/integrations/vllm/metadata.py",
                '_TOKEN = re.compile(rf"^[A-Za-z0-9_-]{{{MIN_TOKEN_CHARS},128}}$")',
                '_TOKEN = re.compile(r"^.*$")',
            ),
        ),
        (
            "tests/test_vllm_decode_first.py::test_a_malformed_router_transfer_is_refused_not_replaced",
        ),
    ),
    Mutant(
        "issue25-receipt-loaded-if-one-rank-loaded",
        "ranks' receipts merged with or: a request one rank failed to load reads as loaded",
        (
            Edit(
                "kvxferd/integrations/vllm/metadata.py",
                "        loaded = self.loaded and other.loaded\n",
                "        loaded = self.loaded or other.loaded\n",
            ),
        ),
        (
            "tests/test_vllm_decode_first.py::"
            "test_a_failed_load_is_receipted_recomputed_with_its_reason",
        ),
    ),
    Mutant(
        "issue25-receipt-kept-for-finished-request",
        "receipts of requests already finished (failed under policy fail) are kept for ever",
        (
            Edit(
                "kvxferd/integrations/vllm/scheduler.py",
                "            if rid not in self._loading:\n                continue",
                "            if False:\n                continue",
            ),
        ),
        ("tests/test_vllm_decode_first.py::test_a_receipt_for_a_finished_request_is_not_kept",),
    ),
    Mutant(
        "issue25-digest-mismatch-ignored",
        "the receiver applies a checked fetch's done Result whatever its digest check found: a"
        " corrupted block is reported done",
        (
            Edit(
                "kvxferd/transfer/receiver/digests.py",
                "if ours is not None and c.theirs and hmac.compare_digest(ours, c.theirs):",
                "if True:",
            ),
        ),
        (
            "tests/test_digest.py::TestFetchDigest::"
            "test_one_byte_flipped_after_the_write_fails_the_fetch",
            "tests/test_digest.py::TestFetchDigest::"
            "test_two_destination_blocks_exchanged_fail_the_fetch",
            "tests/test_digest.py::test_each_piece_of_an_instance_fetch_is_checked",
            "tests/test_gateway.py::test_a_digest_mismatch_reaches_the_engine_as_a_failed_load",
        ),
    ),
    Mutant(
        "issue25-digest-not-positional",
        "the digest weighs every word alike (a plain sum): blocks exchanged or in another slot"
        " keep the digest",
        (
            Edit(
                "kvxferd/transfer/digest.py",
                "a = (ra * (x * wa).sum(1)).sum()",
                "a = x.sum(1).sum()",
            ),
            Edit(
                "kvxferd/transfer/digest.py",
                "b = (rb * (x * wb).sum(1)).sum()",
                "b = x.astype(np.int64).sum()",
            ),
        ),
        (
            "tests/test_digest.py::test_moved_content_changes_the_digest",
            "tests/test_digest.py::TestFetchDigest::"
            "test_two_destination_blocks_exchanged_fail_the_fetch",
        ),
    ),
    Mutant(
        "issue25-digest-after-completion",
        "the sender takes its digest after marking the slice written: an engine that reuses"
        " its source blocks once the request completes makes a good transfer mismatch",
        (
            Edit(
                "kvxferd/transfer/worker.py",
                "                if sl.digest:  # before the request completes: its engine may then"
                " reuse them\n                    sl.written_digest = self._digest(task)\n"
                "                s.slice_written(sl)\n",
                "                s.slice_written(sl)\n                if sl.digest:\n"
                "                    sl.written_digest = self._digest(task)\n",
            ),
        ),
        (
            "tests/test_digest.py::TestFetchDigest::"
            "test_source_blocks_reused_at_completion_do_not_fail_the_check",
        ),
    ),
    Mutant(
        "issue25-digest-pieces-unchecked",
        "the pieces of an instance fetch do not ask for the digest the fetch asked for: a"
        " corrupted piece makes the heterogeneous fetch done",
        (
            Edit(
                "kvxferd/transfer/receiver/groups.py",
                "                    digest=g.digest,",
                "                    digest=False,",
            ),
        ),
        ("tests/test_digest.py::test_each_piece_of_an_instance_fetch_is_checked",),
    ),
    Mutant(
        "issue25-stream-marks-a-layer-it-did-not-copy",
        "a streamed save marks a layer ready from save_kv_layer without copying it into the"
        " pool: the sender writes stale pool bytes and the load reports them loaded",
        (
            Edit(
                "kvxferd/integrations/vllm/streams.py",
                "        self._copy_up_to(i + 1)\n",
                "        self._next = i + 1\n",
            ),
        ),
        (
            "tests/test_vllm_topology.py::test_each_prefill_rank_streams_its_shard[1-2-CPU_ATTN]",
            "tests/test_vllm_topology.py::test_each_pipeline_stage_streams_its_own_layers",
        ),
    ),
    Mutant(
        "issue25-stream-ignores-save-kv-layer",
        "save_kv_layer marks nothing: a streamed save's layers leave only at wait_for_save,"
        " after the forward (nothing streams)",
        (
            Edit(
                "kvxferd/integrations/vllm/streams.py",
                "        if i is None or i < self._next:",
                "        if True:",
            ),
        ),
        ("tests/test_vllm_topology.py::test_each_prefill_rank_streams_its_shard[2-1-CPU_ATTN]",),
    ),
    Mutant(
        "issue25-stream-blocks-back-mid-step",
        "a stream's staging blocks go back when its publish ends (a decode abort) while the"
        " engine thread still copies the step's next layers into them",
        (
            Edit(
                "kvxferd/integrations/vllm/publishes.py",
                "_publish_until_closed(s, d, ids, [], st)",
                "_publish_until_closed(s, d, ids, ids, st)",
            ),
        ),
        (
            "tests/test_vllm_topology.py::"
            "test_a_decode_abort_mid_stream_ends_it_and_frees_both_sides",
        ),
    ),
    Mutant(
        "issue26-rules-misspelled-family",
        "an alert reads a family /metrics does not export (a typo): it can never fire",
        (
            Edit(
                "deploy/prometheus/kvxferd-rules.yml",
                "expr: rate(kvxferd_writes_stalled_total[5m]) > 0",
                "expr: rate(kvxferd_writes_stall_total[5m]) > 0",
            ),
        ),
        ("tests/test_monitoring.py::test_rules_read_only_exported_families_and_labels",),
    ),
    Mutant(
        "issue26-family-renamed-under-the-rules",
        "the code renames an exported family the alerts and the dashboard read: they go blind",
        (
            Edit(
                "kvxferd/service/metrics.py",
                '"kvxferd_oldest_in_flight_seconds",',
                '"kvxferd_oldest_inflight_seconds",',
            ),
        ),
        (
            "tests/test_monitoring.py::test_rules_read_only_exported_families_and_labels",
            "tests/test_monitoring.py::test_dashboard_reads_only_exported_families_and_labels",
        ),
    ),
    Mutant(
        "issue26-dashboard-groups-by-a-missing-label",
        "a dashboard panel groups by a label its family does not have: one flat line",
        (
            Edit(
                "deploy/grafana/kvxferd-dashboard.json",
                "sum by (instance, outcome)",
                "sum by (instance, result)",
            ),
        ),
        ("tests/test_monitoring.py::test_dashboard_reads_only_exported_families_and_labels",),
    ),
    Mutant(
        "issue26-runbook-row-without-its-rule",
        "a runbook alert row no longer names its rule: the alert and its runbook drift apart",
        (Edit("docs/operations.md", "| `KvxferdPeersEvicted`: ", "| "),),
        ("tests/test_monitoring.py::test_runbook_alert_table_and_rules_are_the_same_alerts",),
    ),
    Mutant(
        "issue26-link-floor-ignored",
        "readiness ignores dataplane.min_link_gbps: a link measured below the floor is no"
        " link_slow reason",
        (Edit("kvxferd/service/probes.py", "link.gbps < floor", "link.gbps < 0"),),
        ("tests/test_link_probes.py::test_readiness_follows_the_link_floor",),
    ),
    Mutant(
        "issue26-probe-into-kv-blocks",
        "the link probe WRITEs at the receiver's KV pool instead of its advertised scratch region",
        (
            Edit(
                "kvxferd/transfer/sender/admission.py",
                "probes.request(peer, msg.scratch_base,",
                "probes.request(peer, msg.kv_base,",
            ),
        ),
        (
            "tests/test_link_probes.py::test_the_probe_lands_in_the_scratch_region_and_in_no_kv_block",
        ),
    ),
    Mutant(
        "issue26-probe-without-scratch",
        "a receiver that advertised no scratch region (an older one) is probed anyway",
        (
            Edit(
                "kvxferd/transfer/link_probes.py",
                "if nbytes <= 0 or scratch_base <= 0:",
                "if nbytes < 0:",
            ),
        ),
        (
            "tests/test_link_probes.py::test_a_receiver_without_scratch_is_not_probed",
            "tests/test_link_probes.py::test_a_receiver_without_scratch_gets_no_probe",
        ),
    ),
    Mutant(
        "issue26-fresh-path-not-probed",
        "a receiver moved to a fresh NIXL path keeps the figure of its old connection",
        (
            Edit(
                "kvxferd/transfer/path_moves.py",
                "            self.on_moved(peer)",
                "            pass",
            ),
        ),
        ("tests/test_link_probes.py::test_a_peer_moved_to_a_fresh_path_is_probed_again",),
    ),
    Mutant(
        "issue26-no-negotiation",
        "a sender answers every Register in its newest wire version, whatever was offered",
        (
            Edit(
                "kvxferd/transfer/protocol.py",
                "return min(offered, PROTOCOL_VERSION)",
                "return PROTOCOL_VERSION",
            ),
        ),
        (
            VERSIONS + "test_a_register_offered_at_any_version_is_answered_in_the_lower_of_the_two",
            VERSIONS + "test_a_sender_answers_a_version_3_register_in_3_and_records_it",
            VERSIONS + "test_new_sender_old_receiver_fetch_byte_exact_and_nothing_newer_reaches_it",
        ),
    ),
    Mutant(
        "issue26-notification-newest-version",
        "a sender's NIXL done notification carries its newest version, not the peer's",
        (
            Edit(
                "kvxferd/transfer/worker_writes.py",
                "wire.encode_notification(records, version)",
                "wire.encode_notification(records)",
            ),
        ),
        (VERSIONS + "test_new_sender_old_receiver_fetch_byte_exact_and_nothing_newer_reaches_it",),
    ),
    Mutant(
        "issue26-no-register-fallback",
        "a receiver refused unsupported_version at Register never registers again at 3",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "if link.ready or link.fell_back or link.version <= wire.MIN_PROTOCOL_VERSION:",
                "if True:",
            ),
        ),
        (
            VERSIONS
            + "test_a_receiver_refused_at_4_registers_again_at_3_and_speaks_3_on_that_link",
            VERSIONS + "test_old_sender_new_receiver_fetch_byte_exact_at_version_3",
        ),
    ),
    Mutant(
        "issue26-v4-only-sent-to-v3",
        "the encoder sends V4_ONLY fields and messages toward a version-3 peer",
        (
            Edit(
                "kvxferd/transfer/protocol.py",
                "if version < 4 and V4_ONLY and (newer := v4_only_parts(msg)):",
                "if False and V4_ONLY and (newer := v4_only_parts(msg)):",
            ),
        ),
        (VERSIONS + "test_the_encoder_refuses_a_v4_only_field_or_message_toward_a_version_3_peer",),
    ),
    Mutant(
        "issue26-gateway-answers-newest",
        "the engine gateway answers a version-4 client in version 5",
        (
            Edit(
                "kvxferd/engine/gateway.py",
                "frame = ep.encode(msg, self._older.get(rid, ep.ENGINE_PROTOCOL_VERSION))",
                "frame = ep.encode(msg)",
            ),
        ),
        (VERSIONS + "test_old_sender_new_receiver_fetch_byte_exact_at_version_3",),
    ),
    Mutant(
        "issue26-client-no-fallback",
        "the engine Client keeps speaking 5 to a daemon that refused it",
        (
            Edit(
                "kvxferd/engine/dialect.py",
                "if self._unsure and refuses_newest(reply):",
                "if False:",
            ),
        ),
        (
            VERSIONS + "test_a_client_connection_falls_back_to_4_once_and_sends_its_calls_again",
            VERSIONS + "test_old_sender_new_receiver_fetch_byte_exact_at_version_3",
        ),
    ),
    Mutant(
        "issue26-reconnect-keeps-old-version",
        "a receiver's link keeps the previous version after its sender was replaced by a newer one",
        (
            Edit(
                "kvxferd/transfer/receiver/links.py",
                "link.version, link.fell_back = wire.PROTOCOL_VERSION, False",
                "pass",
            ),
        ),
        (
            "tests/test_rolling_upgrade.py::test_a_fleet_upgraded_one_process_at_a_time_under_traffic_loses_nothing",
        ),
    ),
    Mutant(
        "issue26-moved-fetch-not-redirected",
        "a draining sender serves (or refuses) a fetch of a request it handed over instead of"
        " answering moved with its new sender",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "moved = s.handover.redirect(msg) if peer.version >= 4 else None",
                "moved = None",
            ),
        ),
        (
            HANDOVER
            + "test_a_target_with_too_few_blocks_takes_some_and_the_rest_stay_with_the_draining_sender",
        ),
    ),
    Mutant(
        "issue26-receiver-ignores-moved",
        "a receiver whose fetch is answered moved ends it failed instead of following it",
        (
            Edit(
                "kvxferd/transfer/receiver/messages.py",
                'if msg.status == "failed" and msg.reason is Reason.MOVED and self.follow_moved(f, msg):',
                "if False:",
            ),
        ),
        (
            HANDOVER
            + "test_a_target_with_too_few_blocks_takes_some_and_the_rest_stay_with_the_draining_sender",
        ),
    ),
    Mutant(
        "issue26-adopted-without-token",
        "the adopting sender publishes a moved request without its fetch token",
        (
            Edit(
                "kvxferd/transfer/sender/adopt.py",
                "token=item.token or None,",
                "token=None,",
            ),
        ),
        (HANDOVER + "test_fifty_unfetched_requests_move_to_another_sender_and_the_drain_exits_0",),
    ),
    Mutant(
        "issue26-engine-publishes-into-reserved-blocks",
        "an engine publish naming a block reserved for adopted requests is taken",
        (
            Edit(
                "kvxferd/transfer/sender/api.py",
                "self.adopt.refuse_reserved(blocks)",
                "pass",
            ),
        ),
        (HANDOVER + "test_fifty_unfetched_requests_move_to_another_sender_and_the_drain_exits_0",),
    ),
    Mutant(
        "issue26-reserved-blocks-never-freed",
        "the reserved blocks of an adopted request stay taken after its publish ended",
        (
            Edit(
                "kvxferd/transfer/sender/adopt.py",
                "if session.ended and session.drained:",
                "if False:",
            ),
        ),
        (HANDOVER + "test_fifty_unfetched_requests_move_to_another_sender_and_the_drain_exits_0",),
    ),
    Mutant(
        "issue26-moved-before-the-target-has-it",
        "a request counts as moved once the target's fetch is attached, before its bytes are there",
        (
            Edit(
                "kvxferd/transfer/sender/handover.py",
                "if any(sl.state is SliceState.DONE for sl in mine):",
                "if mine:",
            ),
        ),
        (HANDOVER + "test_fifty_unfetched_requests_move_to_another_sender_and_the_drain_exits_0",),
    ),
    Mutant(
        "issue26-no-target-claims-moved",
        "with no target reachable the handover stops without saying so: the operator is not"
        " told the drain keeps (and drops) the requests as before",
        (
            Edit(
                "kvxferd/transfer/sender/handover.py",
                "            if reply is None:\n                continue",
                "            if reply is None:\n                return",
            ),
        ),
        (HANDOVER + "test_with_no_target_reachable_the_drain_behaves_as_before_and_says_so",),
    ),
    Mutant(
        "issue26-adopt-blocks-whole-pool-starts",
        "a sender whose adopt_blocks leaves no block for the engine gets past the start-up checks",
        (
            Edit(
                "kvxferd/service/preflight.py",
                "if adopt >= settings.pool.num_blocks:",
                "if False:",
            ),
        ),
        (PREFLIGHT + "test_adopt_blocks_taking_the_whole_pool_exits_2",),
    ),
    Mutant(
        "issue26-moved-entry-never-expires",
        "a receiver keeps following a moved entry after its TTL",
        (
            Edit(
                "kvxferd/transfer/receiver/moved.py",
                "if entry[1] <= now:",
                "if False:",
            ),
        ),
        (HANDOVER + "test_the_moved_table_follows_an_entry_until_its_ttl_and_stays_bounded",),
    ),
    Mutant(
        "issue26-failed-adopt-keeps-its-blocks",
        "the reserved blocks of an adopt fetch that failed (no write in flight) never come back",
        (
            Edit(
                "kvxferd/transfer/sender/adopt.py",
                "elif f.blocks_reusable:",
                "elif False:",
            ),
        ),
        (
            HANDOVER
            + "test_a_target_whose_fetch_fails_frees_its_blocks_and_the_request_stays_with_the_drain",
        ),
    ),
    Mutant(
        "issue26-discovered-target-is-itself",
        "a sender with handover.discover offers its requests to its own discovery record too",
        (Edit("kvxferd/service/daemon.py", "if n != name", "if n"),),
        (HANDOVER + "test_a_target_found_through_discovery_takes_the_requests",),
    ),
    Mutant(
        "issue26-fetch-during-the-move-attached",
        "a receiver's fetch of a request the target is taking attaches at the draining sender",
        (
            Edit(
                "kvxferd/transfer/sender/listener.py",
                "if s.handover.hold(routing_id, msg, identity, peer.receiver_id):",
                "if False:",
            ),
        ),
        (
            HANDOVER
            + "test_a_fetch_that_comes_while_its_request_moves_is_held_then_sent_to_the_new_sender",
        ),
    ),
    Mutant(
        "issue26-held-fetch-never-released",
        "a fetch held while its request moved is never handled again",
        (Edit("kvxferd/transfer/sender/listener.py", "self._on_request(*held[:3])", "pass"),),
        (
            HANDOVER
            + "test_a_fetch_that_comes_while_its_request_moves_is_held_then_sent_to_the_new_sender",
        ),
    ),
    Mutant(
        "issue26-target-that-never-fetches-holds-forever",
        "an accepted request whose target never fetches it stays offered (its receivers' fetches"
        " held) until the drain deadline",
        (
            Edit(
                "kvxferd/transfer/sender/handover.py",
                "or (not mine and now >= start_by)",
                "or False",
            ),
        ),
        (
            HANDOVER
            + "test_a_target_whose_fetch_fails_frees_its_blocks_and_the_request_stays_with_the_drain",
        ),
    ),
)


# -- the runner ------------------------------------------------------------------------------


def copy_tree(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


# Each run is a pytest process forked from a server that imported these once (the
# third-party modules every test run needs; never kvxferd or tests, which each run imports
# from its own copy): about 3 s of start-up saved per run, 100+ runs per `make test`.
PRELOAD = (
    "torch",
    "numpy",
    "nixl._api",
    "zmq",
    "msgspec",
    "pydantic",
    "structlog",
    "aiohttp",
    "prometheus_client",
    "hypothesis",
    "pytest",
)
_forkserver: multiprocessing.context.ForkServerContext | None = None
_forkserver_lock = threading.Lock()


def _runner() -> multiprocessing.context.ForkServerContext:
    global _forkserver
    with _forkserver_lock:
        if _forkserver is None:
            # The runs share this process's resource tracker, which unlinks at exit the pool
            # segments of runs a mutant made fail before their clean-up: that is its job
            # here, not a leak of the product, so its warning is not shown.
            os.environ.setdefault(
                "PYTHONWARNINGS", "ignore::UserWarning:multiprocessing.resource_tracker"
            )
            # The copies have no .git or .cache: the mixed-version tests build the previous
            # release from this checkout's history into its .cache (tests/support/prev_release.py).
            os.environ.setdefault("KVXFERD_RELEASE_ROOT", str(ROOT))
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            _forkserver = ctx
        return _forkserver


def _pytest_in(tree: str, args: list[str], out_path: str) -> None:
    """A forked run: pytest ``args`` in ``tree``, stdout and stderr into ``out_path``."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # As a fresh `python -m pytest` in the copy would: its kvxferd first on the path (for
    # the daemons the tests start too), no bytecode written, wide short summaries.
    os.environ.update(PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    sys.dont_write_bytecode = True
    os.chdir(tree)
    sys.path.insert(0, tree)
    early = [m for m in sys.modules if m.split(".")[0] in ("kvxferd", "tests")]
    assert not early, f"imported before the fork, so not from the copy: {early}"
    import pytest

    code = int(pytest.main(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_tests(tree: Path, tests: list[str]) -> tuple[int, float, str]:
    """pytest on ``tests`` inside ``tree``: (exit code, seconds, its output); 124 on timeout."""
    args = ["-q", "-x", "-p", "no:cacheprovider", f"--timeout={PYTEST_TIMEOUT_S}", *tests]
    t0 = time.monotonic()
    with tempfile.NamedTemporaryFile(prefix="kvxferd-mutant-", suffix=".out") as out:
        proc = _runner().Process(target=_pytest_in, args=(str(tree), args, out.name))
        proc.start()
        proc.join(RUN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
            code = 124
        else:
            code = proc.exitcode if proc.exitcode is not None else 124
        text = Path(out.name).read_text(errors="replace")
    if code == 124:
        text = f"timed out after {RUN_TIMEOUT_S} s: {text[-2000:]}"
    return code, time.monotonic() - t0, text


def check_edits(tree: Path, m: Mutant) -> str | None:
    """Why the mutant cannot be applied (stale or ambiguous), or None."""
    for e in m.edits:
        path = tree / e.file
        if not path.is_file():
            return f"{e.file} does not exist"
        n = path.read_text().count(e.old)
        if n != 1:
            first = e.old.strip().splitlines()[0]
            where = "not found" if n == 0 else f"found {n} times"
            return f"old text {where} in {e.file}: {first!r}"
    return None


def apply(tree: Path, m: Mutant) -> dict[Path, str]:
    originals: dict[Path, str] = {}
    for e in m.edits:
        path = tree / e.file
        text = path.read_text()
        originals.setdefault(path, text)
        path.write_text(text.replace(e.old, e.new, 1))
    return originals


def tail_of(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def first_failure(text: str) -> str:
    """The test that failed and why, as pytest's short summary says it (shortened), or ""."""
    for line in text.splitlines():
        if re.match(r"(FAILED|ERROR) \S+::", line):
            return line.split("::", 1)[-1][:160]
    return ""


def judge(m: Mutant, tree: Path, verbose: bool = False) -> tuple[bool, str]:
    """Apply ``m`` in ``tree``, run its tests, put the files back: (killed, the report lines)."""
    problem = check_edits(tree, m)
    if problem is not None:
        return False, f"stale     {m.name:40s}   0.0 s  {problem}: rewrite this mutant"
    originals = apply(tree, m)
    try:
        # A survivor gets SURVIVOR_TRIES runs in all: a test that catches the revert only on
        # some runs is timing-dependent, which its line says, but it does catch it.
        attempt = 0
        while True:
            attempt += 1
            code, secs, text = run_tests(tree, list(m.tests))
            if code != 0 or attempt >= SURVIVOR_TRIES:
                break
    finally:
        for path, original in originals.items():
            path.write_text(original)
    indent = "\n" + " " * 10
    if code == 1 or code == 124:
        how = "tests failed, as they must" if code == 1 else "tests hung (timed out)"
        if attempt > 1:
            how += f" (on run {attempt}: the test is timing-dependent, tighten it)"
        line = f"killed    {m.name:40s} {secs:5.1f} s  {how}"
        more = tail_of(text, 40) if verbose else first_failure(text)
    elif code == 0:
        line = f"survived  {m.name:40s} {secs:5.1f} s  the tests PASSED with: {m.why}"
        more = tail_of(text) if verbose else ""
    else:
        line = f"broken    {m.name:40s} {secs:5.1f} s  pytest exit {code} (not a test failure):"
        more = tail_of(text)
    if more:
        line += indent + more.replace("\n", indent)
    return code in (1, 124), line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", action="append", default=[], help="run only this mutant (repeat)")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies")
    p.add_argument(
        "--skip-baseline",
        action="store_true",
        help="do not first run the named tests unchanged (make test: pytest just passed them all)",
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="show each run's failures, not just the first"
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"mutants run at once, each in its own copy (default {DEFAULT_JOBS})",
    )
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:42s} {m.why}\n{'':42s} tests: {' '.join(m.tests)}")
        return 0
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
        print(f"mutants: unknown mutant(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2

    jobs = max(1, min(args.jobs, len(mutants)))
    trees = [Path(tempfile.mkdtemp(prefix="kvxferd-mutants-")) for _ in range(jobs)]
    started = time.monotonic()
    try:
        for tree in trees:
            copy_tree(tree)
        tests = sorted({t for m in mutants for t in m.tests})
        if args.skip_baseline:
            print(f"baseline  skipped: {len(tests)} test selection(s) passed in this run's pytest")
        else:
            code, secs, text = run_tests(trees[0], tests)
            if code != 0:
                print(f"mutants: the named tests fail WITHOUT any mutant ({secs:.1f} s):")
                print(tail_of(text, 40))
                return 1
            print(
                f"baseline  {len(tests)} test selection(s) pass unchanged ({secs:.1f} s)",
                flush=True,
            )
        free: queue.SimpleQueue[Path] = queue.SimpleQueue()
        for tree in trees:
            free.put(tree)

        def run_one(m: Mutant) -> tuple[bool, str]:
            tree = free.get()  # one mutant at a time in each copy
            try:
                return judge(m, tree, args.verbose)
            finally:
                free.put(tree)

        bad = 0
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for killed, line in pool.map(run_one, mutants):  # reported in list order
                bad += not killed
                print(line, flush=True)
        total = time.monotonic() - started
        print(
            f"mutants: {len(mutants) - bad}/{len(mutants)} killed in {total:.0f} s ({jobs} at a time)"
        )
        return 1 if bad else 0
    finally:
        for tree in trees:
            if args.keep:
                print(f"mutants: copy kept at {tree}")
            else:
                shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
