"""`PeerCalls`: what a worker tells other workers, actor to actor (never through the cluster):

    target(Reserved)   a decode worker's reservation -> its prefill worker's `target()`: where
                       to send the request's KV
    fetch(Fetching)    a peer fetch's posted receive -> the holder's `serve_fetch()`: send that
                       run of blocks (transfer/fetch.py); a refusal or a holder gone comes back
                       through `on_refused`, so the receive fails at once instead of at its deadline

Handles are looked up by name in the cluster's namespace and kept until `forget()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray

from pdserve.engine.role import Fetching, Reserved

log = logging.getLogger(__name__)


class PeerCalls:
    def __init__(self, worker_id: str, namespace: str):
        self.worker_id, self.namespace = worker_id, namespace
        self.actors: dict[str, object] = {}

    def actor(self, worker_id: str):
        a = self.actors.get(worker_id)
        if a is None:
            a = self.actors[worker_id] = ray.get_actor(worker_id, namespace=self.namespace)
        return a

    def forget(self, worker_id: str) -> None:
        self.actors.pop(worker_id, None)

    def target(self, ev: Reserved) -> bool:
        """Tells the prefill worker where to send; False if it is unreachable."""
        try:
            self.actor(ev.peer).target.remote(ev.request_id, ev.target)
            return True
        except Exception as e:  # noqa: BLE001 - the prefill worker is gone: the caller fails the request
            log.warning("%s: prefill worker %s unreachable: %s", self.worker_id, ev.peer, e)
            return False

    def fetch(self, ev: Fetching, on_refused: Callable[[str, str], None]) -> None:
        """Asks the holder to send the run; `on_refused(fetch id, why)` (from any thread) when it
        will not or cannot."""
        try:
            ref = self.actor(ev.peer).serve_fetch.remote(ev.request_id, ev.hashes, ev.target)
        except Exception as e:  # noqa: BLE001 - the holder is gone
            on_refused(ev.request_id, f"holder {ev.peer} unreachable: {type(e).__name__}")
            return

        def answered(fut) -> None:
            try:
                ok, why = fut.result(), "the holder no longer caches the run"
            except Exception as e:  # noqa: BLE001 - the holder died under the call
                ok, why = False, f"holder {ev.peer} failed: {type(e).__name__}"
            if not ok:
                on_refused(ev.request_id, why)

        ref.future().add_done_callback(answered)
