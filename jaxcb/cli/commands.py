"""The `jaxcb` command line.

    jaxcb generate "Why is the sky blue?"            # chat template applied; --raw to skip it
    jaxcb generate --input requests.jsonl --output results.jsonl [--stats] [--static]
    jaxcb run-batch -i batch.jsonl -o results.jsonl   # OpenAI Batch API lines, as vLLM's run-batch
    jaxcb serve | client | warmup | convert | plan | buckets   (see --help of each)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxcb.cli import tools as cli_tools
from jaxcb.cli.args import add_model_args as _add_model_args
from jaxcb.cli.args import dtype as _dtype
from jaxcb.cli.args import engine_config as _engine_config
from jaxcb.cli.generate import cmd_generate
from jaxcb.device import cpu_dots
from jaxcb.host.errors import InvalidConfig, JaxcbError
from jaxcb.model.embedded import served_name
from jaxcb.host.tool_calls import PARSERS as TOOL_CALL_PARSERS
from jaxcb.host.tool_calls import choose_format as choose_tool_format


def _sampling_args(p: argparse.ArgumentParser, remote: bool = False) -> None:
    """The sampling flags; `remote` (a client's): one left out is the server's (the model's recommendation where
    the server takes it, else the default named)."""
    def default(value):
        return None if remote else value

    held = " (default: the server's, else %s)" if remote else " (default %s)"
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=default(0.0), help="sampling temperature" + held % "0: greedy")
    p.add_argument("--top-k", type=int, default=default(0), help="sample from the k most likely tokens" + held % "0: all")
    p.add_argument("--top-p", type=float, default=default(1.0),
                   help="nucleus sampling's probability mass" + held % "1: all")
    p.add_argument("--min-p", type=float, default=default(0.0),
                   help="drop tokens less likely than this times the most likely one" + held % "0: none")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default: a random one)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """The flags that shape the HTTP API's answers: `serve`'s and `run-batch`'s."""
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may give the model (the OpenAI API's `model`, gRPC's "
                        "GenerateRequest.model); answers carry the first (default: the config's "
                        "model.served_model_name, else the embedded model's short name or the checkpoint's "
                        "directory or file name)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own chat template (the `chat_template` field, as vLLM's flag "
                        "of this name allows): a template is a program run on the server, in a sandbox")
    p.add_argument("--reasoning-parser", choices=("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "openai_gptoss"),
                   default=None,
                   help="chat answers' thinking (<think>...</think>; openai_gptoss: harmony's analysis messages, "
                        "read without the flag too where the chat template writes harmony) as `reasoning` / "
                        "`reasoning_content` beside the content, whole or streamed, as vLLM's flag of this name gives it")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="taken for vLLM's command lines: tool_choice auto is always served")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                   help="the format the model writes tool calls in (vLLM's flag of this name): auto (default) takes "
                        "the chat template's own where it renders tools (<|tool_call|>: granite; <function=...> "
                        "and <parameter=...> elements: qwen3_coder; <arg_key> and <arg_value> elements: glm45, vLLM's "
                        "glm47 too; <invoke name=...> in <minimax:tool_call>: minimax_m2; <｜tool▁sep｜> blocks: deepseek_v31, or deepseek_v3 with a ```json fence; a <tool_call> "
                        "block: hermes; [TOOL_CALLS]: mistral, "
                        "or mistral_v11 with [ARGS]; a \"parameters\" object: llama3_json; func_name1( or "
                        "<|python_start|>: pythonic, vLLM's llama4_pythonic; gpt-oss's harmony messages: harmony, "
                        "vLLM's openai), else jaxcb renders the tools and asks for hermes")
    p.add_argument("--generation-config", choices=("auto", "none", "vllm"), default="auto",
                   help="the sampling defaults for what a request leaves out (temperature, top_p, top_k, "
                        "min_p, repetition_penalty): auto (default), the model's generation_config.json where it has "
                        "one, as vLLM's flag of this name; none (vllm: vLLM's name), OpenAI's over HTTP, the "
                        "proto's (greedy) over gRPC")
    p.add_argument("--responses-store-mb", type=float, default=64.0,
                   help="MiB of Responses API responses kept for previous_response_id, retrieval and background "
                        "(default 64; the least recently used dropped first; 0 keeps none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxcb", description="jaxcb: LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions offline")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--input", help="JSONL file of requests, one JSON object per line")
    g.add_argument("--output", help="JSONL file for the results (default: stdout)")
    g.add_argument("--stats", action="store_true", help="warm up first, then print one final JSON line of figures")
    g.add_argument("--static", action="store_true", help="static batching (admit a batch only when the last is done)")
    g.add_argument("--adapter", default=None, metavar="NAME",
                   help="the LoRA adapter (a --lora NAME=PATH) the prompt, and input lines without their own \"lora\", "
                        "run with (default: the one --lora given alone, else the base model; \"\" for the base)")
    _add_model_args(g)
    _sampling_args(g)

    s = sub.add_parser("serve", help="serve the model over gRPC and, with --http-port, the OpenAI HTTP API")
    _add_model_args(s)
    _add_api_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics over HTTP on this port")
    s.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (/v1/completions, "
                        "/v1/chat/completions, /v1/responses, /v1/files, /v1/batches, /v1/models, /tokenize, /detokenize, /version, "
                        "/v1/load_lora_adapter, /v1/unload_lora_adapter, /health, /metrics)")
    s.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="publish every page registered in or evicted from the prefix cache as vLLM's KV-cache "
                        "events (msgpack over ZMQ PUB; replays for late subscribers on PORT+1; replica i of "
                        "--data-parallel on PORT+2i), for prefix-aware routers such as llm-d's KV-cache indexer")
    s.add_argument("--kv-events-topic", default=None, metavar="TOPIC",
                   help="the events' ZMQ topic (default: kv@HOSTNAME@MODEL, the first served name)")
    s.add_argument("--tls-cert", "--ssl-certfile", default=None, help="PEM certificate chain (with --tls-key)")
    s.add_argument("--tls-key", "--ssl-keyfile", default=None)
    s.add_argument("--auth-token", "--api-key", action="append", default=None,
                   help="require 'authorization: Bearer TOKEN' on every call but health checks; repeat for several "
                        "tenants (each token sees and aborts only its own requests); default: $JAXCB_AUTH_TOKEN")
    s.add_argument("--batch-files-mb", type=float, default=1024.0,
                   help="MiB of files the Files and Batch APIs keep on disk (uploads, batches' outputs; default 1024; "
                        "0 keeps none)")
    s.add_argument("--dev-routes", action="store_true",
                   help="serve vLLM's development routes (its VLLM_SERVER_DEV_MODE's): POST /reset_prefix_cache, which "
                        "empties the prefix cache while nothing runs (benchmarks between runs), and the RL routes: "
                        "/pause, /resume, /is_paused, /update_weights_from_disk (new weights while serving), "
                        "/sleep, /wake_up, /is_sleeping, /weight_info, /update_weight_version, /weight_checker; off by "
                        "default: any client could "
                        "slow every other")
    s.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="serve POST /start_profile and /stop_profile (vLLM's): a jax.profiler trace of what runs "
                        "between them, written under DIR (TensorBoard's and Perfetto's format; default: no such routes)")
    s.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens each streamed HTTP chunk holds (vLLM's; the first and the last chunks go at once; a "
                        "request's stream_interval may raise it; default 1)")
    s.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="keep the Files and Batch APIs' files and batches in DIR, to outlive the server: a server "
                        "started on it takes them back and batches still running go on (default: a folder of the "
                        "server's own, removed when it stops)")
    s.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight streams get at shutdown")
    s.add_argument("--http-header-timeout", type=float, default=30.0,
                   help="seconds an HTTP connection has to send a request's line and headers, from its opening "
                        "or its last answer, before it is closed (slow or idle clients), and then its body (a 408)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="samples accepted and not yet running (each of a request's n counted) before "
                        "RESOURCE_EXHAUSTED / 429")
    s.add_argument("--max-concurrent-streams", type=int, default=4096, help="calls in progress at once")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the (unauthenticated) metrics port (default: loopback only)")
    s.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: process 0's address for jax.distributed (every process gives the same)")
    s.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in the cluster")
    s.add_argument("--process-id", type=int, default=None, help="multi-host: this process (0 serves, the others follow)")
    s.add_argument("--multihost", action="store_true",
                   help="multi-host with JAX's cluster detection (TPU pods, SLURM, ...) instead of the three above")

    b = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests (vLLM's run-batch) through the "
                                         "HTTP API's handlers, without a server")
    b.add_argument("-i", "--input-file", required=True,
                   help="JSONL: {custom_id, method: POST, url, body} per line (\"-\": stdin)")
    b.add_argument("-o", "--output-file", required=True,
                   help="JSONL: {id, custom_id, response: {status_code, request_id, body}, error} per line, in input "
                        "order (\"-\": stdout)")
    b.add_argument("--max-in-flight", type=int, default=1024,
                   help="lines running at once (default 1024; the engine batches them)")
    _add_model_args(b)
    _add_api_args(b)

    c = sub.add_parser("client", help="stream a completion from a running server")
    c.add_argument("prompt")
    c.add_argument("--target", default="127.0.0.1:50051", help="the server's gRPC address (default 127.0.0.1:50051)")
    c.add_argument("--raw", action="store_true", help="send the text as is (no chat template)")
    c.add_argument("--json", action="store_true", help="print one JSON object per response message")
    c.add_argument("--auth-token", default=os.environ.get("JAXCB_AUTH_TOKEN"),
                   help="the bearer token of a server started with --auth-token (default: $JAXCB_AUTH_TOKEN)")
    c.add_argument("--tls-root-cert", default=None,
                   help="PEM root certificate to trust, for a server started with --tls-cert (connects over TLS)")
    c.add_argument("--timeout", type=float, default=None, help="seconds the call may take (default: none)")
    _sampling_args(c, remote=True)
    cli_tools.add_parsers(sub, _add_model_args)
    return parser


def cmd_serve(args) -> int:
    import asyncio
    import logging

    from jaxcb.llm import build_engines
    from serve.server import run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidConfig("--tls-cert and --tls-key go together")
    if args.kv_events:
        from jaxcb.host.kv_events import endpoints

        endpoints(args.kv_events, 0)  # a malformed endpoint is refused before the weights are read
    if args.batch_dir is not None:
        try:
            os.makedirs(args.batch_dir, exist_ok=True)
        except OSError as e:
            raise InvalidConfig(f"--batch-dir: {args.batch_dir!r} cannot hold the batches' files ({e})") from None
    config, dots, cache_dir = _start(args)
    wrap = None
    if args.multihost or args.coordinator or args.num_processes is not None or args.process_id is not None:
        from jaxcb.device import multihost

        config, wrap = _join_cluster(args, config)
        if not multihost.is_leader():
            return _follow(args, config)
    # A config that cannot fit is refused before the weights are read.
    engines = build_engines(args.model, config, _dtype(args), wrap_runner=wrap,
                            agree_plan=multihost.agree_plan if wrap is not None else None)
    engine = engines[0]
    if wrap is not None:  # every process built the same engine, or none starts
        multihost.check_same_engine(engine.runner.runner, engine.config)  # the leader's ModelRunner
    if args.record_lengths:
        for e in engines:
            e.record_lengths(args.record_lengths)
    options = _server_options(args, host=args.host, port=args.port, metrics_port=args.metrics_port,
                              http_port=args.http_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                              grace_s=args.grace_period, max_waiting=args.max_waiting,
                              auth_token=tuple(args.auth_token or filter(None, [os.environ.get("JAXCB_AUTH_TOKEN")])),
                              max_concurrent_streams=args.max_concurrent_streams, metrics_host=args.metrics_host,
                              kv_events=args.kv_events, kv_events_topic=args.kv_events_topic,
                              http_header_timeout_s=args.http_header_timeout, batch_files_mb=args.batch_files_mb,
                              batch_dir=args.batch_dir, stream_interval=args.stream_interval,
                              profile_dir=args.profile_dir, dev_routes=args.dev_routes)
    names = _announce(args, engines, dots, cache_dir, sys.stdout)
    target = f"{args.host}:{args.port}"
    print(f"jaxcb: try it:  .venv/bin/jaxcb client --target {target} \"Why is the sky blue?\"", flush=True)

    def announce(msg):
        print(msg, flush=True)

    code = asyncio.run(run_server(engines, engine.tokenizer, names, engine.runner.describe()["compute_dtype"],
                                  options, announce))
    if wrap is not None:
        return _leave_cluster(engine.runner, code)
    return code


def cmd_run_batch(args) -> int:
    import asyncio

    from jaxcb.llm import build_engines
    from serve.server import run_batch

    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise InvalidConfig(f"--input-file: {args.input_file!r} is not a file")
    if args.max_in_flight < 1:
        raise InvalidConfig(f"--max-in-flight: must be >= 1, got {args.max_in_flight}")
    folder = os.path.dirname(os.path.abspath(args.output_file))
    if args.output_file != "-" and not os.path.isdir(folder):
        raise InvalidConfig(f"--output-file: the folder {folder!r} does not exist")
    config, dots, cache_dir = _start(args)
    engines = build_engines(args.model, config, _dtype(args))
    # The lines in flight bound the calls and the queue: none is refused as overloaded (each line's samples admitted).
    options = _server_options(args, max_waiting=1 << 30, max_concurrent_streams=args.max_in_flight)
    names = _announce(args, engines, dots, cache_dir, sys.stderr)

    def announce(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        return asyncio.run(run_batch(engines, engines[0].tokenizer, names,
                                     engines[0].runner.describe()["compute_dtype"], options, args.input_file,
                                     args.output_file, args.max_in_flight, announce))
    except BrokenPipeError:  # (-o - into a reader that stopped, `head`: its lines were enough)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _start(args):
    """The engine config, the XLA:CPU dot settings (before the first device call: XLA reads its flags once)
    and the compile cache's folder."""
    from jaxcb.device import compile_cache

    config = _engine_config(args)
    dots = cpu_dots.setup(config.cpu_dots)
    return config, dots, compile_cache.enable(args.compile_cache)


def _server_options(args, **network):
    """ServerOptions from the flags that shape the API's answers (_add_api_args) and `network`'s."""
    from serve.server import ServerOptions

    return ServerOptions(trust_request_chat_template=args.trust_request_chat_template,
                         reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                         generation_config=args.generation_config, responses_store_mb=args.responses_store_mb,
                         **network)


def _announce(args, engines, dots, cache_dir, out) -> tuple[str, ...]:
    """The start banner, to `out`: what is served and how. Returns the names the model is served as."""
    engine = engines[0]
    model_config, tokenizer, config, step = engine.model_config, engine.tokenizer, engine.config, engine.runner.describe()
    if tokenizer is None:
        raise InvalidConfig("model: the file has no tokenizer; the server needs one")

    def say(line):
        print(line, file=out, flush=True)

    names = config.served_model_name or (served_name(args.model),)
    if tokenizer.sampling_defaults and args.generation_config == "auto":
        say("jaxcb: the HTTP API's sampling defaults, from the model's generation_config.json: "
            + ", ".join(f"{k} {v}" for k, v in tokenizer.sampling_defaults.items())
            + " (--generation-config none: OpenAI's)")
    say(f"jaxcb: embeddings (/v1/embeddings, gRPC Embed): {tokenizer.pooling.describe()}")
    if engine.classifier is not None:
        say(f"jaxcb: classifier (/classify, gRPC Classify; /score and /rerank by it where it has one label): "
            f"{engine.classifier.describe()}")
    say(f"jaxcb: model {model_config.name} served as {', '.join(names)} on {step['platform']}, {step['compute_dtype']}; "
        f"{config.num_pages} KV pages of {config.page_size} tokens; policy {config.scheduler.policy}; "
        f"compile cache {cache_dir or 'off'}")
    say(f"jaxcb: step: weights {step['weights']}, KV {step['kv_dtype']}, attention {step['attention']}"
        + (f"; XLA:CPU dots: {dots.describe()}" if step["platform"] == "cpu" else "")
        + ("; compile fast (XLA's backend optimisations off: slower steps)" if config.compile == "fast" else ""))
    if config.chat_template:
        shown = config.chat_template if os.path.isfile(config.chat_template) else "given inline"
        say(f"jaxcb: chat template: {shown} (in place of the model file's)")
    fmt, native = choose_tool_format(tokenizer.chat_template, args.tool_call_parser)
    say(f"jaxcb: tool calls: {fmt.name}, " + ("rendered by the chat template" if native else
                                              "jaxcb's rendering (the chat template does not render tools)"))
    if fmt.harmony or args.reasoning_parser == "openai_gptoss":
        say("jaxcb: chat answers in OpenAI's harmony format: analysis messages as `reasoning`, final ones as the "
            "content, messages to functions as tool calls")
    elif args.reasoning_parser:
        say(f"jaxcb: reasoning parser: {args.reasoning_parser} (chat answers' <think> part as `reasoning`)")
    if engine.describe_speculation():
        say(f"jaxcb: speculative decoding: {engine.describe_speculation()}")
    if len(engines) > 1 or config.tensor_parallel > 1:
        say(f"jaxcb: {len(engines)} replica(s) x tensor parallel {config.tensor_parallel}: devices "
            f"{[e.runner.device_ids for e in engines]}")
    return names


def _join_cluster(args, config):
    """jax.distributed.initialize, then the config for a mesh of every device of every process, and
    the leader's runner wrapper (jaxcb.device.multihost)."""
    import jax

    from jaxcb.device import multihost

    multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    n = jax.device_count()
    if config.data_parallel > 1:
        raise InvalidConfig("parallel.data: data-parallel replicas are not combined with multi-host serving; "
                         "run one server per replica")
    if config.tensor_parallel == 1:
        config = config.replace(tensor_parallel=n)
    elif config.tensor_parallel != n:
        raise InvalidConfig(f"parallel.tensor: multi-host serving splits the model over all {n} devices of the "
                         f"cluster, got {config.tensor_parallel}")
    print(f"jaxcb: process {jax.process_index()} of {jax.process_count()}; tensor parallel {n} over "
          f"{jax.local_device_count()} local devices each", flush=True)

    channels = []  # one for the model's runner and its draft model's: their steps go out in one order

    def wrap(runner, resolved, draft=False):
        if not channels:
            channels.append(_channel(runner, resolved))  # (the model's runner comes first)
        return multihost.LeaderRunner(runner, channels[0], multihost.DRAFT if draft else multihost.TARGET)

    return config, wrap


def _channel(runner, config):
    from jaxcb.device import multihost

    c = runner.model_config
    spec = config.scheduler.speculative
    shapes = config.buckets.shapes(config.page_size, config.max_context_for(c), spec.extra_rows, spec.verify_tokens)
    if spec.method == "draft":  # the draft model's steps (jaxcb.host.draft.DraftProposer.shapes)
        shapes += [s for s in config.buckets.shapes(config.page_size, config.max_context_for(c)) if s not in shapes]
    lora = runner.lora.padded(None) if runner.lora is not None else None  # an empty slot's arrays
    return multihost.Channel(shapes, config.page_size, c.vocab_size, c.sliding_window if c.windowed else 0, lora)


def _follow(args, config) -> int:
    """A follower process: the leader's engine, built by the same function from the same config (its
    weights and pages on this process's devices), mirroring the leader's steps."""
    import jax

    from jaxcb import weight_update
    from jaxcb.device import multihost
    from jaxcb.llm import build_engines

    # The leader registers the adapters and sends each one it puts into a slot: none is read here.
    config = config.replace(lora=dataclasses.replace(config.lora, adapters=()))
    engine = build_engines(args.model, config, _dtype(args), agree_plan=multihost.agree_plan)[0]
    runner = engine.runner
    multihost.check_same_engine(runner, engine.config)
    print(f"jaxcb: process {jax.process_index()} follows process 0", flush=True)
    try:
        steps = multihost.follow(runner, _channel(runner, engine.config), engine.draft_runner,
                                 reload=lambda path: multihost.reload_in_step(
                                     path, lambda p: weight_update.read_checked(engine, p),
                                     lambda params: weight_update.prepare_for([engine], params, True)[0]))
    except Exception as e:  # noqa: BLE001 - the leader is gone or the cluster broke: exit non-zero at once
        print(f"jaxcb: follower {jax.process_index()}: the cluster failed ({e!r}); exiting", flush=True)
        os._exit(1)
    print(f"jaxcb: follower {jax.process_index()}: stopped by the leader after {steps} steps", flush=True)
    jax.distributed.shutdown()
    return 0


def _leave_cluster(runner, code: int) -> int:
    """The leader after its server stopped: on a clean stop, tell the followers to stop; after a
    failure (a process died: the engine thread failed in a collective), exit non-zero at once rather
    than wait on the dead."""
    import jax

    if code != 0:
        print("jaxcb: leaving the cluster after a failure", flush=True)
        os._exit(code)
    runner.stop_followers()
    jax.distributed.shutdown()
    return 0


def cmd_client(args) -> int:
    import grpc

    from serve.client import Client, Result

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    seed=args.seed)
    with Client(args.target, token=args.auth_token, tls_root_cert=args.tls_root_cert) as client:
        try:
            for item in client.generate(args.prompt, chat=not args.raw, max_tokens=args.max_tokens,
                                        stop=args.stop, ignore_eos=args.ignore_eos, timeout=args.timeout,
                                        **sampling):
                if isinstance(item, Result):
                    if args.json:
                        print(json.dumps({"request_id": item.request_id, "finish_reason": item.finish_reason,
                                          "token_ids": item.token_ids, "text": item.text,
                                          "usage": {"prompt_tokens": item.prompt_tokens,
                                                    "completion_tokens": item.completion_tokens,
                                                    "cached_prompt_tokens": item.cached_prompt_tokens}}))
                    else:
                        print(flush=True)
                elif args.json:
                    print(json.dumps({"token_ids": item.token_ids, "text": item.text}), flush=True)
                else:
                    print(item.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"jaxcb client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command in cli_tools.COMMANDS:
            return cli_tools.COMMANDS[args.command](args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "run-batch":
            return cmd_run_batch(args)
        if args.command == "client":
            return cmd_client(args)
    except (JaxcbError, ValueError) as e:  # jaxcb's own kinds, and a bad value from argparse's callers
        print(f"jaxcb {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
