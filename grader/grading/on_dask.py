"""``attnkit grade --executor dask``: the jobs on an existing Dask distributed cluster.

A worker plugin gives each Dask worker process grading workers of its own (``grader.grading.dispatch.Workers``,
one per thread) for as long as the run lasts; unregistering it at the end stops them. The Dask
workers need this kit installed.

The scheduler is reached before anything is graded or written: one that does not answer (nothing
listens there, no such host, a host that stays silent for CONNECT_SECONDS) is a ``SchedulerError``,
one line that says what to do. Before grading, every Dask worker probes its sandbox, so that the run
says how well submissions are kept apart there, as it does on this machine.
"""
from __future__ import annotations

import socket
import uuid
from collections import defaultdict
from dataclasses import asdict

from distributed import Client, WorkerPlugin, as_completed, get_worker

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks

from ..errors import SchedulerError
from ..sandbox.limits import Limits
from .contracts import ClassJob, Result
from .dispatch import Workers

CONNECT_SECONDS = 10  # for the scheduler to take the connection and answer



class GradingWorkers(WorkerPlugin):
    """The grading workers of one Dask worker process."""

    def __init__(self, limits: dict, name: str, allow_plain: bool = False,
                 speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS):
        self.limits, self.name, self.allow_plain, self.speed_checks = limits, name, allow_plain, speed_checks
        self.workers = None

    def setup(self, worker):
        # (what a box must not reach on the Dask worker's machine is its own business: the kit there is locked
        # where boxes are only other uids; the instructor's course is not on that machine)
        self.workers = Workers(Limits(**self.limits), max(1, worker.state.nthreads), allow_plain=self.allow_plain,
                               speed_checks=self.speed_checks)

    def teardown(self, worker):
        if self.workers is not None:
            self.workers.close()


def connect(scheduler: str) -> Client:
    """A client of the scheduler at ``scheduler``, or a SchedulerError saying why there is none."""
    from distributed.comm.addressing import get_address_host_port, parse_address

    what = ("start one (`dask scheduler` prints its address) or give --scheduler the address of a running one; "
            "nothing was graded or changed")
    try:
        protocol, _ = parse_address(scheduler)
        where = get_address_host_port(scheduler) if protocol in ("tcp", "tls") else None
    except ValueError as exc:
        raise SchedulerError(f"{scheduler!r} is not a Dask scheduler's address ({exc}); e.g. tcp://host:8786") from None
    try:
        if where is not None:  # a refused or unknown address is known at once, without distributed's retries
            socket.create_connection(where, timeout=CONNECT_SECONDS).close()
        return Client(scheduler, timeout=f"{CONNECT_SECONDS}s")
    except (OSError, TimeoutError) as exc:  # refused, no such host, silent, or not a scheduler
        reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
        raise SchedulerError(f"no Dask scheduler answers at {scheduler} ({reason or type(exc).__name__}): "
                             f"{what}") from None


def _probe(allow_plain: bool = False) -> tuple[str, bool]:
    """A Dask worker's sandbox as ``attnkit grade`` announces it, and whether it is weaker than the strongest
    (or refused: no confinement holds there, and plain was not allowed)."""
    from ..sandbox.confinement import ConfinementRefused, probe

    try:
        found = probe(allow_plain=allow_plain)
    except ConfinementRefused as exc:
        return f"sandbox: refused on this worker ({exc})", True
    return found.summary(), bool(found.missing)


def confinement(client: Client, scheduler: str, allow_plain: bool = False) -> tuple[list[str], bool]:
    """How well the Dask workers keep submissions apart (a line per kind, saying on how many workers), and
    whether that is weaker than it could be somewhere (or not known yet: no worker)."""
    workers = defaultdict(list)
    for address, probed in client.run(_probe, allow_plain).items():
        workers[tuple(probed)].append(address)
    if not workers:
        return [f"no Dask worker is connected to the scheduler at {scheduler} yet: the run waits for one "
                "(each record says how its submission was kept apart)"], True
    lines = [f"{summary} (on {len(where)} Dask worker{'s' * (len(where) > 1)})"
             for (summary, _), where in sorted(workers.items())]
    return lines, any(weaker for _, weaker in workers)


class DaskResults:
    """(job, result) as they complete on the cluster at ``scheduler``, like ``dispatch.LocalResults``."""

    def __init__(self, jobs, limits: Limits, scheduler: str, allow_plain: bool = False,
                 speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS):
        self.client = connect(scheduler)
        self.plugin = GradingWorkers(asdict(limits), name=f"attnkit-grade-{uuid.uuid4().hex[:12]}",
                                     allow_plain=allow_plain, speed_checks=speed_checks)
        self.futures = {}
        try:
            self.confinement, self.weaker = confinement(self.client, scheduler, allow_plain)  # before any grading
            self.client.register_plugin(self.plugin)
            for job in jobs:
                key = f"{self.plugin.name}-{job['student']}-{job['fingerprint'][:16]}"
                self.futures[self.client.submit(grade, job, self.plugin.name, key=key, pure=False)] = job
        except BaseException:
            self.close()
            raise

    def __iter__(self):
        for future in as_completed(list(self.futures)):
            yield self.futures[future], future.result()

    def close(self):
        for future in self.futures:
            future.cancel()
        try:
            self.client.unregister_worker_plugin(self.plugin.name)
        except Exception:  # never registered, or the cluster is going away: its workers take their processes along
            pass
        self.client.close()


def grade(job: ClassJob, plugin: str) -> Result:
    """A Dask task: ``job`` graded by the grading workers of the Dask worker it runs on."""
    return get_worker().plugins[plugin].workers.grade(job)
