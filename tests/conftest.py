"""Shared fixtures: a $KVSERVE_HOME per test process, the bundled GGUF (fetched once into the real one's
models/), tiny random Llama checkpoints, and the workers' threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels (kvserve/kernels/gpu) run in Triton's interpreter, which triton reads
# from the environment once, when it is first imported (by kvserve's dependencies, too): set it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # the same computation, without re-patching per helper call
    from tests.triton_interpreter import speed_up

    speed_up()

from kvserve.weights.registry import DEFAULT_MODEL, pull
from tests.gguf_reader import speed_up as read_ggufs_faster

read_ggufs_faster()  # the same fields and tensors for transformers' references, read a third faster

TINY_LLAMA = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest without xdist (-p no:xdist) still starts
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): a worker per CPU this process may use, at most 4, since each may
    hold a bundled model and its float32 transformers reference (a few GB). PYTEST_XDIST_AUTO_NUM_WORKERS
    overrides it, as in xdist's own hook."""
    if chosen := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(chosen)
    return max(1, min(_cpus(), 4))


def _worker_threads() -> int | None:
    """In a worker, the CPUs shared among the workers (None outside xdist or with one worker)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, _cpus() // workers) if workers > 1 else None


def pytest_configure(config) -> None:
    """A worker's torch threads are its share of the CPUs: on 2 cores, 2 workers of 2 threads each spent
    twice the CPU time of 2 workers of 1 on the same suite. So are those of an engine or server the worker
    starts in a process of its own (OMP_NUM_THREADS, which torch reads at start): with every core's
    OpenMP thread spinning (`GOMP_SPINCOUNT`, kvserve/__init__.py) beside the other worker's, each
    parallel region waited for a descheduled thread, and a test of the bundled model's server took 37-43 s
    in the suite against 1.7 s alone."""
    if (threads := _worker_threads()) is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(scope="module", autouse=True)
def kernel_threads(request):
    """A file marked `threaded` (the C++ kernels', the sampler's, batch invariance's, the families') runs
    with 2 threads or more even in a worker whose share is 1, so that the kernels' splits over threads
    stay tested."""
    threads = _worker_threads()
    if threads is None or threads >= 2 or request.node.get_closest_marker("threaded") is None:
        yield
        return
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def kvserve_home_per_process(tmp_path_factory):
    """This test process's own $KVSERVE_HOME, whose models/ is the real one's (the bundled GGUFs fetched
    once for all): the default session store, which one process locks, is then neither another worker's
    nor the user's own."""
    from kvserve.weights.registry import models_dir

    models = models_dir()
    models.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("kvserve-home")
    (home / "models").symlink_to(models, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_HOME", str(home))
        yield home


@pytest.fixture(scope="session", autouse=True)
def fused_decode_extension():
    """Build the fused CPU decode step once, before any engine starts, so that every engine test
    runs its decode steps through it from the first step (not from whenever a build finishes)."""
    from kvserve.kernels import build

    return build.load()


@pytest.fixture(scope="session")
def extension(fused_decode_extension):
    """The loaded C++ kernels, for tests of them: skipped without a compiler or with KVSERVE_FUSED_DECODE=0
    (bench/gpu.py's tests on a GPU machine), a failure when a compiler is there and the build fails."""
    import shutil

    from kvserve.kernels import build

    if fused_decode_extension is None and not build.is_enabled():
        pytest.skip("KVSERVE_FUSED_DECODE=0: the C++ kernels are off")
    if fused_decode_extension is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the Python paths serve")
    assert fused_decode_extension is not None, f"the C++ kernels failed to build: {build.error()}"
    return fused_decode_extension


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    """The default model's GGUF, fetched with `kvserve pull` semantics on first use."""
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(bundled_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(bundled_gguf.parent, gguf_file=bundled_gguf.name)


def make_tiny_llama(path: Path, seed: int = 0, **overrides):
    """Save a random-weight transformers Llama with `overrides` applied to TINY_LLAMA; return it (eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_byte_tokenizer(path: Path) -> None:
    """A real byte-level BPE tokenizer (256 byte tokens, no merges) plus three special tokens."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from kvserve.text.tokenizer import _byte_alphabet

    vocab = {char: byte for byte, char in _byte_alphabet().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level tokenizer: a complete model folder kvserve can serve."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path, seed=42, max_position_embeddings=1024, initializer_range=0.2)
    write_byte_tokenizer(path)
    return path


def wait_idle(llm, timeout: float = 30.0) -> dict:
    """Wait until the engine has nothing running or waiting; return the pool's counts then."""
    import time

    # Asked on the engine thread, not from the stats snapshot: the snapshot is published after a
    # step's chunks are delivered, so a client can act on a chunk before the snapshot shows its request.
    deadline = time.monotonic() + timeout
    counts = llm.check_integrity()
    while (counts["running"] or counts["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.01)
        counts = llm.check_integrity()
    return counts


def wait_idle_and_check(llm, timeout: float = 30.0, pinned: int = 0) -> dict:
    """wait_idle, then assert no KV block is in use beyond `pinned` (blocks that live sessions hold
    between turns)."""
    counts = wait_idle(llm, timeout)
    assert counts["used"] == pinned, f"KV blocks leaked: {counts} (sessions pin {pinned})"
    return counts


def run_beside_a_failing_request(llm, prompts, params, take_back=True, wait_s=30.0, join_s=60.0) -> dict:
    """R6's case: a model step raises whenever the request for "poison" is in it. The first prompt is
    held in its first step while the others and "poison" queue up, so the next step batches them all.
    Returns each prompt's output (or the EngineError it got), "poison" included."""
    import threading
    import time

    from kvserve.errors import EngineError

    poison_ids = llm.tokenizer.encode("poison")

    def fault(out) -> None:
        if any(item.prompt_token_ids == poison_ids for item in out.scheduled):
            raise RuntimeError("injected fault")

    results: dict[str, object] = {}

    def run(prompt: str) -> None:
        try:
            results[prompt] = llm.generate(prompt, params)
        except EngineError as exc:
            results[prompt] = exc

    threads = [threading.Thread(target=run, args=(p,)) for p in [*prompts, "poison"]]
    with StepGate(llm, fault, take_back=take_back) as gate:
        threads[0].start()
        assert gate.entered.wait(wait_s)  # the first prompt is held in its first step; the rest queue up
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + wait_s
        while llm.engine.inbox.qsize() < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.engine.inbox.qsize() == len(prompts)  # the next step batches them with the first
        gate.open()
        for t in threads:
            t.join(join_s)
    return results


class StepGate:
    """Holds an engine's model steps at a known point: while closed, every step waits before it runs.

    `entered` is set once a step waits at the gate, so "the request is still running" is a fact the
    test established, not a bet on the machine's speed. `allow(n)` lets n more steps through,
    `open()` all of them. `fault(out)`, if given, runs before every step past the gate (a test
    injects a failure there).
    """

    def __init__(self, llm, fault=None, take_back: bool = True) -> None:
        import threading

        self.fault = fault
        self.take_back = take_back
        self.engine = llm.engine
        self.runner = llm.engine.runner
        self.entered = threading.Event()
        self.num_entered = 0  # steps that reached the gate
        self._passes = 0.0
        self._changed = threading.Condition()

    def __enter__(self) -> StepGate:
        execute = type(self.runner).execute.__get__(self.runner)
        engine = self.engine

        def gated(out, *args):
            # Running ahead (async scheduling, on a GPU), the step before this one is still queued: it is
            # taken back first, so that a step waiting here has every step before it applied (unless
            # `take_back` is False: tests of running ahead).
            while self.take_back and getattr(self.runner, "runs_ahead", False) and self.runner.num_pending:
                engine._step_done(*self.runner.collect(), rerun=False)
            self.entered.set()
            with self._changed:
                self.num_entered += 1
                self._changed.notify_all()
                assert self._changed.wait_for(lambda: self._passes > 0, 120), "a test left its step gate closed"
                self._passes -= 1
            if self.fault is not None:
                self.fault(out)
            return execute(out, *args)

        self.runner.execute = gated
        return self

    def allow(self, num_steps: int) -> None:
        with self._changed:
            self._passes += num_steps
            self._changed.notify_all()

    def open(self) -> None:
        self.allow(float("inf"))

    def step(self) -> None:
        """Let one step through and wait until the next one waits at the gate: by then the engine
        has applied every message that was in its inbox before the step finished."""
        with self._changed:
            arrived = self.num_entered
            self._passes += 1
            self._changed.notify_all()
            assert self._changed.wait_for(lambda: self.num_entered > arrived, 60), "no further step came"

    def __exit__(self, *exc) -> None:
        self.open()
        del self.runner.execute  # the class's method again
