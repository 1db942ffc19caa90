"""The soak's fault phase (`python bench/soak.py --faults`): guarantee R8 under real faults.

One `kvserve serve` of its own (--stage-timeout and --stall-timeout from the soak's flags, a session
store in a temporary folder) and a light mixed load beside each fault: streamed and unstreamed chat
completions, and session writes (a create with a system prompt, then messages), each acknowledged
write recorded. In turn:

1. stop: SIGSTOP of the engine process for --stage-timeout + 1.5 s, then SIGCONT. Requests in flight
   must end with an error once the timeout has passed, new ones get 503 at once, then it serves again.
2. readers: clients that never read their streams; their generation pauses, a new request still gets
   its tokens, and after --stall-timeout their requests are aborted (/metrics: paused back to 0).
3. kill: SIGKILL of the engine process; the server must exit non-zero; the soak starts it again (the
   supervisor's part) on the same store.
4. full: the server started again under a file-size limit (RLIMIT_FSIZE) a little above its store's
   size; writes until the store refuses (503 session_store_error), /health must say so, DELETE is tried.
Then a last restart without the limit reads back every acknowledged write: any missing is lost.

The worst hang is the longest any request of the load waited without a byte of its answer (headers,
an event, the body): it must stay under --stage-timeout + 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import WORDS, free_port

MODEL_NAME = "soak"
LOAD_WORKERS = 6
SILENT_STREAMS = 12


class Server:
    """`kvserve serve` with the fault phase's flags; `start` waits for /health."""

    def __init__(self, args, db: Path) -> None:
        self.args, self.db = args, db
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, file_limit: int | None = None) -> float:
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        cmd += ["--served-model-name", MODEL_NAME, "--session-db", str(self.db)]
        cmd += ["--stage-timeout", str(self.args.stage_timeout), "--stall-timeout", str(self.args.stall_timeout)]
        if self.args.model:
            cmd += ["--model", self.args.model]

        def limit() -> None:  # the store's file may grow this far, no further (EFBIG, not a signal)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

        started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit if file_limit else None
        )
        while time.perf_counter() - started < self.args.startup_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            time.sleep(0.1)
        raise RuntimeError("the server did not become ready")

    def engine_pid(self) -> int:
        """The engine process: the server's child that multiprocessing spawned."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                        if b"spawn_main" in cmdline.read():
                            return int(child)
        raise RuntimeError("no engine process")

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return None if self.proc is None else self.proc.returncode


class Load:
    """A light mixed load on `server.base`, LOAD_WORKERS at a time, until stopped; every request's
    outcome and longest wait without a byte, and every acknowledged session write (`ledger`)."""

    def __init__(self, server: Server, ledger: dict[str, list[str]], rng: random.Random) -> None:
        self.server, self.ledger, self.rng = server, ledger, rng
        self.outcomes: list[dict[str, Any]] = []
        self.running = False
        self._tasks: list[asyncio.Task] = []

    def start(self, client: httpx.AsyncClient) -> None:
        self.running = True
        self._tasks = [asyncio.ensure_future(self._worker(client)) for _ in range(LOAD_WORKERS)]

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self._tasks)

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while self.running:
            pick = self.rng.random()
            if pick < 0.4:
                outcome = await self._stream(client)
            elif pick < 0.7:
                outcome = await self._json(client)
            else:
                outcome = await self._write(client)
            self.outcomes.append(outcome)
            if outcome["status"] == "refused":  # the server is down (killed, restarting): not a hang
                await asyncio.sleep(0.2)
            elif outcome["status"] != 200:  # refused at once (503 while the engine does not answer)
                await asyncio.sleep(0.05)

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    async def _send(self, client: httpx.AsyncClient, kind: str, method: str, path: str, body: dict) -> dict:
        """One request; its status, its longest wait without a byte, the parsed body or its SSE events."""
        outcome: dict[str, Any] = {"kind": kind, "started": time.perf_counter()}
        last = outcome["started"]
        worst = 0.0
        try:
            async with client.stream(method, self.server.base + path, json=body) as response:
                worst = time.perf_counter() - last
                last = time.perf_counter()
                outcome["status"] = response.status_code
                lines = []
                async for line in response.aiter_lines():
                    worst, last = max(worst, time.perf_counter() - last), time.perf_counter()
                    lines.append(line)
        except httpx.ConnectError:
            outcome["status"] = "refused"
            lines = []
        except httpx.HTTPError as exc:
            outcome["status"] = f"transport {type(exc).__name__}"
            lines = []
        outcome["worst_wait_s"] = max(worst, time.perf_counter() - last)
        outcome["ended"] = time.perf_counter()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        if events:
            outcome["error"] = next((json.loads(e)["error"]["type"] for e in events if '"error"' in e[:12]), None)
            outcome["done"] = events[-1] == "[DONE]"
        elif lines:
            with contextlib.suppress(ValueError):
                outcome["body"] = json.loads("\n".join(lines))
        return outcome

    async def _stream(self, client: httpx.AsyncClient) -> dict:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": self._words(8)}], "max_tokens": 24}
        return await self._send(client, "stream", "POST", "/v1/chat/completions", {**body, "stream": True})

    async def _json(self, client: httpx.AsyncClient) -> dict:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": self._words(8)}], "max_tokens": 8}
        return await self._send(client, "json", "POST", "/v1/chat/completions", body)

    async def _write(self, client: httpx.AsyncClient) -> dict:
        """A session write: a new session (a system prompt of ~2 KB) or a message to one of ours."""
        if len(self.ledger) < 5 or self.rng.random() < 0.4:
            system = f"{len(self.ledger)} " + self._words(300)
            outcome = await self._send(client, "create", "POST", "/v1/sessions", {"system": system})
            if outcome["status"] == 200 and "body" in outcome:
                self.ledger[outcome["body"]["id"]] = [system]
            return outcome
        session_id = self.rng.choice(list(self.ledger))
        content = self._words(40)
        path = f"/v1/sessions/{session_id}/messages"
        outcome = await self._send(client, "message", "POST", path, {"role": "user", "content": content})
        if outcome["status"] == 200:
            self.ledger[session_id].append(content)
        return outcome


def _silent_stream(base: str) -> socket.socket:
    """A streaming request whose client never reads (a receive buffer of a few KB)."""
    port = int(base.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


async def _metric(client: httpx.AsyncClient, base: str, name: str) -> float | None:
    with contextlib.suppress(httpx.HTTPError):
        for line in (await client.get(base + "/metrics", timeout=5)).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return None


async def _wait_for(condition, timeout: float) -> float | None:
    """Seconds until `await condition()` was true, or None after `timeout`."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if await condition():
            return time.perf_counter() - started
        await asyncio.sleep(0.1)
    return None


async def _health(client: httpx.AsyncClient, base: str) -> tuple[int | str, str | None]:
    try:
        r = await client.get(base + "/health", timeout=10)
        return r.status_code, r.json().get("detail")
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}", None


async def run_faults(args) -> dict[str, Any]:
    rng = random.Random(args.seed + 7)
    ledger: dict[str, list[str]] = {}
    phases: dict[str, Any] = {}
    all_outcomes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-faults-") as folder:
        server = Server(args, Path(folder) / "sessions.db")
        phases["ready_s"] = round(server.start(), 2)
        timeout = httpx.Timeout(60, connect=5)
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
            try:
                for name, phase in (("stop", _stop), ("readers", _readers), ("kill", _kill), ("full", _full)):
                    load = Load(server, ledger, rng)
                    load.start(client)
                    try:
                        phases[name] = await phase(client, server, load)
                    finally:
                        await load.stop()
                    phases[name]["load"] = _summary(load.outcomes)
                    all_outcomes += load.outcomes
                    print(f"fault phase {name}: {phases[name]}", flush=True)
                server.stop()
                server.start()  # the last restart: every acknowledged write must be there
                phases["lost"] = await _read_back(client, server.base, ledger)
            finally:
                phases["exit_code"] = server.stop()
    acknowledged = sum(1 for o in all_outcomes if o["status"] == 200)
    writes = sum(len(contents) for contents in ledger.values())
    worst = max(all_outcomes, key=lambda o: o["worst_wait_s"])
    result = {
        "settings": {"stage_timeout": args.stage_timeout, "stall_timeout": args.stall_timeout},
        "requests_sent": len(all_outcomes),
        "requests_acknowledged": acknowledged,
        "writes_acknowledged": writes,
        "writes_lost": len(phases["lost"]),
        "worst_hang_s": round(worst["worst_wait_s"], 3),
        "worst_hang_request": {k: worst.get(k) for k in ("kind", "status", "error")},
        "hang_bound_s": args.stage_timeout + 1.0,
        "phases": phases,
    }
    result["passed"] = result["writes_lost"] == 0 and result["worst_hang_s"] < result["hang_bound_s"]
    return result


def _summary(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    keys: dict[str, int] = {}
    for o in outcomes:
        key = f"{o['kind']} {o['status']}" + (f" {o['error']}" if o.get("error") else "")
        keys[key] = keys.get(key, 0) + 1
    return {
        "requests": len(outcomes),
        "by_outcome": dict(sorted(keys.items())),
        "worst_wait_s": round(max((o["worst_wait_s"] for o in outcomes), default=0.0), 3),
    }


async def _stop(client: httpx.AsyncClient, server: Server, load: Load) -> dict[str, Any]:
    await asyncio.sleep(1.0)
    engine = server.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    stopped_at = time.perf_counter()
    try:
        await asyncio.sleep(server.args.stage_timeout + 0.5)
        health = await _health(client, server.base)  # past the timeout: 503 with the reason
        started = time.perf_counter()
        r = await client.post(
            server.base + "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        refused = {"status": r.status_code, "seconds": round(time.perf_counter() - started, 3)}
        await asyncio.sleep(max(0.0, server.args.stage_timeout + 1.5 - (time.perf_counter() - stopped_at)))
    finally:
        os.kill(engine, signal.SIGCONT)
    recovered = await _wait_for(lambda: _is_healthy(client, server.base), 30)
    await asyncio.sleep(1.0)
    return {"health_while_stopped": health, "new_request_while_stopped": refused, "recovered_after_s": recovered}


async def _is_healthy(client: httpx.AsyncClient, base: str) -> bool:
    return (await _health(client, base))[0] == 200


async def _readers(client: httpx.AsyncClient, server: Server, load: Load) -> dict[str, Any]:
    base = server.base
    aborted_before = await _metric(client, base, "kvserve_requests_aborted_total") or 0
    silent = [_silent_stream(base) for _ in range(SILENT_STREAMS)]
    try:

        async def all_paused() -> bool:
            return (await _metric(client, base, "kvserve_requests_paused") or 0) >= SILENT_STREAMS

        paused_after = await _wait_for(all_paused, 60)
        started = time.perf_counter()
        r = await client.post(
            base + "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
        new_request = {"status": r.status_code, "seconds": round(time.perf_counter() - started, 3)}

        async def all_aborted() -> bool:
            aborted = await _metric(client, base, "kvserve_requests_aborted_total") or 0
            paused = await _metric(client, base, "kvserve_requests_paused") or 0
            return aborted - aborted_before >= SILENT_STREAMS and paused == 0

        freed_after = await _wait_for(all_aborted, server.args.stall_timeout + 60)
    finally:
        for sock in silent:
            sock.close()
    return {
        "silent_streams": SILENT_STREAMS,
        "all_paused_after_s": None if paused_after is None else round(paused_after, 2),
        "new_request_while_paused": new_request,
        "freed_after_s": None if freed_after is None else round(freed_after, 2),
    }


async def _kill(client: httpx.AsyncClient, server: Server, load: Load) -> dict[str, Any]:
    await asyncio.sleep(1.0)
    os.kill(server.engine_pid(), signal.SIGKILL)
    killed = time.perf_counter()
    try:
        code = await asyncio.to_thread(server.proc.wait, 60)
    except subprocess.TimeoutExpired:
        code = None
    exited_after = time.perf_counter() - killed
    ready = server.start()  # the supervisor's part
    await asyncio.sleep(1.0)
    return {"exit_code": code, "exited_after_s": round(exited_after, 2), "restart_ready_s": round(ready, 2)}


async def _full(client: httpx.AsyncClient, server: Server, load: Load) -> dict[str, Any]:
    """Restart under a file-size limit a little above the store's size, and write until it is full."""
    await load.stop()
    server.stop()
    sizes = [p.stat().st_size for p in server.db.parent.glob(server.db.name + "*") if p.is_file()]
    limit = max(sizes) + (64 << 10)
    server.start(file_limit=limit)
    load.start(client)
    full = None
    for _ in range(400):  # ~2 KB a create: full long before
        outcome = await load._write(client)
        load.outcomes.append(outcome)
        if outcome["status"] == 503:
            full = outcome.get("body", {}).get("error", {}).get("message")
            break
    health = await _health(client, server.base)
    deleted = []
    for session_id in list(load.ledger)[:3]:  # a client frees space (or is told clearly why not)
        r = await client.delete(f"{server.base}/v1/sessions/{session_id}")
        deleted.append(r.status_code)
        if r.status_code == 200:
            del load.ledger[session_id]
    return {"file_limit_bytes": limit, "refused": full, "health_when_full": health, "deletes": deleted}


async def _read_back(client: httpx.AsyncClient, base: str, ledger: dict[str, list[str]]) -> list[str]:
    """Every acknowledged write not found in its session, in order, after the last restart."""
    lost = []
    for session_id, contents in ledger.items():
        r = await client.get(f"{base}/v1/sessions/{session_id}")
        stored = [m["content"] for m in r.json().get("messages", [])] if r.status_code == 200 else []
        position = 0
        for content in contents:
            try:
                position = stored.index(content, position) + 1
            except ValueError:
                lost.append(f"{session_id}: {content[:40]}")
    return lost
