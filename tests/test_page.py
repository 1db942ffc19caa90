"""The page (GET /) in a real browser: Debian's chromium driven by Playwright (its own browser download
is not used). A streamed answer appears, with the engine in its own process (the bundled model) and
in the server's process (a tiny random model); Stop aborts a turn and its blocks turn free on the
map; a fork shares its prefix blocks on the map; a second key sees none of the first's text.

The engine is held at known points by a StepGate; the tests wait for what the page shows, never for
time. Screenshots go to $KVSERVE_SCREENSHOTS (`KVSERVE_SCREENSHOTS=docs pytest tests/test_page.py`
renews docs/page*.png), else to the test's temporary folder.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from kvserve.server.app import ServerSettings, create_app
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import serving

pytest.importorskip("playwright", reason="the page's tests need playwright (pip install -e '.[test]')")
CHROMIUM = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no chromium to drive: apt-get install chromium (or set KVSERVE_CHROMIUM to a Chromium binary)",
        allow_module_level=True,
    )

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402  (after the skip: playwright may be absent)

# As the machines' notes say: no sandbox as root, and no background connections on a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ANSWER_TIMEOUT_MS = 60_000  # generous: two cores are shared with other work
ENDED = re.compile("^(stop|length)$")  # a reply the session keeps


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, for this module only: Playwright's sync API runs an asyncio loop on the main
    thread while it is started, so a session-wide one (pytest-playwright's) broke later tests' asyncio.run."""
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser):
    """A fresh context (cookies, storage) per test."""
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("KVSERVE_SCREENSHOTS")
    return Path(folder) if folder else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def process_server(bundled_gguf, tmp_path_factory):
    """`kvserve serve` as it runs by default: the engine in its own process, the bundled model, two keys."""
    settings = ServerSettings(
        model=str(bundled_gguf),
        api_keys=("alice", "bob"),
        kv_cache_tokens=512 * 16,  # a map of 512 blocks: big enough to see, small enough to read
        session_db=str(tmp_path_factory.mktemp("page-process") / "sessions.db"),
    )
    app = create_app(settings)
    with serving(app) as base:
        yield base, app.state.kvserve.llm


@pytest.fixture(scope="module")
def thread_server(tiny_model_dir, tmp_path_factory):
    """--engine-process off: the engine in a thread of the server's process (a tiny random model, no keys)."""
    settings = ServerSettings(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        engine_process=False,
        dtype="float32",
        kv_cache_tokens=64 * 16,
        session_db=str(tmp_path_factory.mktemp("page-thread") / "sessions.db"),
    )
    app = create_app(dataclasses.replace(settings))
    with serving(app) as base:
        yield base, app.state.kvserve.llm


def pinned(llm) -> int:
    """The blocks live sessions hold between turns (a fork's shared ones once)."""
    return len({b for s in llm.sessions.sessions.values() for b in s.pinned_block_ids})


def held_on_map(page: Page) -> int:
    """The blocks the page's key's sessions hold, as its map shows them."""
    return page.locator("#block-map .b[data-kind=session], #block-map .b[data-kind=shared]").count()


def open_page(page: Page, base: str, key: str | None, num_blocks: int) -> None:
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.goto(f"{base}/")
    if key is not None:
        expect(page.locator("#key-dialog")).to_be_visible()
        page.fill("#api-key", key)
        page.click("#key-submit")
    expect(page.locator("#block-map .b")).to_have_count(num_blocks)  # the engine view is live


def ask(page: Page, text: str, **sampling: str) -> None:
    for field, value in sampling.items():
        page.fill(f"#{field}", value)
    page.fill("#prompt", text)
    page.click("#send")


def take_in_the_pages_calls(gate: StepGate, llm, done, timeout_s: float = 60.0) -> None:
    """Until `done()`, let the held engine take in what the page sends: the page's session calls wait
    for a step boundary, so one step each time a message waits in the engine's inbox, and no other.
    The turns held then advance by as many steps as the page sends calls, whatever the machine's speed
    (a turn that could end within those steps would make the test depend on it)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if llm.engine.inbox.qsize():
            gate.step()  # the step ends, the engine applies the inbox, the next step waits at the gate
        else:
            assert time.monotonic() < deadline, "the page never got there"
            time.sleep(0.01)  # the page's next call is on its way: polled, not raced


def answered(page: Page, index: int = 0):
    """The index-th reply, once the page has its end and has seen its blocks freed."""
    reply = page.locator("#messages li.assistant").nth(index)
    expect(reply).to_have_attribute("data-finish", "stop", timeout=ANSWER_TIMEOUT_MS)
    expect(reply.locator(".lifecycle").first).to_have_attribute("data-state", "freed", timeout=ANSWER_TIMEOUT_MS)
    return reply


def test_a_streamed_answer_appears_with_the_engine_in_its_own_process(page: Page, process_server, shots):
    base, llm = process_server
    open_page(page, base, "alice", 512)
    expect(page.locator("#model-name")).to_have_text("SmolLM2-135M-Instruct.Q4_1")
    expect(page.locator("#temperature")).to_have_value("0.2")  # the model card's recommendation
    # "Name the capital city of France." leads with "The" by about 1 nat: 0.8% of draws at 0.2 go elsewhere,
    # where "What is the capital of France?" is a near tie of "The" and "L" (0.09 nat) that a CPU's kernels
    # can tip (AVX2's int8 path draws "L'Étoile, la Marseillaise, ..." with this seed, to the length limit)
    ask(page, "Name the capital city of France.", seed="0")
    reply = answered(page)
    expect(reply.locator(".text")).to_contain_text("Paris")
    expect(page.locator("#rate")).to_contain_text("tok/s")
    expect(reply.locator(".lifecycle").first).to_contain_text("first token")
    expect(page.locator("#session-list li")).to_have_count(1)
    expect(page.locator("#block-map .b[data-kind=session]").first).to_be_visible()  # its pinned prefix
    page.screenshot(path=shots / "page.png", full_page=True)
    wait_idle_and_check(llm, pinned=held_on_map(page))


def test_a_streamed_answer_appears_with_the_engine_in_the_servers_process(page: Page, thread_server):
    base, llm = thread_server
    open_page(page, base, None, 64)
    ask(page, "Hello there, tiny model.", temperature="0", **{"max-tokens": "6"})
    reply = page.locator("#messages li.assistant").first
    expect(reply).to_have_attribute("data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS)
    expect(reply.locator(".text")).not_to_be_empty()
    expect(page.locator("#rate")).to_contain_text("tok/s")
    wait_idle_and_check(llm, pinned=pinned(llm))


def test_stop_aborts_the_turn_and_its_blocks_turn_free_on_the_map(page: Page, thread_server, shots):
    base, llm = thread_server
    open_page(page, base, None, 64)
    page.click("#new-session")
    with StepGate(llm) as gate:
        ask(page, "Tell me a very long story about caches.", temperature="0", **{"max-tokens": "200"})
        assert gate.entered.wait(30)
        gate.allow(3)  # three steps, then the engine waits before the fourth: the turn is decoding
        reply = page.locator("#messages li.assistant").last
        expect(reply.locator(".text")).not_to_be_empty()
        expect(page.locator("#block-map .b[data-kind=request]").first).to_be_visible()  # the turn's blocks
        expect(page.locator("#stop")).to_be_enabled()
        page.click("#stop")  # DELETE /v1/requests/{id}: applied at the next step boundary
        gate.open()
        expect(reply).to_have_attribute("data-finish", "abort", timeout=ANSWER_TIMEOUT_MS)
        expect(reply.locator(".lifecycle").first).to_have_attribute("data-state", "freed")
    expect(reply.locator(".lifecycle").first).to_contain_text("aborted")
    expect(page.locator("#block-map .b[data-kind=request]")).to_have_count(0)
    expect(page.locator("#block-map .b[data-kind=free], #block-map .b[data-kind=cached]")).to_have_count(
        64 - pinned(llm)
    )
    page.screenshot(path=shots / "page-stop.png", full_page=True)
    wait_idle_and_check(llm, pinned=pinned(llm))


def test_a_fork_shares_its_prefix_blocks_on_the_map(page: Page, thread_server, shots):
    base, llm = thread_server
    open_page(page, base, None, 64)
    page.click("#new-session")
    page.fill("#system", "You are terse. You answer in one short line, always.")
    ask(page, "What does a KV cache keep between the turns of a chat?", temperature="0", **{"max-tokens": "8"})
    reply = page.locator("#messages li.assistant").last
    expect(reply).to_have_attribute("data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS)
    parent = page.locator("#session-header").inner_text().removeprefix("Session ")
    parents_blocks = page.locator(f"#block-map .b[data-owner~='{parent}']")
    expect(parents_blocks.first).to_be_visible()
    num_blocks = parents_blocks.count()
    reply.locator(".fork").click()  # fork at the last message: the whole session
    expect(page.locator("#session-header")).not_to_have_text(f"Session {parent}")
    child = page.locator("#session-header").inner_text().removeprefix("Session ")
    shared = page.locator(f"#block-map .b[data-kind=shared][data-owner~='{parent}'][data-owner~='{child}']")
    expect(shared).to_have_count(num_blocks)  # every block of the parent's, held by both
    page.screenshot(path=shots / "page-fork.png", full_page=True)
    wait_idle_and_check(llm, pinned=pinned(llm))


def test_a_second_key_sees_no_text_of_the_firsts(page: Page, browser, process_server, shots):
    base, llm = process_server
    secret = "Where did I hide the spare key, under the blue flowerpot?"
    open_page(page, base, "alice", 512)
    page.click("#new-session")
    ask(page, secret, seed="1", **{"max-tokens": "24"})
    reply = page.locator("#messages li.assistant").last
    expect(reply).to_have_attribute("data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS)
    expect(reply.locator(".lifecycle").first).to_have_attribute("data-state", "freed", timeout=ANSWER_TIMEOUT_MS)
    alice_session = page.locator("#session-header").inner_text().removeprefix("Session ")
    alice_blocks = held_on_map(page)
    answer = reply.locator(".text").inner_text()
    assert alice_blocks > 0 and answer

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        bob = context.new_page()
        open_page(bob, base, "bob", 512)
        expect(bob.locator("#block-map .b[data-kind=other]").first).to_be_visible()  # alice's, anonymous
        assert bob.locator("#block-map .b[data-kind=other]").count() >= alice_blocks
        expect(bob.locator("#session-list li")).to_have_count(0)
        expect(bob.locator("#events li").first).to_be_visible()
        html = bob.content()  # every attribute and text node the page holds
        for leak in (secret, "flowerpot", answer, alice_session):
            assert leak not in html
        assert "chatcmpl-" not in html and "sess-" not in html
        bob.screenshot(path=shots / "page-second-key.png", full_page=True)
    finally:
        context.close()
    wait_idle_and_check(llm, pinned=held_on_map(page))  # alice's sessions, as her map shows them
    # The same page given the second key: the first key's event lines (its request ids) go too.
    seen = set(page.locator("#events li").all_inner_texts())
    assert seen  # the first key's lines, there to be dropped
    page.click("#key-button")
    page.fill("#api-key", "bob")
    page.click("#key-submit")
    expect(page.locator("#session-list li")).to_have_count(0)
    expect(page.locator("#block-map .b[data-kind=other]").first).to_be_visible()  # the second key's view
    assert not seen & set(page.locator("#events li").all_inner_texts())
    html = page.content()
    assert alice_session not in html, html[max(0, html.index(alice_session) - 300) : html.index(alice_session) + 100]


def test_a_reply_stays_in_its_session_when_another_is_opened_while_it_streams(page: Page, thread_server):
    """Before, the reply went into the history of whichever session was on screen when it ended (and
    a fork of that one copied it), and Stop stopped the other session's turn."""
    base, llm = thread_server
    open_page(page, base, None, 64)
    page.click("#new-session")
    ask(page, "The first session.", temperature="0", **{"max-tokens": "4"})
    expect(page.locator("#messages li.assistant").last).to_have_attribute(
        "data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS
    )
    first = page.locator("#session-header").inner_text().removeprefix("Session ")
    page.click("#new-session")
    with StepGate(llm) as gate:
        ask(page, "The second session, a long answer.", temperature="0", **{"max-tokens": "200"})
        assert gate.entered.wait(30)
        gate.allow(2)
        expect(page.locator("#messages li.assistant").last.locator(".text")).not_to_be_empty()
        expect(page.locator("#stop")).to_be_enabled()
        second = page.locator("#session-header").inner_text().removeprefix("Session ")
        page.click(f"#session-list li[data-id='{first}']")
        # its turn ends at 22 tokens: 2 steps so far, and one for each of the page's calls now
        take_in_the_pages_calls(gate, llm, lambda: page.locator("#session-header").inner_text() == f"Session {first}")
        expect(page.locator("#stop")).to_be_disabled()  # the running turn is the second session's
        expect(page.locator("#messages li")).to_have_count(2)  # the first session's, nothing of the turn's
        gate.open()
    # the page refreshes the list when the turn has ended: the second session idle, with its reply
    expect(page.locator(f"#session-list li[data-id='{second}'] .meta")).to_contain_text(
        "2 messages · idle", timeout=ANSWER_TIMEOUT_MS
    )
    on_server = [m["content"] for m in llm.session(id=first).info()["messages"]]
    assert page.evaluate("state.messages.map((m) => m.content)") == on_server  # the page's copy is the server's
    expect(page.locator("#messages li")).to_have_count(2)
    page.click(f"#session-list li[data-id='{second}']")
    expect(page.locator("#messages li.assistant")).to_have_count(1)  # its reply, where it belongs
    expect(page.locator("#messages li.assistant .text")).not_to_be_empty()
    wait_idle_and_check(llm, pinned=pinned(llm))


def test_enter_pressed_twice_sends_the_message_once(page: Page, thread_server):
    base, llm = thread_server
    open_page(page, base, None, 64)
    page.click("#new-session")
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Only once, please.")
    page.press("#prompt", "Enter")
    page.press("#prompt", "Enter")
    expect(page.locator("#messages li.assistant").last).to_have_attribute(
        "data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS
    )
    session = page.locator("#session-header").inner_text().removeprefix("Session ")
    wait_idle_and_check(llm, pinned=pinned(llm))
    roles = [m["role"] for m in llm.session(id=session).info()["messages"]]
    assert roles == ["user", "assistant"]
    expect(page.locator("#messages li")).to_have_count(2)


def test_a_new_key_gets_its_own_engine_view(page: Page, process_server):
    """Before, the engine view kept the first key's stream when another key was entered, and the
    first key's conversation stayed on screen."""
    base, _ = process_server
    open_page(page, base, "alice", 512)
    page.click("#new-session")
    ask(page, "Only for alice.", **{"max-tokens": "2"})
    expect(page.locator("#messages li.assistant").last).to_have_attribute(
        "data-finish", ENDED, timeout=ANSWER_TIMEOUT_MS
    )
    page.click("#key-button")
    page.fill("#api-key", "bob")
    with page.expect_request(
        lambda r: r.url.endswith("/v1/engine/events") and r.headers.get("authorization") == "Bearer bob"
    ):
        page.click("#key-submit")
    expect(page.locator("#connection")).to_have_text("live")
    expect(page.locator("#messages li")).to_have_count(0)
    expect(page.locator("#session-header")).to_have_text("No session yet: the first message starts one.")
    expect(page.locator("#session-list li")).to_have_count(0)  # bob's sessions: none


def test_stop_stops_the_shown_sessions_turn_while_another_sessions_runs(page: Page, thread_server):
    """Two sessions with a turn each running at once: back on the first, Stop is its own and stops it
    alone (before, the page knew one running turn, the last started: Stop was off, or stopped it).
    The turns advance only by the steps the test lets through, about 15: the first's greedy reply runs
    222 tokens, the second's 284."""
    base, llm = thread_server
    open_page(page, base, None, 64)

    def status(request_id: str) -> str:
        return httpx.get(f"{base}/v1/requests/{request_id}", timeout=30).json()["state"]

    with StepGate(llm) as gate:
        page.click("#new-session")
        ask(page, "Write at length, first session.", temperature="0", **{"max-tokens": "300"})
        assert gate.entered.wait(30)  # the first turn is in its first step
        gate.allow(2)
        expect(page.locator("#messages li.assistant .text").first).not_to_be_empty()
        first = page.locator("#session-header").inner_text().removeprefix("Session ")
        first_id = page.locator("#messages li.assistant").first.get_attribute("data-request-id")
        page.click("#new-session")
        ask(page, "The second session, at length.", temperature="0", **{"max-tokens": "300"})
        take_in_the_pages_calls(gate, llm, lambda: len(llm.monitor.live) == 2)  # the second turn is in
        gate.allow(2)
        expect(page.locator("#messages li.assistant .text").first).not_to_be_empty()
        second_id = page.locator("#messages li.assistant").first.get_attribute("data-request-id")
        second = page.locator("#session-header").inner_text().removeprefix("Session ")
        page.click(f"#session-list li[data-id='{first}']")
        take_in_the_pages_calls(gate, llm, lambda: page.locator("#session-header").inner_text() == f"Session {first}")
        reply = page.locator(f"#messages li.assistant[data-request-id='{first_id}']")
        expect(reply.locator(".text")).not_to_be_empty()  # its reply, shown again as it streams on
        expect(page.locator("#stop")).to_be_enabled()  # the first session's turn still streams
        page.click("#stop")
        take_in_the_pages_calls(gate, llm, lambda: status(first_id) == "aborted")  # its abort applied
        assert status(second_id) in ("prefill", "decoding")
        gate.open()
    expect(reply).to_have_attribute("data-finish", "abort", timeout=ANSWER_TIMEOUT_MS)
    expect(page.locator(f"#session-list li[data-id='{second}'] .meta")).to_contain_text(
        "2 messages · idle", timeout=ANSWER_TIMEOUT_MS
    )
    assert status(second_id) == "finished"  # not stopped
    wait_idle_and_check(llm, pinned=pinned(llm))
