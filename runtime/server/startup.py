"""Starting and stopping the server process: checks that refuse a bad start in one line before the model loads,
the scheduler process, the listener, and the drain on SIGINT / SIGTERM (or the exit when the scheduler dies)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from typing import Optional

from aiohttp import web

from braid.runtime.server.http_middleware import resolve_api_key
from braid.runtime.server.http_server import create_app
from braid.runtime.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("braid.server")

SCHEDULER_DEATH_GRACE_S = 2.0


class StartRefused(Exception):
    """The server cannot start with these arguments; the message says why and what to change."""


def check_before_start(server_args) -> None:
    """Refuse in one line, before the scheduler process starts, what this process can already see is wrong."""
    from braid.runtime.layers.attention.registry import check_backend_device
    from braid.runtime.models.registry import check_model_source
    from braid.runtime.chat_format import load_chat_template

    if server_args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: braid never runs code from a model folder")
    try:
        check_model_source(server_args)
        if server_args.attention_backend is not None:
            check_backend_device(server_args.attention_backend, server_args.resolved_device)
        if server_args.chat_template is not None:
            load_chat_template(server_args.chat_template)
    except (ValueError, OSError) as e:
        raise StartRefused(str(e)) from e


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))


async def serve(server_args) -> int:
    """Start the scheduler, serve HTTP until SIGINT/SIGTERM, then drain and stop. Returns the exit code
    (1 when the scheduler process died under the server)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _check_port_free(server_args.host, server_args.port)  # before minutes of model loading, not after
    resolve_api_key(server_args)  # an unreadable key file fails now, not after the model loads
    check_before_start(server_args)
    tm = TokenizerManager(server_args)
    runner: Optional[web.AppRunner] = None
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        start = asyncio.ensure_future(tm.start())
        await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # signalled while the model loads
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return 0
        start.result()
        # what start-up built (modules, tokenizer) lives as long as the process: out of the collector's way, so
        # full collections, which the per-step output objects trigger, walk only the requests' objects
        gc.freeze()
        runner = web.AppRunner(create_app(tm), handler_cancellation=True, shutdown_timeout=5.0,
                               access_log=logging.getLogger("aiohttp.access") if server_args.log_requests else None)
        await runner.setup()
        await web.TCPSite(runner, server_args.host, server_args.port).start()
        logger.info("braid server ready on http://%s:%d (model %s, context %d)", server_args.host, server_args.port,
                    server_args.model_name, tm.context_len)
        dead_wait = asyncio.ensure_future(tm.dead_event.wait())
        await asyncio.wait({stop_wait, dead_wait}, return_when=asyncio.FIRST_COMPLETED)
        dead_wait.cancel()
        if tm.dead:
            logger.error("exiting: %s", tm.dead)
            # a moment of 503s (health and generation) lets a supervisor or load balancer see why, and lets
            # in-flight handlers answer their clients before the listener goes away
            await asyncio.sleep(SCHEDULER_DEATH_GRACE_S)
            return 1
        logger.info("shutting down")
        await tm.shutdown(server_args.shutdown_timeout_s)
        return 0
    finally:
        stop_wait.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if runner is not None:
            await _stop_listening(runner)
            await runner.cleanup()
        await tm.close()


async def _stop_listening(runner: web.AppRunner) -> None:
    """Close the listening sockets and let the connections accepted just before settle, so that the runner's cleanup
    then answers or closes every one of them at once, before the slow teardown."""
    for site in list(runner.sites):
        await site.stop()
    # asyncio hands an accepted connection to aiohttp a few loop turns later; one handed over as the cleanup starts
    # has its request dropped and is held, unanswered, for the whole shutdown timeout
    await asyncio.sleep(0.1)


def launch_server(server_args) -> int:
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper(), logging.INFO),
                        format="[server %(asctime)s] %(levelname)s %(message)s")
    if server_args.node_rank > 0:  # multi-node TP: this host runs its ranks; node 0 serves HTTP
        from braid.runtime.processes.scheduler_process import run_node_ranks

        return run_node_ranks(server_args)
    return asyncio.run(serve(server_args))
