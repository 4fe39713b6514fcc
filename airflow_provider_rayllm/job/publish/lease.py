"""The lease of a generation: ``<generation>/_lease.json``, written when the attempt starts and renewed by a
thread of the driver every ``RENEW_S`` while the job runs. Another task instance's publish removes the
folder only once the lease is older than ``generations.LEASE_TTL_S`` (a writer that died)."""

from __future__ import annotations

import logging
import threading

from airflow_provider_rayllm.job.publish import generations

RENEW_S = 60.0

log = logging.getLogger("airflow_provider_rayllm.job")


class Lease:
    def __init__(self, output_uri: str, name: str, submission_id: str, renew_s: float = RENEW_S):
        self.output_uri, self.name, self.submission_id, self.renew_s = output_uri, name, submission_id, renew_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.publishing = False

    def renew(self) -> None:
        generations.write_lease(self.output_uri, self.name, self.submission_id, publishing=self.publishing)

    def begin_publish(self) -> None:
        """From now on the lease says the generation is publishing (its files move to the top level)."""
        self.publishing = True
        self.renew()

    def start(self) -> Lease:
        """Written once now (a failure to write it fails the job: a folder without a live lease may go), then
        renewed in the background."""
        self.renew()
        self._thread = threading.Thread(target=self._loop, name="rayllm-lease", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except Exception as exc:  # a missed renewal is retried; the TTL is many renewals long
                log.warning("lease of %s not renewed: %s", self.name, exc)

    def stop(self) -> None:
        """No more renewals (before the folder is removed, so that none writes it again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
