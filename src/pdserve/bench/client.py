"""Open-loop load against an OpenAI-compatible `/v1/completions` endpoint: each request
is sent at its arrival time on its own thread (so a slow server never delays later
arrivals), streamed, and timed per chunk. Standard library only (http.client), so the
benchmark runs wherever Python does."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from .workloads import BenchRequest


@dataclass
class Record:
    prompt_tokens: int
    max_tokens: int
    sent: float = 0.0  # seconds from the run's start
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds from sent, per streamed chunk
    output_tokens: int = 0
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class Endpoint:
    def __init__(self, url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600,
                 admin_key: str | None = None):
        """`admin_key`: a pdserve server's /admin key (its timelines); the API key elsewhere."""
        u = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {url!r}")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.base = u.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.api_key, self.admin_key, self.timeout = api_key, admin_key, timeout
        self.model = model or self.models()[0]

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _headers(self, path: str = "") -> dict:
        h = {"Content-Type": "application/json"}
        key = self.admin_key if path.startswith("/admin/") else self.api_key
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self._conn()
        try:
            conn.request("GET", self.base + path, headers=self._headers(path))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def models(self) -> list[str]:
        try:
            status, body = self.get("/v1/models")
        except OSError as e:
            raise ValueError(f"cannot reach {self.scheme}://{self.host}:{self.port}: {e}") from None
        if status != 200:
            raise RuntimeError(f"GET /v1/models returned {status}: {body[:200]!r}")
        return [m["id"] for m in json.loads(body)["data"]]

    def metrics(self) -> dict[str, float]:
        """Samples of a Prometheus /metrics page, by name summed over labels and by full
        name with labels; {} if there is none."""
        try:
            status, body = self.get("/metrics")
        except OSError:
            return {}
        if status != 200:
            return {}
        out: dict[str, float] = {}
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("#") or not line.strip():
                continue
            full, _, value = line.rpartition(" ")
            name = full.split("{", 1)[0]
            try:
                v = float(value)
            except ValueError:
                continue
            out[name] = out.get(name, 0.0) + v
            if full != name:
                out[full] = v
        return out

    def slo(self) -> dict | None:
        """A pdserve server's SLO ({"ttft_s", "tpot_s"}: GET /admin/slo); None elsewhere."""
        try:
            status, body = self.get("/admin/slo")
        except OSError:
            return None
        return json.loads(body).get("slo") if status == 200 else None

    def timeline(self, n: int) -> list[dict] | None:
        """A pdserve server's last `n` request timelines (GET /admin/timeline); None elsewhere."""
        try:
            status, body = self.get(f"/admin/timeline?n={n}")
        except OSError:
            return None
        return json.loads(body)["requests"] if status == 200 else None

    def complete(self, req: BenchRequest, rec: Record, t_start: float) -> None:
        """Streams one completion, filling `rec` (never raises)."""
        body = json.dumps({"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}})
        conn = self._conn()
        t0 = time.perf_counter()
        rec.sent = t0 - t_start
        try:
            conn.request("POST", self.base + "/v1/completions", body=body, headers=self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
                return
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = str(msg["error"].get("message", msg["error"]))
                    break
                now = time.perf_counter() - t0
                if msg.get("choices"):
                    if rec.ttft is None:
                        rec.ttft = now
                    rec.chunk_times.append(now)
                if msg.get("usage"):
                    rec.output_tokens = msg["usage"].get("completion_tokens", 0)
            rec.e2e = time.perf_counter() - t0
            if not rec.output_tokens:  # no usage chunk: count chunks
                rec.output_tokens = len(rec.chunk_times)
            if rec.ttft is None and rec.error is None:
                rec.error = "stream ended without a token"
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()


def run_load(endpoint: Endpoint, requests: list[BenchRequest], arrivals: list[float],
             progress=None, max_concurrency: int | None = None) -> tuple[list[Record], float]:
    """Sends request i at arrivals[i] seconds (open loop), or once one of `max_concurrency`
    slots frees up if it is later. Returns the records, in request order, and the wall time
    from the first send to the last completion."""
    if len(arrivals) != len(requests):
        raise ValueError("one arrival time per request")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    slots = threading.BoundedSemaphore(max_concurrency or len(requests) or 1)
    records = [Record(len(r.prompt), r.max_tokens) for r in requests]
    threads = []
    t_start = time.perf_counter()
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])

    def one(i: int) -> None:
        try:
            endpoint.complete(requests[i], records[i], t_start)
        finally:
            slots.release()
        if progress is not None:
            progress.update(1)

    for i in order:
        delay = arrivals[i] - (time.perf_counter() - t_start)
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records, time.perf_counter() - t_start
