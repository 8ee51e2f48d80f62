"""`ServerOptions`: the server-wide settings a request's own fields override (vLLM's server
flags of the same names), in one place: `pdserve serve` sets them, `build_app` reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    force_include_usage: bool = False  # --enable-force-include-usage: every stream ends with its usage
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: log-probs name "token_id:<id>"
    load_tracking: bool = False  # --enable-server-load-tracking: GET /load answers the requests in flight
