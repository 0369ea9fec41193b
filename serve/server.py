"""The server's start and stop (`run_server`; `run_batch`: run-batch's, the HTTP API without a port): the engine threads behind the router, the gRPC server
(serve.grpc_api), the OpenAI HTTP API (serve.openai_api) and the metrics endpoint, on one event loop.

The engine runs on its own thread (`EngineThread`); with data parallelism, M engines each on their
own, behind the router (`jaxcb.host.replicas.Replicas`, which the server always talks to).

Start-up: the port opens first with health NOT_SERVING, every bucket is compiled, then SERVING.
Shutdown (SIGTERM/SIGINT): stop accepting, let streams finish for the grace period, abort the rest
(their streams end with finish reason "abort"), exit 0. If the engine thread dies, health turns
NOT_SERVING and the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from jaxcb.host.engine import Engine
from jaxcb.host.replicas import Replicas
from serve.frontend import ServerOptions, State
from serve.grpc_api import make_grpc_server
from serve.metrics import Metrics

__all__ = ["ServerOptions", "run_server"]
log = logging.getLogger("jaxcb.serve")
HTTP_CLOSE_S = 2.0  # at shutdown, after the drain: how long open HTTP connections get before they are cut


async def run_server(engine: Engine | list[Engine], tokenizer, served_names: str | tuple[str, ...], dtype: str,
                     options: ServerOptions, announce=print) -> int:
    """Serve one engine, or data-parallel replicas (a list), under `served_names` (the names requests
    may give the model; answers carry the first) until SIGTERM/SIGINT (returns 0) or until an engine
    dies (returns 1)."""
    engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
    state = open_state(engines, tokenizer, served_names, dtype, options)
    metrics, replicas = state.metrics, state.thread
    publishers = _kv_event_publishers(engines, options, state.model_name, announce)
    state.kv_event_sources = {str(i): {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": p.endpoint,
                                       "replay_endpoint": p.replay_endpoint, "topic": p.topic.decode()}
                              for i, p in enumerate(publishers)}  # (vLLM's /kv_event_sources: per DP rank)

    server, set_health = make_grpc_server(state, options)
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{options.host}:{options.port}"
    if options.tls_cert:
        with open(options.tls_key, "rb") as f:
            key = f.read()
        with open(options.tls_cert, "rb") as f:
            cert = f.read()
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(options.metrics_port, addr=options.metrics_host, registry=metrics.registry)

    http_stop = None
    if options.http_port is not None:
        from serve.openai_api import make_app, serve_http

        try:
            _, http_stop = await serve_http(make_app(state), options.host, options.http_port, tls_cert=options.tls_cert,
                                            tls_key=options.tls_key, close_s=HTTP_CLOSE_S,
                                            header_timeout_s=options.http_header_timeout_s)
        except BaseException:
            await server.stop(0)  # e.g. the HTTP port is taken: an unstopped aio server blocks exit
            raise
        scheme = "https" if options.tls_cert else "http"
        announce(f"jaxcb: OpenAI-compatible HTTP API on {scheme}://{options.host}:{options.http_port}/v1")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            state.loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    announce(f"jaxcb: listening on {options.host}:{port}; warming up ({', '.join(state.served_names)})")
    t0 = time.perf_counter()
    def progress(i, total, shape):  # engine thread; a line per quarter
        if i == total or i * 4 // total != (i - 1) * 4 // total:
            announce(f"jaxcb: warm-up {i}/{total} shapes ({time.perf_counter() - t0:.0f}s)")

    # Warm-up on a thread of its own, so that SIGTERM during it stops the server at once.
    done = concurrent.futures.Future()

    def warm():
        try:
            done.set_result(replicas.warmup(progress))
        except BaseException as e:  # noqa: BLE001 - raised on the loop by warmed.result()
            done.set_exception(e)

    threading.Thread(target=warm, name="jaxcb-warmup", daemon=True).start()
    warmed = asyncio.wrap_future(done)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([warmed, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not warmed.done():
        announce("jaxcb: stopped during warm-up; exiting")
        await server.stop(0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the warm-up thread is inside the compiler: do not wait for it
    try:
        shapes = warmed.result()
    except BaseException:
        stopping.cancel()
        if http_stop is not None:
            await http_stop()
        await server.stop(0)  # an unstopped aio server keeps the process from exiting
        raise
    state.thread.start()
    state.ready = True
    if state.batches is not None:
        state.batches.serving()  # (batches made during warm-up, and those taken back from --batch-dir, run)
    await set_health(health_pb2.HealthCheckResponse.SERVING)
    step = engines[0].runner.describe()
    announce(f"jaxcb: SERVING on {options.host}:{port} after warming up {shapes} bucket shapes (compiled or "
             f"loaded from the compile cache) in "
             f"{time.perf_counter() - t0:.1f}s; attention: {step['attention']} on {step['platform']}")

    dying = asyncio.ensure_future(state.died.wait())
    await asyncio.wait([dying, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 1 if state.died.is_set() else 0
    state.draining = True
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    if state.batches is not None:  # (a batch is no client's stream: it does not wait for the grace period)
        await state.batches.close()
    if code == 0:
        announce(f"jaxcb: shutting down; {len(state.active)} streams in flight, grace {options.grace_s:.0f}s")
        deadline = time.monotonic() + options.grace_s
        while state.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(state.active):
            state.thread.abort(rid)
        deadline = time.monotonic() + 5.0
        while state.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    else:
        log.error("the engine thread died: %r", state.thread.error)
        announce(f"jaxcb: the engine died ({state.thread.error!r}); exiting")
        state.engine_died()
    if http_stop is not None:
        # Connections still open (a client that stopped reading its stream) are closed after a short
        # wait: the streams' requests are already finished or aborted.
        try:
            await asyncio.wait_for(http_stop(), timeout=HTTP_CLOSE_S + 2.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("the HTTP server did not close its connections in time; leaving them")
    await server.stop(1.0)
    state.thread.stop()
    for p in publishers:
        p.close()
    return code


async def run_batch(engines, tokenizer, served_names, dtype: str, options, input_file: str, output_file: str,
                    max_in_flight: int, announce=print) -> int:
    """`jaxcb run-batch`: warm up the engines, answer every line of `input_file` ("-": stdin) into
    `output_file` ("-": stdout), stop them. 0 if every line was answered 200, else 1."""
    from serve.batch import Tally, json_line, run_lines
    from serve.openai_api import make_app

    state = open_state(engines, tokenizer, served_names, dtype, options)
    with contextlib.ExitStack() as files:
        source = sys.stdin.buffer if input_file == "-" else files.enter_context(open(input_file, "rb"))
        sink = sys.stdout if output_file == "-" else files.enter_context(open(output_file, "w", encoding="utf-8"))
        t0 = time.perf_counter()
        shapes = await asyncio.to_thread(state.thread.warmup, None)
        announce(f"jaxcb run-batch: warmed up {shapes} bucket shapes in {time.perf_counter() - t0:.1f}s")
        state.thread.start()
        state.ready = True
        died = asyncio.ensure_future(state.died.wait())
        died.add_done_callback(lambda f: f.cancelled() or state.engine_died())
        t0 = time.perf_counter()
        tally = Tally()
        try:
            await run_lines(make_app(state), source, lambda out: sink.write(json_line(out)),
                            max_in_flight, tally, alive=lambda: not state.died.is_set(),
                            progress=lambda text: announce(f"jaxcb run-batch: {text}"))
        finally:
            died.cancel()
            state.draining = True
            for key in list(state.active):
                state.thread.abort(key)
            state.thread.stop()
        wall = time.perf_counter() - t0
    announce(f"jaxcb run-batch: {tally.lines} lines, {tally.answered} answered, {tally.failed} failed; "
             f"{wall:.1f}s, {tally.output_tokens} output tokens ({tally.output_tokens / max(wall, 1e-9):.1f}/s)")
    return 0 if tally.failed == 0 and not state.died.is_set() else 1


def open_state(engines: list[Engine], tokenizer, served_names: str | tuple[str, ...], dtype: str,
               options: ServerOptions) -> State:
    """What the APIs' handlers share (serve.frontend.State) on the running loop: the engines behind the
    router (their threads not started: warm up first), the metrics they refresh at each step, and the
    event an engine's death sets."""
    metrics = Metrics(replicas=len(engines))
    loop = asyncio.get_running_loop()
    died = asyncio.Event()

    def on_death(error):
        loop.call_soon_threadsafe(died.set)

    def on_step(replica, eng, events):
        metrics.refresh(eng.stats(), replica)
        if eng.adapters is not None:
            metrics.refresh_lora(replicas.lora_info())

    replicas = Replicas(engines, on_death=on_death, on_step=on_step)
    first = engines[0]
    metrics.set_cache_info(first.config.page_size, sum(e.stats().pages_total for e in engines),
                           first.runner.describe()["kv_dtype"], first.config.scheduler.prefix_caching)
    if first.adapters is not None:  # the adapters' gauges from the start, not from the first step
        metrics.refresh_lora(replicas.lora_info())
    state = State(replicas, tokenizer, served_names, dtype, options, metrics)
    state.loop, state.died, state.thread = loop, died, replicas
    return state


def _kv_event_publishers(engines, options: ServerOptions, model_name: str, announce) -> list:
    """With --kv-events: a ZMQ publisher (and its replay socket) per replica, each engine's prefix cache
    reporting to its own (jaxcb.host.kv_events)."""
    if not options.kv_events:
        return []
    import socket

    from jaxcb.host.kv_events import ZmqPublisher, endpoints

    topic = options.kv_events_topic
    if topic is None:
        topic = f"kv@{socket.gethostname()}@{model_name}"
    publishers = []
    for i, engine in enumerate(engines):
        pub, replay = endpoints(options.kv_events, i)
        publisher = ZmqPublisher(pub, replay, topic)
        engine.publish_kv_events(publisher.publish, rank=i if len(engines) > 1 else None)
        publishers.append(publisher)
        announce(f"jaxcb: KV-cache events of replica {i} on {publisher.endpoint} (replay on "
                 f"{publisher.replay_endpoint}), topic {topic!r}")
    return publishers
