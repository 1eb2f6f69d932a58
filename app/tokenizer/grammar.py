"""Grammar compiles for the tokenizer process: off its loop, cached by text, bounded in time.

A request with a GrammarSpec is looked up in the cache (app/grammar/cache.py); on a hit it goes on at once
with the serialized grammar filled in. On a miss its compile is queued on one helper thread (a second
request for the same text waits on the same compile) and the request is held here, not at the scheduler:
nobody else's steps wait for it. The process loop polls finished compiles (poll()), with a short wait
while any is pending. A compile still running after `timeout_s` fails the requests waiting for it
(400); the thread cannot be stopped, so its result is still cached when it ends.

XGrammar and the vocabulary's TokenizerInfo load on the helper thread with the first grammar, so an
appliance serving no grammar pays nothing for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from app.grammar import GrammarError, cache_key
from app.grammar.cache import GrammarCache, Outcome
from app.protocol import GrammarSpec

logger = logging.getLogger(__name__)

# A serialized JSON-schema grammar over a 128k vocabulary measured ~0.1-1 MB: 256 MiB holds hundreds.
CACHE_MAX_BYTES = 256 << 20


@dataclass(slots=True)
class Held:
    """A request waiting for its grammar's compile."""

    rid: str
    key: tuple[str, str]
    since: float
    payload: Any  # what the caller needs to send the request on


class GrammarService:
    def __init__(self, make_compiler: Callable[[], Any], *, cache_size: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """make_compiler: builds the app.grammar.compiler.Compiler (on the helper thread, once)."""
        self._make_compiler = make_compiler
        self._compiler: Any = None
        self._cache = GrammarCache(cache_size, CACHE_MAX_BYTES)
        self._timeout_s = timeout_s
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._compiling: dict[tuple[str, str], Future] = {}
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()  # the helper thread builds the compiler once

    @property
    def cache(self) -> GrammarCache:
        return self._cache

    @property
    def pending(self) -> bool:
        """Whether requests wait for a compile (the loop then polls often)."""
        return bool(self._held)

    def lookup(self, spec: GrammarSpec) -> Outcome | None:
        """The cached outcome of spec's grammar, or None (then hold() the request)."""
        return self._cache.get(cache_key(spec))

    def hold(self, rid: str, spec: GrammarSpec, payload: Any) -> None:
        """Hold request `rid` until its grammar compiles; poll() hands it back with the outcome."""
        key = cache_key(spec)
        if key not in self._compiling:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self._compiling[key] = self._pool.submit(self._compile, spec)
        self._held[rid] = Held(rid, key, self._clock(), payload)

    def held_rids(self) -> list[str]:
        return list(self._held)

    def release(self, rid: str) -> Held | None:
        """Forget a held request (aborted); its compile goes on and is cached."""
        return self._held.pop(rid, None)

    def poll(self) -> list[tuple[Held, Outcome]]:
        """Held requests whose compile ended or timed out, with their outcome."""
        finished: dict[tuple[str, str], Outcome] = {}
        for key, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[key]
                finished[key] = future.result()
                self._cache.put(key, finished[key])
        now = self._clock()
        out: list[tuple[Held, Outcome]] = []
        for rid, held in list(self._held.items()):
            outcome = finished.get(held.key)
            if outcome is None and now - held.since > self._timeout_s:
                outcome = Outcome(error=f"compiling the grammar took longer than {self._timeout_s:g} s "
                                        "(--grammar-compile-timeout); simplify it")
            if outcome is not None:
                del self._held[rid]
                out.append((held, outcome))
        return out

    def _compile(self, spec: GrammarSpec) -> Outcome:
        """On the helper thread: the outcome of one compile (never raises)."""
        try:
            with self._lock:
                if self._compiler is None:
                    self._compiler = self._make_compiler()
            started = time.perf_counter()
            compiled = self._compiler.compile(spec)
            outcome = Outcome(compiled=self._compiler.serialize(compiled))
        except GrammarError as exc:
            return Outcome(error=str(exc))
        except Exception as exc:  # the compiler's own failure: the request fails, the process stays
            logger.exception("tokenizer: grammar compile failed")
            return Outcome(error=f"invalid value for '{spec.param or 'grammar'}': {exc}")
        logger.info("tokenizer: compiled a %s grammar in %.1f ms (%d chars serialized)", spec.kind,
                    (time.perf_counter() - started) * 1e3, len(outcome.compiled))
        return outcome

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
