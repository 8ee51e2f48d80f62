"""Whether a tier's directory takes writes (`WriteHealth`): one per directory a tier writes to
(the disk tier's `kv_disk_dir`, the persisted host tier's `kv_persist_dir`).

A write that fails with an OSError (EROFS: remounted read-only, ENOSPC: full, EIO: a failing
disk, EACCES, ...) marks the directory unwritable: the cause is logged once (by its errno name,
again only if it changes or comes back after a success), counted, and shown in the engine's
stats (`<tier>_write_errors`, `<tier>_unwritable`, `<tier>_write_error`: the last cause). While
unwritable, the tier's writes are skipped, not tried; after `retry_s` the next write tries
again, and one that succeeds clears the mark. Serving never stops for it: the tier's blocks are
only not kept, which costs hits, not requests.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from ..stats import WriteStats

log = logging.getLogger(__name__)

RETRY_S = 30.0  # an unwritable directory is tried again after this long


class WriteHealth:
    def __init__(self, tier: str, where: str, retry_s: float = RETRY_S):
        """`tier`: the stats' prefix ("kv_disk", "kv_persist"); `where`: the directory (for the log)."""
        self.tier, self.where, self.retry_s = tier, where, retry_s
        self.errors = 0  # writes that failed
        self.skipped = 0  # writes not tried while unwritable
        self.cause: str | None = None  # the last failure ("EROFS: Read-only file system"), None while writable
        self.failed_at = 0.0  # time.monotonic() of the last failure
        self._logged: str | None = None  # the cause last logged: each one once
        self._lock = threading.Lock()  # the writer thread and the engine thread both report

    @property
    def writable(self) -> bool:
        return self.cause is None

    def may_write(self) -> bool:
        """True if a write should be tried now: writable, or unwritable for `retry_s` (a retry).
        False counts the write as skipped."""
        with self._lock:
            if self.cause is None or time.monotonic() - self.failed_at >= self.retry_s:
                return True
            self.skipped += 1
            return False

    def failed(self, err: OSError, what: str = "a write") -> None:
        """`what` failed with `err`: unwritable until `retry_s` has passed."""
        cause = f"{errno.errorcode.get(err.errno, 'OSError')}: {err.strerror or err}"
        with self._lock:
            self.errors += 1
            self.cause, self.failed_at = cause, time.monotonic()
            first, self._logged = self._logged != cause, cause
        if first:
            log.warning("%s (%s): %s failed (%s); its writes are skipped, tried again every %.0f s, serving goes on",
                        self.tier, self.where, what, cause, self.retry_s)

    def succeeded(self) -> None:
        if self.cause is None:
            return
        with self._lock:
            self.cause, self._logged = None, None
        log.warning("%s (%s): writable again", self.tier, self.where)

    def stats(self) -> WriteStats:
        return WriteStats(self.tier, self.errors, self.skipped, self.cause)
