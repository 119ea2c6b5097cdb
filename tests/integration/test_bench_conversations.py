"""`pdserve bench` multi-turn conversations against a fake OpenAI server on a real socket: each turn waits for the
previous answer and the think time, sends the history with the answers as streamed, is numbered in the results,
and a failed turn ends its conversation."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from services.bench.cli import main as bench_main
from services.bench.datasets import BenchRequest
from services.bench.prefix_workloads import Conversation
from services.bench.runner import BenchConfig, run_benchmark

ANSWER_S = 0.05  # the fake server's time to answer
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class EchoServer:
    """Answers every streamed POST with two token chunks naming the request ("ans-<n>", "!"), after ANSWER_S, then
    a usage chunk whose prompt_tokens is the body's length in characters and cached_tokens half of it. A prompt
    containing "FAIL" gets HTTP 500. Keeps every body and the loop time it arrived / was answered."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.arrived: list[float] = []
        self.answered: list[float] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))  # fmt: skip
                body = json.loads(await reader.readexactly(length))
                n = len(self.bodies)
                self.bodies.append(body)
                self.arrived.append(loop.time())
                if "FAIL" in json.dumps(body):
                    msg = b'{"error": {"message": "boom"}}'
                    writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(msg), msg))  # fmt: skip
                    await writer.drain()
                    continue
                writer.write(HEAD)
                await asyncio.sleep(ANSWER_S)
                chat = "messages" in body
                for piece in (f"ans-{n}", "!"):
                    choice = {"delta": {"content": piece}} if chat else {"text": piece}
                    self._chunk(writer, {"choices": [choice]})
                prompt = len(json.dumps(body["messages"] if chat else body["prompt"]))
                usage = {"prompt_tokens": prompt, "completion_tokens": 2,
                         "prompt_tokens_details": {"cached_tokens": prompt // 2}}  # fmt: skip
                self._chunk(writer, {"choices": [], "usage": usage})
                data = b"data: [DONE]\n\n"
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
                await writer.drain()
                self.answered.append(loop.time())
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, event: dict) -> None:
        data = f"data: {json.dumps(event)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _run(server: EchoServer, items, endpoint: str = "chat", **config):
    async def go():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            cfg = BenchConfig(base_url=url, model="m", endpoint=endpoint, progress=False, **config)
            return await run_benchmark(cfg, items)
        finally:
            srv.close()

    return asyncio.run(go())


def _conv(name: str, turns: int, think_s: float = 0.0, prefix: str = "") -> Conversation:
    return Conversation(tuple(BenchRequest(f"{name}-q{k}", 3, 2, prefix=prefix) for k in range(turns)), think_s)


def test_turns_send_their_history_after_the_answer_and_the_think_time():
    server = EchoServer()
    result = _run(server, [_conv("x", 3, think_s=0.2), _conv("y", 3, think_s=0.2)])
    assert len(server.bodies) == 6 and [r.turn for r in result.records] == [1, 2, 3, 1, 2, 3]
    assert all(r.success for r in result.records)
    by_user = {b["messages"][-1]["content"]: (i, b) for i, b in enumerate(server.bodies)}
    for name in ("x", "y"):
        i1, first = by_user[f"{name}-q0"]
        i3, third = by_user[f"{name}-q2"]
        i2, _ = by_user[f"{name}-q1"]
        assert first["messages"] == [{"role": "user", "content": f"{name}-q0"}]
        # the answers the server streamed, in order, between the user messages
        assert third["messages"] == [
            {"role": "user", "content": f"{name}-q0"}, {"role": "assistant", "content": f"ans-{i1}!"},
            {"role": "user", "content": f"{name}-q1"}, {"role": "assistant", "content": f"ans-{i2}!"},
            {"role": "user", "content": f"{name}-q2"},
        ]  # fmt: skip
        # a turn is sent only once the previous answer has ended and the think time has passed
        assert server.arrived[i2] - server.answered[i1] >= 0.2 and server.arrived[i3] - server.answered[i2] >= 0.2
    # both conversations started together (rate inf): their first turns overlapped
    assert abs(server.arrived[by_user["x-q0"][0]] - server.arrived[by_user["y-q0"][0]]) < ANSWER_S
    s = result.summary
    assert s["num_prompts"] == 6 and list(s["per_turn"]) == ["1", "2", "3"]
    assert s["per_turn"]["3"]["total_input_tokens"] > s["per_turn"]["1"]["total_input_tokens"]  # history grows
    reported = [r.cached_tokens for r in result.records]
    assert s["total_cached_tokens"] == sum(reported) and s["prefix_cache_hit_rate"] == pytest.approx(
        sum(reported) / s["total_input_tokens"]
    )
    detailed = result.to_json(detailed=True)
    assert detailed["turns"] == [1, 2, 3, 1, 2, 3] and detailed["cached_tokens"] == reported


def test_completions_turns_run_the_history_together_after_the_prefix():
    server = EchoServer()
    _run(server, [_conv("c", 2, prefix="SYS|")], endpoint="completions")
    assert [b["prompt"] for b in server.bodies] == ["SYS|c-q0", "SYS|c-q0ans-0!c-q1"]


def test_a_failed_turn_ends_its_conversation_only():
    server = EchoServer()
    bad = Conversation((BenchRequest("b-q0", 3, 2), BenchRequest("FAIL", 3, 2), BenchRequest("b-q2", 3, 2)))
    result = _run(server, [bad, _conv("ok", 2), BenchRequest("single", 3, 2)], max_concurrency=2)
    sent = [b["messages"][-1]["content"] for b in server.bodies]
    assert "b-q2" not in sent and sorted(sent) == ["FAIL", "b-q0", "ok-q0", "ok-q1", "single"]
    recs = result.records
    assert [(r.turn, r.success) for r in recs] == [(1, True), (2, False), (3, False), (1, True), (2, True),
                                                   (None, True)]  # fmt: skip
    assert "HTTP 500" in recs[1].error and recs[2].error == "not sent: turn 2 of its conversation failed"
    assert (result.summary["completed"], result.summary["failed"]) == (4, 2)
    assert result.summary["per_turn"]["3"]["failed"] == 1


@pytest.fixture
def echo_url():
    """An EchoServer on its own thread's loop, for the CLI (which runs its own event loop)."""
    server, loop = EchoServer(), asyncio.new_event_loop()
    srv = loop.run_until_complete(asyncio.start_server(server.handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.mark.parametrize("dataset", ["shared-prefix", "multi-turn"])
def test_cli_runs_the_prefix_workloads(echo_url, tokenizer, checkpoint, tmp_path, capsys, dataset):
    server, url = echo_url
    out = tmp_path / "r.json"
    flags = {
        "shared-prefix": ["--num-prompts", "6", "--shared-prefix-groups", "2", "--shared-prefix-len", "30",
                          "--shared-prefix-suffix-len", "10", "--shared-prefix-output-len", "2"],
        "multi-turn": ["--multi-turn-conversations", "2", "--multi-turn-turns", "3", "--multi-turn-input-len", "5",
                       "--multi-turn-output-len", "2", "--multi-turn-think-time", "0.01"],
    }[dataset]  # fmt: skip
    code = bench_main(["--base-url", url, "--model", "m", "--tokenizer", str(checkpoint), "--endpoint", "chat",
                       "--dataset-name", dataset, *flags, "--disable-tqdm", "--result-file", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["prefix_cache_hit_rate"] == pytest.approx(
        result["total_cached_tokens"] / result["total_input_tokens"]
    )
    assert "Prefix cache hit rate (%):" in printed
    if dataset == "shared-prefix":
        assert result["workload"]["prompt_share"] == pytest.approx(30 / 40) and "prompt share 75.0%" in printed
        systems = {b["messages"][0]["content"] for b in server.bodies}
        assert len(systems) == 2 and all(b["messages"][0]["role"] == "system" for b in server.bodies)
    else:
        assert list(result["per_turn"]) == ["1", "2", "3"] and "Per turn (ms)" in printed
        assert max(len(b["messages"]) for b in server.bodies) == 5
