"""The tokenizer process: sockets around TokenizerCore.

Started by the supervisor with multiprocessing "spawn". It binds its inbox, connects to every
data-parallel replica's scheduler inbox and to http's, loads the tokenizer (unless
--skip-tokenizer-init), reports ProcessReady to the supervisor, then serves messages until Shutdown or
SIGTERM. SIGINT is ignored: the supervisor coordinates shutdown.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import zmq

from app import ipc, lifecycle
from app.config.settings import Settings
from app.ipc import Endpoints
from app.protocol import EngineInfo, ProcessReady, ProtocolError, Shutdown
from app.tokenizer.chat import resolve_chat_template
from app.tokenizer.core import SCHEDULER, Outgoing, TokenizerCore
from app.tokenizer.loader import load_tokenizer_from_settings, transformers_without_torch
from app.tokenizer.router import Router

logger = logging.getLogger(__name__)

POLL_MS = 1000  # a bounded wait, so a signal is always seen promptly
GRAMMAR_POLL_MS = 2  # while a request waits for its grammar's compile: how soon it goes on after it


def _on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds through run_tokenizer's finally: sockets closed (pending sends flushed), exit 0.
    raise SystemExit(0)


def run_tokenizer(settings: Settings, endpoints: Endpoints) -> None:
    """Process entry (multiprocessing spawn target)."""
    lifecycle.init_child("tokenizer", settings.log_level)  # logging, SIGINT ignored, dies with parent
    signal.signal(signal.SIGTERM, _on_sigterm)
    ctx = zmq.Context()
    sockets: list[zmq.Socket] = []
    try:
        inbox = ipc.bind_pull(ctx, endpoints.inbox("tokenizer"))
        replicas = settings.data_parallel_size
        outs = Outboxes(
            schedulers=[ipc.connect_push(ctx, endpoints.inbox("scheduler", d)) for d in range(replicas)],
            http=ipc.connect_push(ctx, endpoints.inbox("http")),
        )
        supervisor = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
        sockets = [inbox, *outs.schedulers, outs.http, supervisor]
        with transformers_without_torch():  # this process tokenizes: torch would only cost memory
            core, engine = _build_core(settings)
        lifecycle.settle_heap()
        ipc.send(supervisor, ProcessReady(name="tokenizer", pid=os.getpid(), engine=engine))
        _serve(core, inbox, outs, lifecycle.Heartbeat.attach(endpoints.runtime_dir, "tokenizer"))
    finally:
        for sock in sockets:
            sock.close()
        ctx.term()
    logger.info("tokenizer: stopped")


def _build_core(settings: Settings) -> tuple[TokenizerCore, EngineInfo]:
    """The core and the tokenizer's part of EngineInfo (max_token_chars; the model's figures are the
    worker's: its vocabulary is often padded past the tokenizer's)."""
    chat_template = resolve_chat_template(settings.chat_template)
    if settings.skip_tokenizer_init:
        logger.info("tokenizer: --skip-tokenizer-init: serving token-id prompts only")
        tokenizer = None
        info = EngineInfo()
    else:
        tokenizer = load_tokenizer_from_settings(settings)
        info = EngineInfo(max_token_chars=max_token_chars(tokenizer))
    router = Router(settings.data_parallel_size, settings.load_balance_method)
    if router.num_replicas > 1:
        logger.info("tokenizer: routing over %d data-parallel replicas (%s)", router.num_replicas, router.method)
    core = TokenizerCore(tokenizer, chat_template=chat_template, stream_interval=settings.stream_interval,
                         router=router, reasoning_parser=settings.reasoning_parser,
                         tool_call_parser=settings.tool_call_parser, grammar_cache_size=settings.grammar_cache_size,
                         grammar_compile_timeout=settings.grammar_compile_timeout)
    return core, info


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the input characters one token stands for (http refuses a text prompt longer
    than max_model_len times this before tokenizing it): the longest vocabulary string (byte-level
    tokens spell one character per byte), times 4 where a normalizer may compose characters (NFC
    composes at most 4 into 1)."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    composes = backend is not None and backend.normalizer is not None
    return longest * (4 if composes else 1)


@dataclass(frozen=True)
class Outboxes:
    schedulers: list[zmq.Socket]  # one per data-parallel replica, by index
    http: zmq.Socket

    def send(self, out: Outgoing) -> None:
        ipc.send(self.schedulers[out.replica] if out.dest == SCHEDULER else self.http, out.msg)


def _serve(core: TokenizerCore, inbox: zmq.Socket, outs: Outboxes,
           heartbeat: lifecycle.Heartbeat | None = None) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        lifecycle.beat(heartbeat)
        if core.grammars.pending:
            for reply in core.poll_grammars():
                outs.send(reply)
        if not poller.poll(GRAMMAR_POLL_MS if core.grammars.pending else POLL_MS):
            continue
        try:
            msg = ipc.recv(inbox, zmq.NOBLOCK)
        except zmq.Again:
            continue
        except ProtocolError as exc:
            logger.error("tokenizer: dropping malformed message: %s", exc)
            continue
        if isinstance(msg, Shutdown):
            logger.info("tokenizer: shutdown requested (%s)", msg.reason or "no reason given")
            return
        _dispatch(core, msg, outs)


def _dispatch(core: TokenizerCore, msg: Any, outs: Outboxes) -> None:
    try:
        replies = core.handle(msg)
    except Exception:  # one bad message must not take the process down
        logger.exception("tokenizer: dropping %s after an error", type(msg).__name__)
        return
    for reply in replies:
        outs.send(reply)
