"""Soak test: does `kvserve serve` hold its memory over many HTTP requests?

Starts `python -m kvserve.cli serve` on a free loopback port (the bundled model, or --model), waits
for /health, then sends --requests chat completions of --max-tokens tokens at --concurrency, half
streamed and half not. A share of them (--disconnects) are streams the client drops right after
their first SSE event; another share (--malformed) are bad bodies of several kinds (not JSON, wrong
types, out-of-range values, unknown fields, ...) that must get a 4xx with an OpenAI error body.

After every --checkpoint-every requests it waits for the server to go idle (/metrics: nothing
running or waiting, no KV block used, up to --idle-timeout s) and records the server's RSS
(/proc/<pid>/status VmRSS, children included), its thread count, the KV blocks in use and the
running requests from /metrics, the responses by kind (status + error type; 5xx, non-JSON error
bodies and transport errors counted apart) and the latency percentiles of that batch. At the end:
the RSS slope in MB per 1,000 requests fitted over the checkpoints from --warmup requests on,
p50/p99 latency and totals. Writes JSON (bench/results/soak.json by default) and prints a table.
Bounded: it stops sending after --max-time seconds and always kills the server.
Smoke test: `python bench/soak.py --quick` (600 requests, checkpoints every 100).

A batch that has not finished --batch-deadline seconds after it started is reported while it goes on:
each request still out (its X-Request-Id is soak-<i>) with what the client has seen of it (waiting for
the answer's headers, or streaming: events so far, seconds since the last) and what the server says of
it (GET /v1/requests/soak-<i>: queued, preempted, prefill, decoding..., tokens, KV blocks), and the
engine's view (/metrics' running / waiting / paused, the engine view's queues and request states).

--faults adds a fault phase on a server of its own (faults.py in this folder; R8 in docs/reliability.md):
SIGSTOP and SIGCONT of the engine process, clients that never read their streams, SIGKILL of the
engine process (the server must exit non-zero; the soak restarts it, as a supervisor would), and a full
session store (a file-size limit on the server's process); then it restarts the server once more and
reads back every session write that was acknowledged. It reports the requests acknowledged, the
acknowledged writes lost (must be 0) and the worst hang (the longest a request waited without a byte
of its answer; must be under --stage-timeout + 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import WORDS, free_port, percentile

DEFAULT_OUT = Path(__file__).parent / "results" / "soak.json"
MAX_STUCK_REPORTED = 20  # requests described per stalled batch
MODEL_NAME = "soak"
CHAT_PATH = "/v1/chat/completions"


# ----- server process -------------------------------------------------------------------------
def start_server(args: argparse.Namespace, port: int) -> tuple[subprocess.Popen, float]:
    """Start `kvserve serve` on 127.0.0.1:port; return it and the seconds until /health answered 200."""
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
    cmd += ["--max-num-seqs", str(max(64, args.concurrency))]
    cmd += args.server_arg
    env = dict(os.environ)
    for item in args.server_env:
        key, _, value = item.partition("=")
        env[key] = value
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if args.server_log else subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - start < args.startup_timeout:
        if proc.poll() is not None:
            detail = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else f"see {args.server_log}"
            raise RuntimeError(f"server exited with {proc.returncode}: {detail}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    kill_server(proc)
    raise RuntimeError(f"server did not become ready in {args.startup_timeout:g} s")


def kill_server(proc: subprocess.Popen) -> int | None:
    """SIGTERM, then SIGKILL after 20 s; the server's own children go with it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def process_memory(pid: int) -> dict[str, Any]:
    """VmRSS / VmHWM / threads of the server, plus the RSS of its descendants (e.g. a compiler)."""
    status = _status(pid)
    rss_kb = int(status["VmRSS"].split()[0])
    children_kb, stack, seen = 0, _children(pid), set()
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        try:
            children_kb += int(_status(child).get("VmRSS", "0 kB").split()[0])
        except (OSError, ValueError):
            continue
        stack += _children(child)
    return {
        "rss_mb": (rss_kb + children_kb) / 1024,
        "server_rss_mb": rss_kb / 1024,
        "children_rss_mb": children_kb / 1024,
        "num_children": len(seen),
        "hwm_mb": int(status["VmHWM"].split()[0]) / 1024,
        "threads": int(status["Threads"]),
        "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            values[name] = float(value)
    return values


async def wait_idle(client: httpx.AsyncClient, base: str, timeout: float) -> dict[str, Any]:
    """Poll /metrics until nothing runs or waits and no KV block is used; the last figures seen."""
    deadline = time.perf_counter() + timeout
    start = time.perf_counter()
    m: dict[str, float] = {}
    while True:
        try:
            m = parse_metrics((await client.get(base + "/metrics", timeout=5)).text)
        except httpx.HTTPError:
            m = {}
        idle = (
            m.get("kvserve_requests_running") == 0
            and m.get("kvserve_requests_waiting") == 0
            and m.get("kvserve_kv_blocks_used") == 0
        )
        if idle or time.perf_counter() >= deadline:
            break
        await asyncio.sleep(0.1)
    return {
        "idle": idle,
        "idle_wait_s": round(time.perf_counter() - start, 3),
        "kv_blocks_used": m.get("kvserve_kv_blocks_used"),
        "kv_blocks_cached": m.get("kvserve_kv_blocks_cached"),
        "requests_running": m.get("kvserve_requests_running"),
        "requests_waiting": m.get("kvserve_requests_waiting"),
        "requests_aborted_total": m.get("kvserve_requests_aborted_total"),
        "sessions_active": m.get("kvserve_sessions_active"),
    }


# ----- requests ---------------------------------------------------------------------------------
def chat_body(rng: random.Random, i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": f"{i}: {words}"}],
        "max_tokens": max_tokens,
        "temperature": rng.choice([0, 0.7]),
        "ignore_eos": True,
        "stream": stream,
    }


MALFORMED_KINDS = (
    "bad_json",
    "truncated_json",
    "not_an_object",
    "wrong_type_messages",
    "wrong_type_max_tokens",
    "out_of_range_temperature",
    "out_of_range_n",
    "out_of_range_max_tokens",
    "unknown_field",
    "bad_role",
    "empty_messages",
)


def malformed_body(kind: str, rng: random.Random, i: int, max_tokens: int) -> bytes:
    """A body of the given kind of mistake; each must be answered with a 4xx error body."""
    good = chat_body(rng, i, max_tokens, stream=rng.random() < 0.5)
    if kind == "bad_json":
        return b'{"messages": [{"role": "user", "content": "hi"}], max_tokens: 16'
    if kind == "truncated_json":
        return json.dumps(good).encode()[: rng.randint(5, 40)]
    if kind == "not_an_object":
        return json.dumps([good]).encode()
    if kind == "wrong_type_messages":
        good["messages"] = "hello there"
    elif kind == "wrong_type_max_tokens":
        good["max_tokens"] = "sixteen"
    elif kind == "out_of_range_temperature":
        good["temperature"] = -1.5
    elif kind == "out_of_range_n":
        good["n"] = 1000
    elif kind == "out_of_range_max_tokens":
        good["max_tokens"] = 10**9
    elif kind == "unknown_field":
        good["frobnicate"] = {"level": 11}
    elif kind == "bad_role":
        good["messages"] = [{"role": "wizard", "content": "hi"}]
    elif kind == "empty_messages":
        good["messages"] = []
    return json.dumps(good).encode()


def plan_requests(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, detail) of every request, shuffled: normal stream/json, disconnect, malformed:<kind>."""
    rng = random.Random(args.seed)
    normal = args.requests - args.disconnects - args.malformed
    if normal < 0:
        raise SystemExit("--disconnects + --malformed exceed --requests")
    plan = [("disconnect", "stream")] * args.disconnects
    plan += [("malformed", MALFORMED_KINDS[k % len(MALFORMED_KINDS)]) for k in range(args.malformed)]
    plan += [("normal", "stream" if rng.random() < args.stream_share else "json") for _ in range(normal)]
    rng.shuffle(plan)
    return plan


def _error_key(response: httpx.Response, body: bytes) -> tuple[str, bool]:
    """'<status> <error type>' and whether the body is the OpenAI error JSON."""
    try:
        error = json.loads(body)["error"]
        return f"{response.status_code} {error['type']}", True
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} non-json", False


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    detail: str,
    i: int,
    args: argparse.Namespace,
    rng: random.Random,
    inflight: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Send request i (X-Request-Id soak-<i>); return its outcome: {kind, detail, key, ok, latency_s, ...}.
    While it runs, `inflight[i]` says what the client has seen of it (for a stalled batch's report)."""
    out: dict[str, Any] = {"kind": kind, "detail": detail}
    start = time.perf_counter()
    seen = {"kind": kind, "detail": detail, "started": start, "phase": "waiting for headers", "events": 0}
    if inflight is not None:
        inflight[i] = seen
    headers = {"x-request-id": f"soak-{i}"}
    try:
        if kind == "malformed":
            body = malformed_body(detail, rng, i, args.max_tokens)
            response = await client.post(url, content=body, headers={"content-type": "application/json", **headers})
            out["key"], out["json_error"] = _error_key(response, response.content)
            out["ok"] = 400 <= response.status_code < 500 and out["json_error"]
        elif detail == "json":
            response = await client.post(url, json=chat_body(rng, i, args.max_tokens, stream=False), headers=headers)
            if response.status_code == 200:
                usage = response.json()["usage"]
                out["key"], out["ok"] = "200", usage["completion_tokens"] == args.max_tokens
                out["tokens"] = usage["completion_tokens"]
            else:
                out["key"], out["json_error"] = _error_key(response, response.content)
                out["ok"] = False
        else:  # a stream, read to the end or dropped after its first event
            body = chat_body(rng, i, args.max_tokens, stream=True)
            events = 0
            async with client.stream("POST", url, json=body, headers=headers) as response:
                seen["phase"] = "streaming"
                if response.status_code != 200:
                    raw = await response.aread()
                    out["key"], out["json_error"] = _error_key(response, raw)
                    out["ok"] = False
                else:
                    stream_error = finish = None
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        events += 1
                        seen["events"], seen["last_event"] = events, time.perf_counter()
                        event = json.loads(line[6:])
                        if "error" in event:
                            stream_error = event["error"].get("type", "?")
                        elif event.get("choices"):
                            finish = event["choices"][0]["finish_reason"] or finish
                        if events == 1 and kind == "disconnect":
                            break  # leaving the block closes the connection mid-stream
                    out["events"] = events
                    if stream_error is not None:
                        out["key"], out["ok"] = f"200 stream-error {stream_error}", False
                    else:
                        out["key"] = "200"
                        # ignore_eos: a whole stream ends at max_tokens (a token whose text is held back sends no event)
                        out["ok"] = events >= 1 if kind == "disconnect" else finish == "length"
    except httpx.HTTPError as exc:
        out["key"], out["ok"] = f"transport {type(exc).__name__}", False
    finally:
        if inflight is not None:
            inflight.pop(i, None)
    out["latency_s"] = time.perf_counter() - start
    return out


async def run_batch(
    client: httpx.AsyncClient,
    base: str,
    plan: list[tuple[str, str]],
    first: int,
    args,
    rng,
    deadline: float,
    stalls: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Run `plan`'s requests at --concurrency. Whenever the batch has run --batch-deadline seconds more
    without finishing, report what is stuck (appended to `stalls`, and printed) and go on waiting."""
    queue: asyncio.Queue = asyncio.Queue()
    for k, item in enumerate(plan):
        queue.put_nowait((first + k, item))
    results: list[dict[str, Any]] = []
    inflight: dict[int, dict[str, Any]] = {}

    async def worker() -> None:
        while not queue.empty() and time.perf_counter() < deadline:
            i, (kind, detail) = queue.get_nowait()
            results.append(await one_request(client, base + CHAT_PATH, kind, detail, i, args, rng, inflight))

    workers = {asyncio.ensure_future(worker()) for _ in range(args.concurrency)}
    started = time.perf_counter()
    while workers:
        done, workers = await asyncio.wait(workers, timeout=args.batch_deadline)
        for task in done:
            task.result()
        if workers:
            stalls.append(await report_stuck(client, base, inflight, first, time.perf_counter() - started))
    return results


async def report_stuck(
    client: httpx.AsyncClient, base: str, inflight: dict[int, dict[str, Any]], first: int, waited: float
) -> dict[str, Any]:
    """What the requests still out are doing: the client's side, the server's (GET /v1/requests/{id}),
    and the engine's view (/metrics, the first event of /v1/engine/events)."""
    now = time.perf_counter()
    stuck = []
    for i, seen in sorted(inflight.items())[:MAX_STUCK_REPORTED]:
        entry: dict[str, Any] = {
            "request_id": f"soak-{i}",
            "kind": f"{seen['kind']} {seen['detail']}",
            "age_s": round(now - seen["started"], 2),
            "client": seen["phase"],
            "events": seen["events"],
        }
        if "last_event" in seen:
            entry["since_last_event_s"] = round(now - seen["last_event"], 2)
        try:
            r = await client.get(f"{base}/v1/requests/soak-{i}", timeout=5)
            status = r.json()
            entry["server"] = (
                {k: status.get(k) for k in ("state", "num_output_tokens", "kv_blocks")}
                if r.status_code == 200
                else f"{r.status_code} {status.get('error', {}).get('message', '')[:120]}"
            )
        except (httpx.HTTPError, ValueError) as exc:
            entry["server"] = f"no answer ({type(exc).__name__})"
        stuck.append(entry)
    engine: dict[str, Any] = {}
    try:
        m = parse_metrics((await client.get(base + "/metrics", timeout=5)).text)
        engine["metrics"] = {
            key: m.get(f"kvserve_{key}")
            for key in ("requests_running", "requests_waiting", "requests_paused", "kv_blocks_used")
        }
    except httpx.HTTPError as exc:
        engine["metrics"] = f"no answer ({type(exc).__name__})"
    engine["view"] = await engine_view(client, base)
    report = {
        "batch_first": first,
        "waited_s": round(waited, 1),
        "num_out": len(inflight),
        "stuck": stuck,
        "engine": engine,
    }
    print(f"batch from {first}: {len(inflight)} requests still out after {waited:.0f} s; engine: {engine}")
    for entry in stuck:
        print(f"  {entry}")
    return report


async def engine_view(client: httpx.AsyncClient, base: str) -> dict[str, Any] | str:
    """A summary of the engine's view (its first event on /v1/engine/events): queues, request states."""
    try:
        async with asyncio.timeout(5):
            async with client.stream("GET", base + "/v1/engine/events") as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        view = json.loads(line[6:])
                        states = collections.Counter(r["state"] for r in view.get("requests", []))
                        return {
                            "running": len(view.get("running", [])),
                            "waiting": len(view.get("waiting", [])),
                            "request_states": dict(states),
                            "pool": view.get("pool"),
                        }
    except (TimeoutError, httpx.HTTPError, ValueError) as exc:
        return f"no answer ({type(exc).__name__})"
    return "no event"


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    keys = collections.Counter(f"{r['kind']}: {r['key']}" for r in results)
    normal = [r["latency_s"] for r in results if r["kind"] == "normal" and r["ok"]]
    return {
        "requests": len(results),
        "unexpected": sum(1 for r in results if not r["ok"]),
        "server_errors_5xx": sum(1 for r in results if r["key"][:1] == "5"),
        "non_json_error_bodies": sum(1 for r in results if r.get("json_error") is False),
        "transport_errors": sum(1 for r in results if r["key"].startswith("transport")),
        "by_kind": dict(sorted(keys.items())),
        "latency_p50_s": round(percentile(normal, 50), 4),
        "latency_p90_s": round(percentile(normal, 90), 4),
        "latency_p99_s": round(percentile(normal, 99), 4),
        "latency_max_s": round(max(normal), 4) if normal else None,
    }


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of RSS (MB) over requests, in MB per 1,000 requests."""
    if len(points) < 2:
        return None
    xs, ys = [p[0] / 1000 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


async def soak(args: argparse.Namespace, proc: subprocess.Popen, base: str) -> dict[str, Any]:
    plan = plan_requests(args)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.client_timeout, connect=10)
    checkpoints: list[dict[str, Any]] = []
    everything: list[dict[str, Any]] = []
    stalls: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        idle = await wait_idle(client, base, args.idle_timeout)
        checkpoints.append({"requests_done": 0, "elapsed_s": 0.0, **process_memory(proc.pid), **idle})
        print(
            f"{'done':>6} {'rss MB':>8} {'threads':>7} {'kv used':>7} {'running':>7} {'p50 ms':>7} {'p99 ms':>7} unexpected"
        )
        print(f"{0:>6} {checkpoints[0]['rss_mb']:8.1f} {checkpoints[0]['threads']:7d}")
        start = time.perf_counter()
        deadline = start + args.max_time
        done = 0
        while done < len(plan) and time.perf_counter() < deadline:
            batch = plan[done : done + args.checkpoint_every]
            results = await run_batch(client, base, batch, done, args, rng, deadline, stalls)
            done += len(results)
            everything += results
            if proc.poll() is not None:
                checkpoints.append({"requests_done": done, "server_exited": proc.returncode})
                break
            idle = await wait_idle(client, base, args.idle_timeout)
            point = {
                "requests_done": done,
                "elapsed_s": round(time.perf_counter() - start, 2),
                **process_memory(proc.pid),
                **idle,
                **summarize(results),
            }
            checkpoints.append(point)
            print(
                f"{done:6d} {point['rss_mb']:8.1f} {point['threads']:7d} {point['kv_blocks_used'] or 0:7.0f} "
                f"{point['requests_running'] or 0:7.0f} {point['latency_p50_s'] * 1e3:7.0f} "
                f"{point['latency_p99_s'] * 1e3:7.0f} {point['unexpected']}",
                flush=True,
            )
    after = [c for c in checkpoints if "rss_mb" in c and c["requests_done"] >= args.warmup]
    fit = [(c["requests_done"], c["rss_mb"]) for c in after]
    # the server alone: a child (the C++ extension's compiler on a first start) can dwarf the trend
    server_fit = [(c["requests_done"], c["server_rss_mb"]) for c in after]
    rss = [c["rss_mb"] for c in checkpoints if "rss_mb" in c]
    return {
        "checkpoints": checkpoints,
        "stalls": stalls,
        "totals": {
            **summarize(everything),
            "wall_s": round(time.perf_counter() - start, 1),
            "stopped_by_time_limit": done < len(plan) and proc.poll() is None,
        },
        "rss": {
            "start_mb": round(rss[0], 1),
            "end_mb": round(rss[-1], 1),
            "max_mb": round(max(rss), 1),
            "slope_mb_per_1000_after_warmup": None if (s := slope_per_1000(fit)) is None else round(s, 2),
            "server_slope_mb_per_1000_after_warmup": None if (s := slope_per_1000(server_fit)) is None else round(s, 2),
            "max_children_rss_mb": round(max(c.get("children_rss_mb", 0) for c in checkpoints), 1),
            "fit_points": len(fit),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="model for `kvserve serve --model` (name, .gguf or HF folder); default: bundled"
    )
    parser.add_argument("--requests", type=int, default=10_000, help="requests in all (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default %(default)s)")
    parser.add_argument(
        "--disconnects", type=int, default=1000, help="streams dropped after their first event (default %(default)s)"
    )
    parser.add_argument("--malformed", type=int, default=500, help="malformed request bodies (default %(default)s)")
    parser.add_argument(
        "--stream-share", type=float, default=0.5, help="share of normal requests that stream (default %(default)s)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=1000, help="requests between RSS checkpoints (default %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2000, help="requests before the RSS slope is fitted (default %(default)s)"
    )
    parser.add_argument(
        "--idle-timeout", type=float, default=5.0, help="seconds to wait for an idle server per checkpoint"
    )
    parser.add_argument("--max-time", type=float, default=3600.0, help="stop sending after this many seconds")
    parser.add_argument(
        "--batch-deadline",
        type=float,
        default=120.0,
        help="seconds a batch may run before what is stuck in it is reported (again every as many seconds)",
    )
    parser.add_argument("--faults", action="store_true", help="add the fault phase (faults.py) on a server of its own")
    parser.add_argument(
        "--stage-timeout",
        type=float,
        default=2.0,
        help="the fault phase server's --stage-timeout (default %(default)s)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=3.0,
        help="the fault phase server's --stall-timeout (default %(default)s)",
    )
    parser.add_argument("--client-timeout", type=float, default=120.0, help="per-request client timeout in seconds")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra argument for `kvserve serve` (repeatable)"
    )
    parser.add_argument(
        "--server-env", action="append", default=[], help="KEY=VALUE for the server's environment (repeatable)"
    )
    parser.add_argument("--server-log", default=None, help="file for the server's output (default: discarded)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request plan and prompts")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 600 requests (60 dropped, 30 malformed), checkpoints every 100",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output (default %(default)s)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.disconnects, args.malformed = 600, 60, 30
        args.checkpoint_every, args.warmup = 100, 200
    if args.model and Path(args.model).exists():
        args.model = str(Path(args.model).resolve())

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc, ready_s = start_server(args, port)
    try:
        result = asyncio.run(soak(args, proc, base))
    finally:
        returncode = kill_server(proc)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "model": args.model or "(bundled default)",
        "settings": {
            k: getattr(args, k)
            for k in (
                "requests",
                "concurrency",
                "max_tokens",
                "disconnects",
                "malformed",
                "stream_share",
                "checkpoint_every",
                "warmup",
                "idle_timeout",
                "max_time",
                "server_arg",
                "server_env",
                "seed",
                "quick",
                "batch_deadline",
                "faults",
            )
        },
        "server": {"ready_s": round(ready_s, 2), "exit_code": returncode},
        **result,
    }
    if args.faults:
        from faults import run_faults

        report["faults"] = asyncio.run(run_faults(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    t, r = report["totals"], report["rss"]
    print(
        f"{t['requests']} requests in {t['wall_s']} s: p50 {t['latency_p50_s'] * 1e3:.0f} ms, "
        f"p99 {t['latency_p99_s'] * 1e3:.0f} ms; unexpected {t['unexpected']}, 5xx {t['server_errors_5xx']}, "
        f"non-JSON errors {t['non_json_error_bodies']}, transport errors {t['transport_errors']}"
    )
    print(
        f"RSS {r['start_mb']} -> {r['end_mb']} MB (max {r['max_mb']}); slope after {args.warmup} requests: "
        f"{r['slope_mb_per_1000_after_warmup']} MB per 1,000 requests "
        f"(server alone {r['server_slope_mb_per_1000_after_warmup']}; children up to {r['max_children_rss_mb']} MB)"
    )
    if args.faults:
        f = report["faults"]
        print(
            f"fault phase: {f['requests_sent']} requests, {f['requests_acknowledged']} acknowledged; "
            f"{f['writes_acknowledged']} session writes acknowledged, {f['writes_lost']} lost; worst hang "
            f"{f['worst_hang_s']} s (bound {f['hang_bound_s']} s): {'passed' if f['passed'] else 'FAILED'}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
