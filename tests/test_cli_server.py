"""`kvserve serve` and `kvserve chat` as processes: loading, readiness, graceful SIGTERM, the chat loop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve.errors import InvalidRequestError
from tests.server_harness import descendants, free_port


def test_serve_reports_loading_then_ready_and_exits_cleanly_on_sigterm(tiny_model_dir):
    port = free_port()
    env = {
        **os.environ,
        "KVSERVE_PORT": str(port),
        "KVSERVE_SERVED_MODEL_NAME": "tiny",
        "KVSERVE_DTYPE": "float32",
        "KVSERVE_KV_CACHE_DTYPE": "float16",  # flows through ServerSettings into LLM (a bad one fails the load)
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir), "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    statuses = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(f"{base}/health", timeout=1).status_code)
                if statuses[-1] == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.01)
        assert statuses and statuses[-1] == 200
        assert set(statuses) <= {200, 503}
        result = {"lines": []}
        streaming = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "x", "max_tokens": 900, "stream": True, "ignore_eos": True}
            body["stream_options"] = {"include_usage": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    streaming.set()
                    if line:
                        result["lines"].append(line)

        thread = threading.Thread(target=stream)
        thread.start()
        assert streaming.wait(60)  # the stream is in flight: its first event has arrived
        children = descendants(proc.pid, b"spawn_main")  # the engine process
        assert len(children) == 1
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert proc.wait(60) == 0
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]  # none left behind
        assert result["lines"][-1] == "data: [DONE]"  # the in-flight stream was finished, not cut
        usage, last = (json.loads(line[6:]) for line in result["lines"][-2:-4:-1])
        assert usage["usage"]["completion_tokens"] == 900 and last["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_still_running_at_the_shutdown_timeout_gets_an_error_event_and_the_server_exits_0(
    tiny_model_dir, tmp_path
):
    """SIGTERM with --shutdown-timeout 0.5: a stream still running then ends with an error event and
    [DONE] (before: uvicorn cut it mid-way, and answered an unstreamed one a text/plain 500). Its
    engine process is stopped (SIGSTOP) so that it surely is still running; SIGCONT lets it shut down."""
    port = free_port()
    env = {**os.environ, "KVSERVE_SESSION_DB": str(tmp_path / "s.db"), "KVSERVE_DTYPE": "float32"}
    flags = ["--model", str(tiny_model_dir), "--port", str(port), "--shutdown-timeout", "0.5", "--stage-timeout", "600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", *flags, "--log-level", "warning"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base) and time.monotonic() < deadline:
            time.sleep(0.05)
        (engine,) = descendants(proc.pid, b"spawn_main")
        os.kill(engine, signal.SIGSTOP)
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 900, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines)[6:])["choices"][0]["delta"]["role"] == "assistant"  # it runs
            proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        os.kill(engine, signal.SIGCONT)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down", events
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_the_engine_loads_exits_at_once(tiny_model_dir, tmp_path):
    """A loading engine process has nothing to finish: at SIGTERM it is killed and the server exits 0
    at once (before, it was sent "shutdown", which nobody reads while loading, and waited 30 s). The
    weights here are a named pipe nobody writes, so the engine surely is still loading."""
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.suffix == ".safetensors":
            os.mkfifo(model / path.name)  # opening it blocks: the load never ends
        else:
            (model / path.name).write_bytes(path.read_bytes())
    env = {**os.environ, "KVSERVE_SESSION_DB": str(tmp_path / "s.db")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--port", str(free_port())],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (engines := descendants(proc.pid, b"spawn_main")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engines, "the engine process never started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0  # a hang guard: it exits within a moment
        assert not [pid for pid in engines if os.path.exists(f"/proc/{pid}")]
    finally:
        if proc.poll() is None:
            proc.kill()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("engine_process", "freezes"), [("off", {"front end", "front end and engine"}), ("on", {"front end", "engine"})]
)
def test_serve_freezes_the_heap_once_the_engine_has_loaded_and_logs_it(tiny_model_dir, engine_process, freezes):
    """--engine-process off: the front end's heap is frozen at start, the engine loads later in the same
    process, and its objects (the model's modules, torch's) are frozen too before it serves: no full
    collection walks them while streams wait. On, the engine process freezes its own, and logs at
    --log-level: it logged nothing below WARNING, not even how the weights are held."""
    port = free_port()
    env = {**os.environ, "KVSERVE_PORT": str(port), "KVSERVE_DTYPE": "float32"}
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir)]
    command += ["--engine-process", engine_process]
    proc = subprocess.Popen([*command, "--log-level", "info"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    frozen = {}
    for line in stderr.splitlines():
        if "start-up objects left out of garbage collection" in line:
            process, _, rest = line.partition(" process: ")
            frozen[process.rsplit(": ", 1)[-1]] = int(rest.split()[0])
    assert set(frozen) == freezes, stderr[-3000:]
    if engine_process == "off":
        assert frozen["front end and engine"] > frozen["front end"]  # the engine's objects came after
    assert "kvserve.weights: weights=" in stderr, stderr[-3000:]  # as --weights' help promises


def test_chat_loop_with_reset_and_exit(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "chat", "--model", str(tiny_model_dir), "--max-tokens", "5"],
        input="hello\n/reset\nagain\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "(conversation cleared)" in out.stdout
    assert out.stdout.count(">>> ") == 4


def test_a_chat_line_the_context_cannot_hold_is_refused_and_the_chat_goes_on(tiny_model_dir):
    """The tiny model's context is 1,024 tokens: a line of 900 with room for no reply of 200 is refused
    before it joins the conversation, and the next line is answered (before, the whole chat ended with
    status 2, or the line stayed and every later turn was refused)."""
    chat = [sys.executable, "-m", "kvserve.cli", "chat", "--model", str(tiny_model_dir), "--max-tokens", "200"]
    out = subprocess.run(
        chat, input="hello\n" + "hi " * 300 + "\nstill here?\n/exit\n", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("it was not sent. /reset starts a new conversation.") == 1, out.stderr
    assert out.stdout.count(">>> ") == 4 and "Traceback" not in out.stderr


def test_closed_standard_streams_and_a_closed_pipe_end_in_a_line_or_in_silence(tiny_model_dir):
    """`2>&-` (before: generate hung for good, multiprocessing's lock taking stderr's number), `>&-` and
    `<&-` (before: tracebacks, after the model loaded), and a reader that stops early (`| head -1`;
    before: "[Errno 32] Broken pipe" and status 1)."""
    generate = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "generate",
        "hi",
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "3",
    ]

    def closed(fd: int, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, preexec_fn=lambda: os.close(fd), stderr=subprocess.PIPE, text=True, timeout=120)

    assert closed(2, generate).returncode == 0  # a hang guard: it ends, and well
    no_stdout = closed(1, generate)
    assert no_stdout.returncode == 1 and no_stdout.stderr.strip().endswith("stdout is closed; generate needs it.")
    chat = closed(0, [sys.executable, "-m", "kvserve.cli", "chat", "--model", str(tiny_model_dir)])
    assert chat.returncode == 1 and "stdin is closed; chat needs it." in chat.stderr
    models = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    models.stdout.close()  # the reader is gone before the first line
    assert models.wait(120) == 128 + signal.SIGPIPE and models.stderr.read() == ""


def test_two_ctrl_c_at_the_chat_prompt_end_it_cleanly(tiny_model_dir):
    """A terminal's Ctrl-C reaches the process (and `timeout -s INT` sends it twice): the first ends the
    chat at its prompt, a second one during the close must not abort the process in torch's teardown."""
    chat = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "chat", "--model", str(tiny_model_dir), "--max-tokens", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        chat.stdin.write("hello\n")
        chat.stdin.flush()
        seen = ""
        while seen.count(">>> ") < 2:  # the reply is written and the prompt asks again: a known point
            char = chat.stdout.read(1)
            assert char, f"chat ended early: {chat.wait()} {chat.stderr.read()[-2000:]}"
            seen += char
        chat.send_signal(signal.SIGINT)
        chat.send_signal(signal.SIGINT)
        stderr = chat.communicate(timeout=60)[1]
    finally:
        chat.kill()
        chat.wait()
    # 130, the shell's status for Ctrl-C, as generate's and llama.cpp's llama-cli at its prompt (EOF and /exit: 0)
    assert chat.returncode == 130 and "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "kvserve.cli", *args]
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def test_bad_settings_stop_serve_with_a_message_and_a_status_never_a_traceback(tiny_model_dir, tmp_path):
    """What --help promises is checked at start: each bad value is a one-line error (status 2 for a
    setting, 1 for the machine's refusal), from a flag or from its KVSERVE_* variable alike."""
    db = ["--session-db", str(tmp_path / "sessions.db"), "--model", str(tiny_model_dir)]
    for flags, env, says in [
        (["--port", "99999"], {}, "a port is from 0 to 65535"),
        (["--request-timeout", "0"], {}, "must be more than 0"),
        (["--gather-ms", "nan"], {}, "not a finite number"),
        (["--max-queue", "-1"], {}, "must be at least 0"),
        (["--kv-cache-tokens", "8"], {}, "must be at least 16"),
        (["--nnodes", "2", "--node-rank", "1"], {}, "--nnodes, --node-rank place this process in a pipeline"),
        ([], {"KVSERVE_BATCH_INVARIANT": "true"}, "KVSERVE_BATCH_INVARIANT='true' is not one of on, off"),
        ([], {"KVSERVE_ENGINE_PROCESS": "yes"}, "KVSERVE_ENGINE_PROCESS='yes' is not one of on, off"),
        ([], {"KVSERVE_LOG_LEVEL": "bogus"}, "kvserve serve: error: KVSERVE_LOG_LEVEL='bogus' is not one of"),
        (["--api-key", "secret", "--api-key", ""], {}, "--api-key is empty"),
        (["--allowed-origins", "https://chat.example.com/app"], {}, "is not an origin"),
        ([], {"KVSERVE_ALLOWED_ORIGINS": "chat.example.com"}, "is not an origin"),
    ]:
        done = _cli("serve", *db, *flags, env=env)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, (
            flags,
            env,
            done.stderr,
        )
    with socket.socket() as taken:  # a port in use: status 1, saying so
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _cli("serve", *db, "--port", str(taken.getsockname()[1]))
    assert done.returncode == 1 and "cannot listen on 127.0.0.1:" in done.stderr and "Traceback" not in done.stderr
    home = tmp_path / "a-file"
    home.write_text("")
    done = _cli("pull", env={"KVSERVE_HOME": str(home), "PIP_NO_INDEX": "1"})  # refused before any download
    assert done.returncode == 1 and "Not a directory" in done.stderr and "Traceback" not in done.stderr


def test_serve_exits_1_when_its_engine_cannot_start(tmp_path):
    """A model that cannot load leaves nothing to serve: the server says why and exits 1 (as llama.cpp's
    server and vLLM do) instead of answering 503 until someone looks."""
    not_a_model = tmp_path / "no-config"
    not_a_model.mkdir()
    done = _cli("serve", "--model", str(not_a_model), "--port", "0", "--session-db", str(tmp_path / "s.db"))
    assert done.returncode == 1 and "The engine could not start" in done.stderr, done.stderr[-2000:]


def test_the_api_key_flag_replaces_the_variable_and_an_empty_key_never_matches(monkeypatch):
    from kvserve import cli

    monkeypatch.setenv("KVSERVE_API_KEY", "old, older,")  # spaces after commas are not part of a key
    assert cli._api_keys(None) == ("old", "older")
    assert cli._api_keys(["new"]) == ("new",)  # a rotated key: the variable's stop working
    for unset in (" , ", ""):  # set, but no key (an empty one too): refused, never auth off without a word
        monkeypatch.setenv("KVSERVE_API_KEY", unset)
        with pytest.raises(InvalidRequestError, match="names no key"):
            cli._api_keys(None)


def test_allowed_origins_are_read_as_a_comma_separated_list():
    from kvserve import cli

    parser = cli.build_parser()
    assert parser.parse_args(["serve"]).allowed_origins == ()
    flags = ["serve", "--allowed-origins", "https://a.example, http://localhost:5173,*"]
    assert parser.parse_args(flags).allowed_origins == ("https://a.example", "http://localhost:5173", "*")


def test_the_cli_starts_without_torch_and_keeps_a_ctrl_c_during_its_import(tmp_path):
    """`import kvserve` imported torch (a second or two) before main() could catch a Ctrl-C: a traceback,
    or pybind11's abort when the interrupt landed inside torch's C++. The command's own code imports
    torch now, a Ctrl-C meanwhile kept until the import is over. A stand-in torch sends itself SIGINT
    halfway through its import."""
    light = subprocess.run(
        [sys.executable, "-c", "import sys, kvserve.cli, kvserve; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert light.stdout.strip() == "False", light.stderr
    (tmp_path / "torch.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nimported = True\n")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "from kvserve import cli\n"
        "try:\n"
        "    cli._import_torch_keeping_ctrl_c()\n"
        "except KeyboardInterrupt:\n"
        "    import torch\n"
        "    print('kept until imported:', torch.imported)\n"
    )
    kept = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert kept.stdout.strip() == "kept until imported: True", kept.stderr[-2000:]
