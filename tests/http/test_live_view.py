"""The live view: ``GET /v1/pie/state`` (the page store as JSON) and ``GET /`` (the page that
draws it), on the real HTTP server over a tiny engine.

The state is checked after a best-of-4 (a flushed base, its snapshot and four generating
forks, kept alive while it is read): the forks branch off the base's pages, which are marked
shared by all six holders, nothing is mutated by reading, and the output limits hold. The
page is checked in a real headless Chromium (Debian's ``chromium``, driven by Playwright
with ``executable_path``; the test skips without them): it draws the forest, and its
playground streams a reply. ``PIE_CTX_SCREENSHOT=path`` saves a screenshot of it.
"""

from __future__ import annotations

import os
import shutil
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from pie_ctx import Context, Runtime, Sampler
from runtime.boot import boot_engine
from runtime.server.http import state as live_state
from runtime.server.testing import serve_http_in_background
from tests.sdk.harness import tiny_engine

pytestmark = pytest.mark.fp32_only("the view reads page bookkeeping, which no dtype changes")

PROMPT = ("A paged KV cache keeps the keys and values of every token in fixed-size pages. "
          "Forks of a context share its committed pages instead of copying them. "
          "Explain, in one sentence, why that makes best-of-n sampling cheap.")


@asynccontextmanager
async def best_of_4(engine: Any, *, max_tokens: int = 24):
    """A base context (flushed, saved as snapshot ``base``) and four forks that generated
    ``max_tokens`` each; yields ``(base, forks, gens)`` with the generations started but not
    yet read, and keeps everything alive until the block exits."""
    async with Runtime.local(engine=engine) as rt:
        base = Context(rt).user(PROMPT).cue()
        await base.flush()
        await base.save("base")
        forks = [base.fork() for _ in range(4)]
        gens = [f.generate(Sampler.temperature(1.0, seed=i), max_tokens=max_tokens,
                           ignore_eos=True) for i, f in enumerate(forks)]
        yield base, forks, gens


def _describe(store: Any) -> Any:
    """Everything a read could disturb: counts, pins, LRU order, lazy caches, snapshots."""
    trie = store.trie
    return (
        store.stats(),
        store.cached_page_ids(),
        [(cid, None if s.tip is None else s.tip.page_id, list(s.working), len(s.tokens),
          s.committed_ids is None, s.ids_shared) for cid, s in store.context_states()],
        sorted((n.page_id, n.holders, n.pins, n.num_children, dict(n.owner_pins or {}))
               for n in trie.by_hash.values()),
        dict(trie.pages_of),
        [(key, snap.state.tip.page_id, list(snap.state.working)) for key, snap in store.snapshots],
    )


def _check_forest(state: dict[str, Any], base_handle: int, fork_handles: list[int]) -> None:
    nodes = {n["page"]: n for n in state["nodes"]}
    for n in state["nodes"]:  # parents come first, and every parent is there
        assert n["parent"] is None or n["parent"] in nodes
        assert n["state"] == ("cached" if not n["pinned"] else
                              "shared" if n["holders"] > 1 else "committed")
    contexts = {c["handle"]: c for c in state["contexts"]}
    assert sorted(contexts) == sorted([base_handle, *fork_handles])
    base = contexts[base_handle]
    assert base["num_committed_pages"] >= 2
    assert base["committed_pages"][-1] == base["tip"]
    # the base's pages are shared by all six holders: base, snapshot, four forks
    for page in base["committed_pages"]:
        assert nodes[page]["state"] == "shared" and nodes[page]["holders"] == 6
    for handle in fork_handles:
        fork = contexts[handle]
        chain = fork["committed_pages"]
        assert chain[: len(base["committed_pages"])] == base["committed_pages"]  # branches off
        assert len(chain) > len(base["committed_pages"])  # and grew its own pages
        assert fork["num_shared_pages"] >= base["num_committed_pages"]
        assert [nodes[p]["parent"] for p in chain] == [None, *chain[:-1]]
        own = chain[fork["num_shared_pages"]:]
        assert own and all(nodes[p]["state"] == "committed" for p in own)
        assert fork["seq_len"] == len(chain) * state["engine"]["page_size"] + \
            fork["num_working_tokens"]
    # page accounting adds up
    p = state["pages"]
    assert p["num_pages_free"] + p["num_pages_working"] + p["num_pages_committed"] + \
        p["num_pages_cached"] == p["num_pages_total"] == state["engine"]["num_pages"]
    assert p["num_pages_committed"] == sum(1 for n in state["nodes"] if n["pinned"])
    working = [w for h in (*state["contexts"], *state["snapshots"]) for w in h["working_pages"]]
    working += [w for c in state["contexts"] for w in c["rollback_working_pages"]]
    assert len(working) == len(set(working)) == p["num_pages_working"]


async def test_state_shows_a_best_of_4_forest_without_touching_the_store(tiny_folder) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            serve_http_in_background(engine) as url, \
            httpx.AsyncClient(base_url=url) as http, \
            best_of_4(engine) as (base, forks, gens):
        store = engine.store
        # mid-generation: each fork is shown by its job's shadow, its own state kept apart
        for gen in gens:
            await gen.__anext__()
        before = _describe(store)  # the read itself is synchronous: no step interleaves
        live_state.read_state(engine)
        assert _describe(store) == before
        response = await http.get("/v1/pie/state")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert response.headers["cache-control"] == "no-store"
        state = response.json()
        base_working = min(state["contexts"], key=lambda c: c["handle"])["working_pages"]
        for c in state["contexts"]:
            if c["status"] == "running":  # its own state (a copy of the base's tail) waits
                assert c["job"]["kind"] == "generate"
                assert len(c["rollback_working_pages"]) == len(base_working)
        for gen in gens:
            await gen.text()

        # the forks are done and alive (the engine is idle): a forest off the base's pages
        before = _describe(store)
        state = (await http.get("/v1/pie/state")).json()
        assert _describe(store) == before
        store.check_invariants()
        # handles go in creation order: the base, then its forks
        base_handle, *handles = sorted(c["handle"] for c in state["contexts"])
        _check_forest(state, base_handle, handles)
        assert all(c["status"] == "idle" and c["job"] is None for c in state["contexts"])
        assert len({c["owner"] for c in state["contexts"]}) == 1
        assert state["engine"]["model"] == engine.model_name
        assert state["engine"]["page_size"] == store.page_size
        for key in ("dtype", "weights", "kv_dtype", "device", "attention"):
            assert isinstance(state["engine"][key], str)
        assert state["stats"]["num_contexts"] == 5 and state["stats"]["num_snapshots"] == 1
        assert state["stats"]["num_pages_used"] == state["pages"]["num_pages_working"] + \
            state["pages"]["num_pages_committed"]
        assert state["jobs"] == {"waiting": 0, "active": 0, "num_preemptions": 0}
        [snap] = state["snapshots"]
        base_entry = next(c for c in state["contexts"] if c["handle"] == base_handle)
        assert (snap["namespace"], snap["name"]) == ("default", "base")
        assert snap["tip"] == base_entry["tip"] and snap["seq_len"] == base_entry["seq_len"]
        assert snap["committed_pages"] == base_entry["committed_pages"]
        assert state["truncated"] == {"nodes": 0, "contexts": 0, "snapshots": 0}
        counters = state["counters"]
        assert counters["tokens_computed"] == state["stats"]["tokens_computed"] > 0
        assert counters["time"] == state["time"]
        for key in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens"):
            assert key in counters  # from the app's Metrics
        assert state["cached_pages"] == {"count": 0, "evictable": 0, "lru": []}

        # a released fork leaves its own pages cached (an evictable leaf first)
        gone = next(c for c in state["contexts"] if c["handle"] == handles[0])
        own = gone["committed_pages"][gone["num_shared_pages"]:]
        await forks[0].release()
        state = (await http.get("/v1/pie/state")).json()
        nodes = {n["page"]: n for n in state["nodes"]}
        assert all(nodes[p]["state"] == "cached" and not nodes[p]["pinned"] for p in own)
        assert nodes[own[-1]]["evictable"] and not nodes[own[0]]["evictable"]
        assert state["cached_pages"]["count"] == len(own) == state["pages"]["num_pages_cached"]
        assert state["cached_pages"]["lru"] == store.cached_page_ids()
        store.check_invariants()


async def test_state_output_is_capped_and_stays_a_forest(tiny_folder, monkeypatch) -> None:
    async with tiny_engine(tiny_folder) as engine, \
            best_of_4(engine, max_tokens=12) as (base, forks, gens):
        for gen in gens:
            await gen.text()
        await forks[3].release()  # some cached pages too
        full = live_state.read_state(engine)
        assert full["cached_pages"]["count"] > 0
        monkeypatch.setattr(live_state, "MAX_NODES", 5)
        monkeypatch.setattr(live_state, "MAX_HOLDERS", 2)
        monkeypatch.setattr(live_state, "MAX_CHAIN", 3)
        small = live_state.read_state(engine)
        assert len(small["nodes"]) == 5
        assert small["truncated"]["nodes"] == len(full["nodes"]) - 5
        assert small["truncated"]["contexts"] == 2 and len(small["contexts"]) == 2
        seen: set[int] = set()
        for n in small["nodes"]:  # still a forest: every parent shown first
            assert n["parent"] is None or n["parent"] in seen
            seen.add(n["page"])
        for c in small["contexts"]:
            assert len(c["committed_pages"]) == 3 and c["committed_pages"][-1] == c["tip"]
        engine.store.check_invariants()


# -------------------------------------------------------------------- headless Chromium

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    for name in (os.environ.get("PIE_CTX_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


@asynccontextmanager
async def _browser_page(stack: AsyncExitStack):
    async_api = pytest.importorskip("playwright.async_api", reason="pip install playwright")
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium (apt-get install chromium)")
    pw = await stack.enter_async_context(async_api.async_playwright())
    browser = await pw.chromium.launch(executable_path=executable, headless=True,
                                       args=CHROMIUM_FLAGS)
    stack.push_async_callback(browser.close)
    page = await browser.new_page(viewport={"width": 1440, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield page, errors


async def test_live_view_in_headless_chromium(tiny_folder) -> None:
    async with AsyncExitStack() as stack:
        page, errors = await stack.enter_async_context(_browser_page(stack))
        shot = os.environ.get("PIE_CTX_SCREENSHOT")
        if shot:  # the picture in the docs: the real default model, so the replies read well
            engine = await stack.enter_async_context(
                boot_engine(None, page_size=16, num_pages=1024, progress=False))
        else:
            engine = await stack.enter_async_context(tiny_engine(tiny_folder))
        url = await stack.enter_async_context(serve_http_in_background(engine))
        base, forks, gens = await stack.enter_async_context(best_of_4(engine))
        for gen in gens:
            await gen.text()
        async with httpx.AsyncClient(base_url=url) as http:
            state = (await http.get("/v1/pie/state")).json()
        num_shared = sum(1 for n in state["nodes"] if n["state"] == "shared")
        num_working = sum(len(h["working_pages"]) for h in (*state["contexts"],
                                                           *state["snapshots"]))

        await page.goto(url + "/")
        # the forest: five contexts and the snapshot, forks branching off shared pages
        await page.wait_for_function(
            "([shared, working]) => document.querySelectorAll('#forest rect.shared').length"
            " === shared && document.querySelectorAll('#forest rect.working').length"
            " === working", arg=[num_shared, num_working], timeout=20_000)
        labels = await page.locator("#forest text").all_text_contents()
        assert sum(t.startswith("ctx #") for t in labels) == 5, labels
        assert any("default/base" in t for t in labels), labels
        assert await page.locator("#forest path.edge").count() >= 4  # 3 forks + snapshot
        assert await page.locator("#t-contexts").inner_text() == "5"
        assert await page.locator("#t-snapshots").inner_text() == "1"
        assert "model " in await page.locator("#pg-model").inner_text()

        # the playground streams a reply (one choice)
        await page.select_option("#n", "1")
        await page.fill("#max-tokens", "16")
        await page.fill("#prompt", "Say something about pages.")
        await page.click("#send")
        await page.wait_for_function(
            "() => document.querySelector('#send').textContent === 'Send' &&"
            " (document.querySelector('#reply-0 .text')?.textContent || '').length > 0",
            timeout=30_000)
        assert await page.locator("#pg-error").inner_text() == ""
        who = await page.locator("#reply-0 .who").inner_text()
        assert who.endswith(("length", "stop")), who
        # the chart has seen the traffic (a few polls later)
        await page.wait_for_function(
            "() => document.querySelector('#tp-now').textContent !== '–'", timeout=10_000)

        if shot:  # a best-of-4 over HTTP too, then a few more polls for the charts
            await page.select_option("#n", "4")
            await page.fill("#max-tokens", "40")
            await page.fill("#prompt", "Write one sentence about sharing memory.")
            await page.click("#send")
            await page.wait_for_function(
                "() => document.querySelector('#send').textContent === 'Send'", timeout=120_000)
            assert await page.locator("#pg-error").inner_text() == ""
            await page.wait_for_timeout(3_000)
            Path(shot).parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=shot, full_page=True)
        assert errors == []


async def test_live_view_sends_the_key_from_the_url_fragment(tiny_folder) -> None:
    async with AsyncExitStack() as stack:
        page, errors = await stack.enter_async_context(_browser_page(stack))
        engine = await stack.enter_async_context(tiny_engine(tiny_folder))
        url = await stack.enter_async_context(serve_http_in_background(engine,
                                                                       api_key="sekrit"))
        await page.goto(url + "/")  # no key: the page says how to give one
        await page.wait_for_function(
            "() => document.querySelector('#banner').style.display === 'block'", timeout=10_000)
        assert "#key=" in await page.locator("#banner").inner_text()
        await page.goto(url + "/#key=sekrit")
        await page.reload()  # a fragment change alone does not reload the page
        await page.wait_for_function(
            "() => document.querySelector('#status').textContent.startsWith('live')",
            timeout=10_000)
        assert await page.locator("#banner").is_hidden()
        assert "model " in await page.locator("#pg-model").inner_text()
        # the refused fetches logged console errors before the key was given; none after
        assert all("401" in e for e in errors), errors
