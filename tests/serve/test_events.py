"""GET /v1/events (minillm/serve/events.py, live.py): the ring buffer alone, then a real server read with httpx."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest
from event_reader import Reader
from servers import SERVERS, metrics, running_server

from minillm.serve.events import EventBus, TooManySubscribers

MODEL = "smollm2-135m-instruct"


# --- the ring alone (no model) ------------------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


def test_ring_resume_unknown_id_cap_and_drop():
    async def body():
        lines = []
        bus = EventBus(capacity=4, max_subscribers=2, log=lines.append)
        assert not bus.active
        for i in range(6):
            bus.publish("step", {"step": i})  # ids 1..6; the ring keeps 3..6
        sub, note = bus.subscribe("4", "a")
        assert note == ": minillm events: resuming after Last-Event-ID 4\n\n"
        assert [json.loads(f.decode().split("data: ")[1])["step"] for f in bus.take(sub)] == [4, 5]
        hello = bus.hello()  # each stream's first frame: no id line, which server, which ids the ring keeps
        assert hello.startswith("data: ") and hello.endswith("\n\n")
        assert {k: v for k, v in json.loads(hello[6:]).items() if k != "t"} == {
            "type": "hello",
            "server": bus.server,
            "oldest": 3,
            "newest": 6,
        }
        other, note = bus.subscribe("1", "b")  # id 1 left the ring
        assert "Last-Event-ID '1' is not in the ring (the ring keeps ids 3..6)" in note
        assert bus.take(other)[0].startswith(b"id: 3\n")
        with pytest.raises(TooManySubscribers, match="2 event streams are open"):
            bus.subscribe(None, "c")
        for i in range(6, 12):  # `sub` reads nothing meanwhile: its next event (7) leaves the ring
            bus.publish("step", {"step": i})
        await asyncio.sleep(0)  # the wake-up runs on the loop
        assert sub.dropped is not None and other.dropped is not None and not bus.active
        assert len(lines) == 2  # both fell behind; the order they are dropped in is not the point
        assert sorted(lines)[0].startswith("events: dropped subscriber #1 (a): it fell behind: 2 events")

    run(body())


def _ids(bodies: list[bytes]) -> list[int]:
    return [int(line[4:]) for body in bodies for line in body.decode().splitlines() if line.startswith("id: ")]


def test_a_send_that_hangs_counts_its_frames_as_unsent():
    """Ring of 4. A reader's send of ids 1..2 hangs (its socket takes nothing); the cursor stays at 0
    until that send completes, so when id 5 pushes id 1 out of the ring the reader is dropped at once
    (a cursor moved before the send would wait for id 7). A second reader whose send is only slow gets
    every id in order, with no gap, or would be dropped: never a skip."""

    async def body():
        log: list[str] = []
        bus = EventBus(capacity=4, log=log.append)
        stuck, opening = bus.subscribe(None, "stuck")
        slow, slow_opening = bus.subscribe(None, "slow")
        gate, slow_gate = asyncio.Event(), asyncio.Event()
        got: list[bytes] = []

        async def stuck_send(message):
            if b"id: " in message["body"]:
                await gate.wait()  # never set: the frames are handed over but never taken

        async def slow_send(message):
            if b"id: " in message["body"]:
                await slow_gate.wait()
                got.append(message["body"])

        for i in (1, 2):
            bus.publish("step", {"i": i})
        tasks = [asyncio.create_task(bus.stream(stuck, opening, stuck_send))]
        tasks.append(asyncio.create_task(bus.stream(slow, slow_opening, slow_send)))
        for _ in range(3):
            await asyncio.sleep(0)  # both streams are now inside the send of ids 1..2
        assert (stuck.cursor, slow.cursor) == (0, 0)
        for i in (3, 4):
            bus.publish("step", {"i": i})
            await asyncio.sleep(0)
        assert stuck.dropped is None  # the ring (1..4) still holds id 1
        slow_gate.set()  # the slow reader's send completes: 1..2, then 3..4
        for _ in range(6):
            await asyncio.sleep(0)
        assert slow.cursor == 4 and _ids(got) == [1, 2, 3, 4]
        bus.publish("step", {"i": 5})  # the ring is 2..5: id 1, never received by "stuck", is gone
        await asyncio.sleep(0)
        assert stuck.dropped == "it fell behind: 1 events it had not been sent left the ring of 4"
        assert stuck.cursor == 0 and log[0].endswith("it may reconnect with Last-Event-ID 0")
        for _ in range(6):
            await asyncio.sleep(0)
        assert slow.dropped is None and _ids(got) == [1, 2, 3, 4, 5]
        for task in tasks:
            task.cancel()

    run(body())


def test_ui_without_its_file_is_a_404_naming_why(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from minillm.serve import app as app_module

    monkeypatch.setattr(app_module, "UI_PAGE", tmp_path / "missing" / "ui.html")
    from minillm.serve.metrics import ServerMetrics
    from minillm.serve.worker import Worker

    worker = Worker(MODEL, metrics=ServerMetrics())  # never started: /ui reads no model
    r = TestClient(app_module.create_app(worker)).get("/ui")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "ui_not_installed" and "missing" in error["message"] and "reinstall" in error["message"]


# --- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(SERVERS))
def server(tmp_path_factory, request):
    """One model's server, then a several-model server (``servers.SERVERS``): the same events from both."""
    flags = ("--events-buffer", "48", "--max-event-subscribers", "24", "-v", "quiet", *SERVERS[request.param])
    with running_server(tmp_path_factory.mktemp("events"), *flags) as (url, log):
        yield url, log


def chat(url, prompt, max_tokens, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    answer = httpx.post(url + "/v1/chat/completions", json={**body, "temperature": 0, **extra}, timeout=300)
    assert answer.status_code == 200, answer.text  # an error answer names itself, never a None further on
    return answer.json()


def concurrently(fn, args):
    """``fn(*a)`` for each ``a`` in ``args`` on threads of their own; their results in order. A call
    that raised raises here, with its own exception (a thread's exception would otherwise be lost)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args)) as pool:
        return list(pool.map(lambda a: fn(*a), args))


def finished(ids):
    return lambda evs: {e["id"] for _, e in evs if e["type"] == "request.finished"} >= set(ids)


@pytest.mark.slow
def test_three_requests_stream_in_order_and_reconnect_gets_what_it_missed(server):
    url, _ = server
    a, b = Reader(url), Reader(url)
    time.sleep(0.5)
    prompts = [("What is the capital of France?", 6), ("Name a colour.", 6), ("Say hi.", 6)]
    answers = concurrently(lambda p, n: chat(url, p, n), prompts)
    rids = [r["id"] for r in answers]
    a.wait(finished(rids))
    ids = [i for i, _ in a.events]
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # increasing, none missing
    evs = [e for _, e in a.events]
    steps = [e for e in evs if e["type"] == "step"]
    assert any({r["id"] for r in s["rows"]} == set(rids) for s in steps)  # one step batched all three
    for rid, answer in zip(rids, answers, strict=True):
        mine = [e for e in evs if e.get("id") == rid]
        kinds = [e["type"] for e in mine]
        assert kinds[0] == "request.queued" and kinds[1] == "request.admitted" and kinds[-1] == "request.finished"
        usage = answer["usage"]
        admitted, end = mine[1], mine[-1]
        assert admitted["prompt_tokens"] == end["prompt_tokens"] == usage["prompt_tokens"]
        tokens = [e for e in mine if e["type"] == "request.token"]
        assert [t["n"] for t in tokens] == list(range(usage["completion_tokens"]))
        content = answer["choices"][0]["message"]["content"]
        assert "".join(t["text"] for t in tokens) == content
        # the detokenizer's releases, step by step, are the answer; the end carries it whole
        assert "".join(e["text"] for e in mine if e["type"] == "request.text") == content == end["text"]
        # the step rows are the scheduler's batch: its prompt went in once, then one decode row per token
        rows = [r for s in steps for r in s["rows"] if r["id"] == rid]
        fed = sum(r["tokens"] for r in rows if r["phase"] == "prefill")
        assert fed == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        assert sum(r["phase"] == "decode" for r in rows) == usage["completion_tokens"] - 1
        token_steps = [t["step"] for t in tokens]
        assert token_steps == [s["step"] for s in steps for r in s["rows"] if r["id"] == rid][-len(tokens) :]
        trace = httpx.get(f"{url}/v1/traces/{rid}").json()["events"]
        decodes = [e["data"] for e in trace if e["phase"] == "decode"]
        assert [t["top"] for t in tokens[1:]] == [d["candidates"] for d in decodes]
    # a page that went away misses a request; reconnecting with Last-Event-ID gets exactly that
    a.stop.set()
    last = a.events[-1][0]
    missed = chat(url, "Count to three.", 4)
    b.wait(finished([missed["id"]]))
    again = Reader(url, last_id=str(last))
    again.wait(lambda evs: len(evs) >= len([e for e in b.events if e[0] > last]))
    assert again.events == [e for e in b.events if e[0] > last]
    assert again.comments[0] == f": minillm events: resuming after Last-Event-ID {last}"
    unknown = Reader(url, last_id="999999")
    unknown.wait(lambda evs: len(evs) >= 1)
    assert "Last-Event-ID '999999' is not in the ring" in unknown.comments[0]
    assert "starting from the oldest kept event" in unknown.comments[0]
    for r in (b, again, unknown):
        r.stop.set()


@pytest.mark.slow
def test_slow_motion_holds_one_request_and_pool_equals_metrics(server):
    url, _ = server
    reader = Reader(url)
    time.sleep(0.3)
    replayed = len(reader.events)  # what the ring still held of earlier tests' requests
    before = metrics(url)
    done = {}
    t = threading.Thread(target=lambda: done.update(chat(url, "Say yes.", 3, slow_motion_s=3.0)))
    t.start()
    # while the only request sits out its 3 s, the pool cannot change: its last event equals /metrics
    reader.wait(lambda evs: any(e["type"] == "pool" and e["blocks_used"] > 0 for _, e in evs[replayed:]))
    pool = [e for _, e in reader.events[replayed:] if e["type"] == "pool"][-1]
    now = metrics(url)
    assert pool["blocks_used"] * pool["bytes_per_block"] == now["minillm_kv_cache_bytes_reserved"]
    assert pool["blocks_used"] == sum(len(t) for t in pool["tables"].values()) - _shared(pool["tables"])
    # a plain request meanwhile runs its steps while the slow one sits out
    other = chat(url, "Name a colour.", 6)
    t.join()
    rid = done["id"]
    # the answers came over HTTP; the stream may still be delivering their last step: read to both ends
    ended = lambda evs: {rid, other["id"]} <= {e.get("id") for _, e in evs if e["type"] == "request.finished"}  # noqa: E731
    reader.wait(ended)
    steps = [e for _, e in reader.events[replayed:] if e["type"] == "step"]
    fed = [s["step"] for s in steps if rid in [r["id"] for r in s["rows"]]]
    held = [s["step"] for s in steps if rid in s["held"]]
    assert len(fed) == 3  # prefill, then 2 decodes: each a step it was fed, never listed as held
    assert not set(fed) & set(held)
    # held exactly on the plain request's steps that ran between the slow one's first and last step
    others = [s["step"] for s in steps if other["id"] in [r["id"] for r in s["rows"]]]
    assert held and set(held) <= set(others) and all(fed[0] < h < fed[-1] for h in held)
    # no step ran while every running request sat out (a step then feeds nobody): the scheduler's step
    # numbers between the slow request's first and last step are all published, each feeding a row
    between = [s for s in steps if fed[0] <= s["step"] <= fed[-1]]
    assert [s["step"] for s in between] == list(range(fed[0], fed[-1] + 1))
    assert all(s["rows"] for s in between)
    after = metrics(url)  # never counted in the latency metrics
    for name in ("minillm_time_to_first_token_seconds_count", "minillm_e2e_request_latency_seconds_count"):
        assert after[name] == before[name] + 1  # the plain request's
    made = 3 + other["usage"]["completion_tokens"]
    assert after["minillm_generation_tokens_total"] == before["minillm_generation_tokens_total"] + made
    reader.stop.set()


def _shared(tables: dict) -> int:
    blocks = [b for t in tables.values() for b in t]
    return len(blocks) - len(set(blocks))


def stuck_subscriber(url: str) -> socket.socket:
    """A client that asks for the stream and never reads (a tiny receive buffer fills at once)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((host, int(port)))
    s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return s


def greedy_ids(url, answers):
    out = []
    for a in answers:
        trace = httpx.get(f"{url}/v1/traces/{a['id']}").json()["events"]
        decodes = [e["data"] for e in trace if e["phase"] == "decode"]
        out.append([decodes[0]["input_token"]] + [d["token"] for d in decodes])
    return out


@pytest.mark.slow
def test_20_subscribers_that_never_read_change_no_token(server):
    url, log = server
    prompt = "Write a long story about a lighthouse keeper and the sea. " * 30
    args = [(prompt + str(i), 40) for i in range(3)]
    alone = greedy_ids(url, concurrently(lambda p, n: chat(url, p, n), args))
    stuck = [stuck_subscriber(url) for _ in range(20)]
    time.sleep(0.5)
    watched = greedy_ids(url, concurrently(lambda p, n: chat(url, p, n), args))
    assert watched == alone
    for s in stuck:
        s.close()
    # the server's small send buffers (--socket-send-buffer) fill, the stuck streams fall behind the
    # ring of 48 events and are dropped, each with its reason in the log
    dropped = [line for line in log.read_text().splitlines() if "events: dropped subscriber" in line]
    assert len(dropped) == 20 and all("it fell behind" in line for line in dropped), dropped
