"""The `kvserve` command line. Every flag can also be set by a KVSERVE_* environment variable."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import sys
import threading

from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.sessions.limits import BYTES_PER_TOKEN, TTL_BOUNDS, check_ttl
from kvserve.weights.registry import DEFAULT_MODEL, REGISTRY, is_pulled, kvserve_home, pull, registered_path


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVSERVE_{name}", default)


def _cmd_pull(args: argparse.Namespace) -> int:
    path = pull(args.name, progress=not args.quiet, force=args.force)
    print(path)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from kvserve.weights.loader import recommended_sampling

    print(f"KVSERVE_HOME={kvserve_home()}")
    for model in REGISTRY.values():
        pulled = is_pulled(model)
        print(f"{'pulled ' if pulled else '       '} {model.name:24} {model.description}")
        # What generate and chat sample with: the file's recommended values (the card's where it has
        # none; known once pulled), else the defaults; the flags override each.
        recommended = recommended_sampling(registered_path(model)) if pulled else dict(model.sampling)
        values = {**SAMPLING_DEFAULTS, **recommended}
        source = "the model's recommended values" if recommended else "kvserve's defaults"
        shown = " ".join(f"{name}={value:g}" for name, value in values.items())
        print(f"{'':33}sampling: {shown} ({source}; --temperature, --top-k, --top-p, --min-p override)")
    return 0


def _on_off_auto(value: str) -> bool | None:
    return None if value == "auto" else value == "on"


@contextlib.contextmanager
def _terminal_llm(args: argparse.Namespace, **kwargs):
    """The LLM of `generate` and `chat`: the model flags, one sequence at a time. It closes with Ctrl-C
    ignored: a second one, cutting the engine's shutdown short, aborted the process in torch's teardown."""
    from kvserve.llm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        weights=args.weights,
        activations=args.activations,
        batch_invariant=args.batch_invariant == "on",
        cuda_graphs=args.cuda_graphs == "on",
        async_scheduling=_on_off_auto(args.async_scheduling),
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=1,
        **kwargs,
    )
    try:
        yield llm
    finally:
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            llm.close()
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)


# generate and chat sample as llama.cpp and Ollama do by default (a 135M model decoding greedily
# loops); a model file's own recommended values come before these, the flags before both.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def _sampling_params(args: argparse.Namespace, model_path=None):
    """SamplingParams from the flags, else the model file's recommended values, else SAMPLING_DEFAULTS
    (without `model_path`: the flags' own values checked, before a model loads)."""
    from kvserve.sampling_params import SamplingParams
    from kvserve.weights.loader import recommended_sampling

    values = {**SAMPLING_DEFAULTS, **(recommended_sampling(model_path) if model_path is not None else {})}
    values.update({name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None})
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **values)


def _cmd_generate(args: argparse.Namespace) -> int:
    _sampling_params(args)  # a bad flag is refused before the model loads
    with _terminal_llm(args, session_db=False) as llm:  # one prompt: no session, so no lock on a server's store
        params = _sampling_params(args, llm.model_path)
        if args.raw or llm.tokenizer.chat_template is None:
            chunks = llm.stream(args.prompt, params)
        else:
            chunks = llm.stream_chat([{"role": "user", "content": args.prompt}], params)
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _pipeline_placement(args: argparse.Namespace) -> list[tuple[str, object, object]]:
    """The flags that place a process in a pipeline: (flag, its value, its value for one process)."""
    return [
        ("--nnodes", args.nnodes, 1),
        ("--node-rank", args.node_rank, 0),
        ("--master-addr", args.master_addr, "127.0.0.1"),
        ("--master-port", args.master_port, None),
    ]


def _topology(args: argparse.Namespace):
    """The pipeline the flags (or torchrun's environment) describe, None for one process."""
    from kvserve.pipeline.topology import Topology

    if args.pipeline_parallel <= 1:
        placed = [f for f, v, alone in _pipeline_placement(args) if v != alone]
        if placed:  # a host's command that lost its --pipeline-parallel would serve HTTP on its own
            raise InvalidRequestError(
                f"{', '.join(placed)} place{'s' if len(placed) == 1 else ''} this process in a pipeline, but "
                "--pipeline-parallel is 1; give the number of stages in all, or leave "
                f"{'it' if len(placed) == 1 else 'them'} out."
            )
        return None
    return Topology.from_settings(
        args.pipeline_parallel, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.stage_timeout
    )


def _api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """The --api-key flags, or else KVSERVE_API_KEY's comma-separated keys (spaces around each one
    dropped); an empty flag is refused (a request without a key would match it), and so is a variable
    that is set but names no key (it would turn auth off without a word)."""
    if flags is None:
        value = _env("API_KEY")
        keys = tuple(k.strip() for k in (value or "").split(",") if k.strip())
        if value is not None and not keys:  # also set but empty: `KVSERVE_API_KEY=$UNSET kvserve serve`
            raise InvalidRequestError(
                f"KVSERVE_API_KEY={value!r} names no key; give comma-separated keys, or unset it to serve without auth."
            )
        return keys
    if any(not k.strip() for k in flags):
        raise InvalidRequestError("--api-key is empty; give a key, or leave the flag out to serve without auth.")
    return tuple(flags)


def _origins(value: str) -> tuple[str, ...]:
    """--allowed-origins: '*', or origins as a browser sends them (scheme://host[:port], no path)."""
    origins = tuple(o.strip() for o in value.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise argparse.ArgumentTypeError(
                f"{origin!r} is not an origin; write it as a browser sends it, such as https://chat.example.com "
                "(scheme and host, a port if any, no path), or * for any"
            )
    return origins


SHUTDOWN_GRACE = 2.0  # seconds, past --shutdown-timeout, for the requests then aborted to get their answers


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.server.app import ServerSettings, create_app
    from kvserve.server.body_deadline import head_deadline_protocol

    topology = _topology(args)
    if topology is not None and not topology.hosts_rank0:  # this host serves stages only, no HTTP
        from kvserve.llm import default_device, stage_spec
        from kvserve.pipeline.worker import run_node

        device = default_device()
        spec = stage_spec(
            args.model,
            args.dtype,
            args.weights,
            args.activations,
            args.kv_cache_dtype,
            args.batch_invariant == "on",
            device,
            args.cuda_graphs == "on",
            _on_off_auto(args.async_scheduling),
        )
        return run_node(topology, spec)
    settings = ServerSettings(
        model=args.model,
        served_model_name=args.served_model_name,
        api_keys=_api_keys(args.api_key),
        max_num_seqs=args.max_num_seqs,
        gather_ms=args.gather_ms,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        weights=args.weights,
        activations=args.activations,
        batch_invariant=args.batch_invariant == "on",
        cuda_graphs=args.cuda_graphs == "on",
        async_scheduling=_on_off_auto(args.async_scheduling),
        max_body_bytes=args.max_body_bytes,
        allowed_origins=args.allowed_origins,
        host=args.host,
        max_sessions=args.max_sessions,
        max_sessions_per_key=args.max_sessions_per_key or None,
        session_ttl=args.session_ttl,
        session_db=args.session_db,
        max_session_tokens=args.max_session_tokens,
        max_message_bytes=args.max_message_bytes,
        engine_process=args.engine_process == "on",
        engine_timeout=args.stage_timeout,
        stall_timeout=args.stall_timeout,
        body_timeout=args.body_timeout,
        pipeline=topology,
        log_level=args.log_level,
    )
    # A session store that is not kvserve's (or cannot be opened) stops the server before it starts.
    from kvserve.sessions.store import SessionStore
    from kvserve.weights.registry import kvserve_home

    SessionStore(args.session_db or kvserve_home() / "sessions.db").close()
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # past --shutdown-timeout the requests still running end with a 503 (ServerState.stopping);
        # uvicorn cancels what is left (a 500, a stream cut short) only after this grace for those answers
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE,
        http=head_deadline_protocol(args.body_timeout),
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM/SIGINT: stop accepting, let in-flight requests finish (up to --shutdown-timeout),
            # close the engine, and exit 0 instead of re-raising the signal as uvicorn would.
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()
            app.state.status_feed.close_soon()  # open pages' status streams end rather than hold the shutdown
            app.state.kvserve.stop_requests_in(args.shutdown_timeout)

        def engine_died(self, reason: str) -> None:
            # Nothing can be served without it: exit non-zero, so that a supervisor starts a new server.
            logging.getLogger("kvserve.server").error("%s: the server exits with status 1", reason)
            self.exit_status = 1
            self.should_exit = True

    server = Server(config)
    server.exit_status = 0
    app.state.kvserve.on_fatal = server.engine_died
    from kvserve.processes import freeze_startup_heap
    from kvserve.server.backpressure import listening_socket

    freeze_startup_heap("front end")
    # an engine in this process (--engine-process off) loads later: its heap is frozen once it has
    app.state.kvserve.on_loaded = lambda: freeze_startup_heap("front end and engine")
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:  # in use, not allowed, or a host that does not resolve
        print(f"kvserve: error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    server.run(sockets=[sock])
    return server.exit_status


def _cmd_chat(args: argparse.Namespace) -> int:
    _sampling_params(args)  # a bad flag is refused before the model loads
    with _terminal_llm(args, session_db=False) as llm:
        params = _sampling_params(args, llm.model_path)
        if llm.tokenizer.chat_template is None:
            print("kvserve: error: this model has no chat template; use `kvserve generate --raw`.", file=sys.stderr)
            return 2
        session = llm.session(system=args.system)  # keeps the conversation's KV between turns
        print("Chat with the model. /reset clears the conversation, /exit quits; Ctrl-C stops a reply.")
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:  # as at any other moment: the shell's status for Ctrl-C
                print()
                return 130
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                session.close()
                session = llm.session(system=args.system)
                print("(conversation cleared)")
                continue
            if not line.strip():
                continue
            history = [*session.info()["messages"], {"role": "user", "content": line}]
            need, limit = len(llm.tokenizer.encode_chat(history)) + params.max_tokens, llm.config.max_model_len
            if need > limit:  # refused before it is added: a message without room for its reply would stay
                print(
                    f"kvserve: this line and a reply of up to {params.max_tokens} tokens need {need} tokens, more than "
                    f"the context of {limit}; it was not sent. /reset starts a new conversation.",
                    file=sys.stderr,
                )
                continue
            try:
                session.add_message("user", line)
                for chunk in session.stream(params):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:  # leaving the stream aborts the turn; the chat goes on
                sys.stdout.write(" [stopped]")
            except InvalidRequestError as exc:  # no room for the message or its reply: the chat goes on
                print(f"kvserve: {exc} /reset starts a new conversation.", file=sys.stderr)
                continue
            sys.stdout.write("\n")


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    if not math.isfinite(value):  # nan passes every comparison; inf waits forever
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _at_least(low: int, kind: type = int):
    """An argparse type: a number (of `kind`) no less than `low`."""

    def parse(text: str) -> int | float:
        value = _number(text, kind)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def _above(low: int, kind: type = float):
    """An argparse type: a number (of `kind`) greater than `low`."""

    def parse(text: str) -> int | float:
        value = _number(text, kind)
        if not value > low:
            raise argparse.ArgumentTypeError(f"must be more than {low}, got {text}")
        return value

    return parse


def _port(text: str) -> int:
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 0 to 65535, got {text}")
    return value


class _BadEnvChoice:
    """A KVSERVE_* value outside its flag's choices (argparse never checks a default against them, and
    converts a default that is a string, so this is none); main() refuses it as it would the flag's."""

    def __init__(self, env: str, value: str, choices: tuple) -> None:
        self.env, self.value, self.choices = env, value, choices

    def __str__(self) -> str:  # as --help shows the default
        return self.value


def _session_ttl(text: str) -> float:
    try:
        return check_ttl(float(text), "--session-ttl")
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _flag(
    p: argparse.ArgumentParser,
    flag: str,
    help: str,
    default=None,
    type=str,
    shown_default: str = "%(default)s",
    **kwargs,
) -> None:
    """An option whose default comes from KVSERVE_<FLAG> when set; --help names the variable and
    the default (`shown_default` where the default is decided later)."""
    env = "KVSERVE_" + flag.lstrip("-").replace("-", "_").upper()
    value = os.environ.get(env)
    if value not in (None, ""):
        default = value  # a string: argparse converts it with `type`, and reports a bad one as for the flag
        if "choices" in kwargs and value not in kwargs["choices"]:
            default = _BadEnvChoice(env, value, tuple(kwargs["choices"]))
    p.add_argument(flag, type=type, default=default, help=f"{help} (env {env}; default {shown_default})", **kwargs)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--model", "registered model name, .gguf file or Hugging Face folder", DEFAULT_MODEL)
    _flag(
        p,
        "--dtype",
        "compute dtype; auto picks the measured fastest for the device",
        "auto",
        choices=("auto", "float32", "bfloat16"),
    )
    _flag(
        p,
        "--weights",
        "how weights are kept in memory: q4 (int4 groups of 32; 4-bit GGUF tensors repacked exactly), "
        "q8 (int8 per output row), bf16 or f32 (dequantized; also sets the compute dtype), "
        "auto (each tensor as stored: 4-bit as q4, other quantized types as int8 with a scale per 32, "
        "float as float; on a GPU packed on the device). The choice is logged at start-up",
        "auto",
        choices=("auto", "q4", "q8", "bf16", "f32"),
    )
    _flag(
        p,
        "--activations",
        "inputs of the int4 and int8-group layers (and a quantized lm_head): int8 (quantized per group "
        "of 32 and multiplied in integers, as llama.cpp does: on an AVX2 CPU faster, and as close to "
        "transformers as llama.cpp; on a GPU the int4 layers only, by dp4a), float (the compute dtype: "
        "closest to transformers), or auto (int8 for quantized weights on an AVX2 CPU, else float). "
        "The choice is logged at start-up",
        "auto",
        choices=("auto", "float", "int8"),
    )
    _flag(
        p,
        "--batch-invariant",
        "on: a request's tokens are the same bits whatever it is batched with, after preemption, a "
        "prefix-cache hit or chunking (every row through one arithmetic); off: large batches and fresh "
        "prompts take faster kernels (a GEMM over dequantized weights, a blocked causal attention) whose "
        "rounding depends on the batch",
        "on",
        choices=("on", "off"),
    )
    _flag(
        p,
        "--cuda-graphs",
        "on a GPU: on captures the decode step once per bucket of rows (1, 2, 4, 8, then every 16 up to "
        "--max-num-seqs) at start-up and replays it for every step of that many tokens or fewer (decodes, "
        "short prompts within 1,024 tokens of context), instead of launching each kernel from Python; off "
        "runs every step eagerly (the same tokens, slower)",
        "on",
        choices=("on", "off"),
    )
    _flag(
        p,
        "--async-scheduling",
        "queue decode step n+1 on the device before taking back step n's tokens, so the GPU never waits for "
        "the host's bookkeeping (each request's next token is read on the device; a token past a stop is "
        "computed and dropped); auto: on a GPU (the same tokens either way)",
        "auto",
        choices=("auto", "on", "off"),
    )
    _flag(
        p,
        "--kv-cache-dtype",
        "element type of the KV cache: auto (the compute dtype), float32, bfloat16, or float16 (half the "
        "memory per token, so twice the tokens in the same pool, and less for attention to read, as "
        "llama.cpp's default f16 cache; keys and values are rounded when stored)",
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
    )


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    _flag(p, "--max-tokens", "most tokens to generate per reply", max_tokens, _at_least(1, int))
    for flag, kind, help in (
        ("--temperature", float, "sampling temperature, 0 (or < 1e-5) for greedy: the most likely token each step"),
        ("--top-k", int, "sample among the k most likely tokens, 0 for no limit"),
        ("--top-p", float, "sample among the most likely tokens whose probabilities add up to p, 1 for no limit"),
        ("--min-p", float, "drop tokens less likely than min_p times the most likely one, 0 for none"),
    ):
        fallback = SAMPLING_DEFAULTS[flag[2:].replace("-", "_")]
        _flag(p, flag, help, None, kind, shown_default=f"the model file's recommended value, else {fallback}")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: LLM inference where every request owns its KV cache. "
        "Models are cached in $KVSERVE_HOME (default ~/.cache/kvserve).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a registered model into $KVSERVE_HOME")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(REGISTRY), help="registered model name")
    p.add_argument("--force", action="store_true", help="fetch again even if the file is already there")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("models", help="list the registered models and whether they are pulled")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt", help="the prompt (sent as one user message when the model has a chat template)")
    _add_model_flags(p)
    _add_sampling_flags(p, 256)
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat with streaming replies")
    _add_model_flags(p)
    _add_sampling_flags(p, 512)
    _flag(p, "--system", "system message")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_model_flags(p)
    _flag(
        p,
        "--host",
        "address to bind; on a loopback one (the default) a browser's requests must name this machine in their Host "
        "header (localhost, an IP address, its hostname), so that a page whose name was pointed at 127.0.0.1 cannot "
        "use it (other clients are not checked)",
        "127.0.0.1",
    )
    _flag(p, "--port", "port (0: any free port)", 8000, _port)
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* and /openapi.json (never as ?api_key=, which would "
        "be logged); repeat for several keys (env KVSERVE_API_KEY, comma-separated; default: no auth). "
        "/health and /metrics stay open; /docs and /redoc are off, as a browser cannot send the key. An empty key "
        "(also KVSERVE_API_KEY set but empty) is refused at start.",
    )
    _flag(
        p,
        "--allowed-origins",
        "other sites whose pages may call the API from a browser (CORS), comma-separated, such as "
        "'https://chat.example.com', or '*' for any; none: only the server's own page. A request from another "
        "site's page gets 403 (it could otherwise use the model and, without --api-key, its sessions)",
        "",
        _origins,
        shown_default="none",
    )
    _flag(p, "--served-model-name", "the model name clients use; none means the model file's name")
    _flag(p, "--max-num-seqs", "most requests decoded together in one batch", 64, _at_least(1, int))
    _flag(
        p,
        "--gather-ms",
        "from idle, the first step waits until no request has arrived for this many milliseconds (at most 8x) "
        "so that requests sent together share one prefill; 0 starts at once",
        3.0,
        _at_least(0, float),
    )
    _flag(
        p,
        "--max-queue",
        "requests allowed to wait beyond the batch; more get 429 with Retry-After",
        256,
        _at_least(0, int),
    )
    _flag(
        p,
        "--request-timeout",
        "seconds a request may run before it is aborted with 504",
        600.0,
        _above(0, float),
    )
    _flag(
        p,
        "--kv-cache-tokens",
        "size of the KV pool in tokens, at least one block of 16; none means 1 GiB worth",
        None,
        _at_least(16, int),
    )
    _flag(p, "--max-body-bytes", "largest request body accepted; larger gets 413", 4 << 20, _at_least(1, int))
    _flag(
        p,
        "--body-timeout",
        "seconds a request's head may take to arrive (from the connection, or its last response: else the "
        "connection is closed) and then its body (from its headers: else 408, and the connection is closed)",
        30.0,
        _above(0, float),
    )
    _flag(
        p,
        "--stall-timeout",
        "a stream whose client stops reading pauses its generation once its buffers are full (about 64 "
        "events beyond the connection's 64 KiB send buffer: out of the batch, its KV freed, its place kept) "
        "and resumes when the client reads; paused for this many seconds, it is aborted and frees its slot",
        60.0,
        _above(0, float),
    )
    _flag(
        p,
        "--max-sessions",
        "most sessions, stored ones included; more get 429 (0: sessions off: opening one gets 403, while those an "
        "earlier run stored can still be used and closed)",
        1024,
        _at_least(0, int),
    )
    _flag(
        p,
        "--max-sessions-per-key",
        "most sessions one API key may hold, stored ones included; more get 429; without --api-key all callers are one key "
        "and share this limit (0: no limit)",
        256,
        _at_least(0, int),
    )
    _flag(
        p,
        "--session-db",
        "SQLite file that keeps sessions' transcripts; none means $KVSERVE_HOME/sessions.db. One server owns it "
        "(a lock file beside it); a second one on the same file refuses to start, naming the first",
    )
    _flag(
        p,
        "--max-session-tokens",
        "most tokens one session may hold (its history and the text streamed into it); a message, append or "
        "turn that would exceed it gets 400 and is not applied",
        None,
        _at_least(1, int),
        shown_default="the model's context",
    )
    _flag(
        p,
        "--max-message-bytes",
        "largest text, in UTF-8 bytes, that one session message, append or system prompt may carry (a "
        "session's first messages together); larger gets 400",
        None,
        _at_least(1, int),
        shown_default=f"{BYTES_PER_TOKEN} per token of --max-session-tokens",
    )
    _flag(
        p,
        "--session-ttl",
        f"seconds an idle session lives before it is closed and deleted, {TTL_BOUNDS}; a request's own "
        "ttl is bounded the same",
        3600.0,
        _session_ttl,
    )
    _flag(
        p,
        "--shutdown-timeout",
        "on SIGTERM/SIGINT, seconds to let in-flight requests finish; then each still running is aborted "
        "and answered 503 (a stream: an error event)",
        30.0,
        _at_least(0, float),
    )
    _flag(
        p,
        "--engine-process",
        "on: the engine (model, KV cache, sessions) runs in a process of its own, beside the HTTP front end "
        "(if that process dies, or a pipeline stage is lost, the server exits with status 1, for a supervisor "
        "to restart it); off: in a thread of the server's process",
        "on",
        choices=("on", "off"),
    )
    _flag(
        p,
        "--pipeline-parallel",
        "split the model's layers over N processes (pipeline stages, each its own KV pool for its layers; "
        "torch.distributed over gloo), on this host or, with --nnodes, across hosts; docs/scale-out.md",
        1,
        _at_least(1, int),
    )
    _flag(p, "--nnodes", "hosts the pipeline's stages run on, the same number of stages on each", 1, _at_least(1, int))
    _flag(
        p,
        "--node-rank",
        "this host's place among --nnodes (0: the HTTP server, the engine and the first stages; others "
        "serve their stages only)",
        0,
        _at_least(0, int),
    )
    _flag(p, "--master-addr", "address of node 0, where the stages meet (torchrun's MASTER_ADDR)", "127.0.0.1")
    _flag(
        p,
        "--master-port",
        "port on node 0 where the stages meet (torchrun's MASTER_PORT)",
        None,
        _port,
        shown_default="a free port on one host, 29500 across hosts",
    )
    _flag(
        p,
        "--stage-timeout",
        "seconds without a heartbeat after which a pipeline stage counts as gone, or the engine process as "
        "not answering: requests in flight fail, new ones get 503 and /health says why",
        5.0,
        _above(0, float),
    )
    _flag(p, "--log-level", "server log level", "info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=_cmd_serve)
    return parser


def _reopen_closed_std_streams() -> list[str]:
    """Put /dev/null on a standard descriptor the caller closed (`2>&-`), and return those names: a
    closed one is taken by the next file opened (a lock's, a pipe's), which hung multiprocessing's
    locks when it was stderr's."""
    closed = []
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            setattr(sys, name, open(fd, mode, encoding="utf-8", closefd=False))  # noqa: SIM115 (the process's for good)
            closed.append(name)
    return closed


def _import_torch_keeping_ctrl_c() -> None:
    """torch's import (a second or two) runs C++ that a KeyboardInterrupt raised inside aborts (pybind11's
    "terminate called"): a Ctrl-C meanwhile is kept, and acted on once the import is over."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: pressed.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    closed = _reopen_closed_std_streams()
    parser = build_parser()
    args = parser.parse_args(argv)
    needs = {"generate": "stdout", "models": "stdout", "pull": "stdout", "chat": "stdin"}.get(args.command)
    if needs in closed:
        print(f"kvserve: error: {needs} is closed; {args.command} needs it.", file=sys.stderr)
        return 1
    for value in vars(args).values():
        if isinstance(value, _BadEnvChoice):
            commands = parser._subparsers._group_actions[0].choices  # the command's usage, as its flag's error
            commands[args.command].error(f"{value.env}={value.value!r} is not one of {', '.join(value.choices)}")
    if args.command == "serve":  # say at start-up how the weights are held (kvserve.weights)
        logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
        logging.getLogger("kvserve").setLevel(getattr(logging, args.log_level.upper()))
    try:
        if args.command in ("generate", "chat", "serve"):
            _import_torch_keeping_ctrl_c()
        return args.func(args)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvserve models | head -1`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the machine's files or network, e.g. a KVSERVE_HOME that is not a folder
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # At once, without the interpreter's teardown: an engine thread still loading the model in C++
        # is not torn down under it (that aborted the process: "terminate called without an active
        # exception").
        with contextlib.suppress(Exception):
            sys.stdout.write("\n" if sys.stdout.isatty() else "")
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
