"""Triton kernel variants compiled while serving, counted and named.

A Triton kernel compiles a variant on its first launch with new constants or argument
specializations (an int equal to 1, or divisible by 16): a second or more on a busy serving host,
during which the step that launched it waits, and every request in it. The runner's warm-up and
calibration launch what serving meets (exec/model_runner.py); what they missed shows here:

    watch = CompileWatch.arm()    # once the process is warm (a worker's start)
    watch.count, watch.recent()   # variants compiled since, the last few by name and arguments

Every compile after arm() is logged once (a warning naming the kernel and its specialization).
The watch is process-wide (Triton's hook is): arm() returns the one watch and installs its hook
once, chained to a hook that was there before. With no Triton, or under the CPU interpreter
(nothing compiles), the count stays 0.
"""

from __future__ import annotations

import collections
import logging
import threading

log = logging.getLogger(__name__)

KEEP = 8  # names recent() keeps


def describe(repr: str, fn, compile: dict | None) -> str:
    """A variant as Triton's hook names it, with the argument attributes it is specialized on
    (which pointers are 16-byte aligned, which ints divisible by 16: `configs`), which its own
    repr leaves out on some versions."""
    what = repr or getattr(fn, "name", None) or "?"
    configs = (compile or {}).get("configs")
    return f"{what} {str(configs[0])[:300]}" if configs else what


class CompileWatch:
    _armed: CompileWatch | None = None
    _lock = threading.Lock()

    def __init__(self, label: str = ""):
        self.label = label
        self.count = 0
        self._recent: collections.deque[str] = collections.deque(maxlen=KEEP)
        self._previous = None  # the hook this one chains to

    @classmethod
    def arm(cls, label: str = "") -> CompileWatch:
        """The process's watch, its hook installed (once); `label` names the process in the log."""
        with cls._lock:
            if cls._armed is None:
                watch = cls(label)
                watch._install()
                cls._armed = watch
            return cls._armed

    def recent(self) -> list[str]:
        """The last variants compiled (kernel name and its arguments' specialization), oldest first."""
        return list(self._recent)

    def hook(self, *, repr: str = "", fn=None, is_manual_warmup: bool = False, compile=None, **kw) -> bool:
        """Triton's JIT cache hook: called before a variant compiles. Returns False (compile it)."""
        if not is_manual_warmup:
            what = describe(repr, fn, compile)
            self.count += 1
            self._recent.append(what)
            log.warning("%skernel variant compiled while serving (#%d): %s", f"{self.label}: " if self.label else "",
                        self.count, what)
        if self._previous is not None:
            return bool(self._previous(repr=repr, fn=fn, is_manual_warmup=is_manual_warmup, compile=compile, **kw))
        return False

    def _install(self) -> None:
        try:
            import triton
        except ImportError:
            return
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):  # Triton >= 3.4
            self._previous = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self.hook
        else:
            from triton.runtime.jit import JITFunction

            self._previous = getattr(JITFunction, "cache_hook", None)
            JITFunction.cache_hook = self.hook
