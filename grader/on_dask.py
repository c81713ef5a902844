"""``attnkit grade --executor dask``: the jobs on an existing Dask distributed cluster.

A worker plugin gives each Dask worker process grading workers of its own (``grader.dispatch.Workers``,
one per thread) for as long as the run lasts; unregistering it at the end stops them. The Dask
workers need this kit installed.
"""
from __future__ import annotations

import uuid
from dataclasses import asdict

from distributed import Client, WorkerPlugin, as_completed, get_worker

from .dispatch import Workers
from .sandbox import Limits


class GradingWorkers(WorkerPlugin):
    """The grading workers of one Dask worker process."""

    def __init__(self, limits: dict, name: str, allow_plain: bool = False):
        self.limits, self.name, self.allow_plain = limits, name, allow_plain
        self.workers = None

    def setup(self, worker):
        # (what a box must not reach on the Dask worker's machine is its own business: the kit there is locked
        # where boxes are only other uids; the instructor's course is not on that machine)
        self.workers = Workers(Limits(**self.limits), max(1, worker.state.nthreads), allow_plain=self.allow_plain)

    def teardown(self, worker):
        if self.workers is not None:
            self.workers.close()


def results(jobs, limits: Limits, scheduler: str, allow_plain: bool = False):
    """(job, result) as they complete on the cluster at ``scheduler``, like ``dispatch.LocalResults``."""
    plugin = GradingWorkers(asdict(limits), name=f"attnkit-grade-{uuid.uuid4().hex[:12]}", allow_plain=allow_plain)
    with Client(scheduler, timeout="30s") as client:
        client.register_plugin(plugin)
        futures = {}
        try:
            for job in jobs:
                key = f"{plugin.name}-{job['student']}-{job['fingerprint'][:16]}"
                futures[client.submit(grade, job, plugin.name, key=key, pure=False)] = job
            for future in as_completed(list(futures)):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()
            try:
                client.unregister_worker_plugin(plugin.name)
            except Exception:  # the cluster is going away: its workers take their processes with them
                pass


def grade(job: dict, plugin: str) -> dict:
    """A Dask task: ``job`` graded by the grading workers of the Dask worker it runs on."""
    return get_worker().plugins[plugin].workers.grade(job)
