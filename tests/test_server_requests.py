"""Request merging, routing, retries and failover of the vllm_server client, against scripted HTTP
answers (`httpx.MockTransport`); the real servers are in test_sampler_vllm_server.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from lit_grpo.samplers.arguments import SamplerTimeout
from lit_grpo.samplers.server.requests import Coalescer, ReplicaRouter
from lit_grpo.samplers.server.weight_files import ServerError

pytestmark = pytest.mark.timeout(30)


def test_concurrent_requests_for_one_key_go_out_as_one_and_are_dealt_in_order():
    sent = []

    async def send(n, deadline):
        sent.append((n, deadline))
        await asyncio.sleep(0.01)
        return list(range(n))

    async def run():
        c = Coalescer(window_s=0.005)
        return await asyncio.gather(
            c.request("a", 1, 10.0, send),
            c.request("a", 2, 20.0, send),
            c.request("b", 1, None, send),
            c.request("a", 3, 5.0, send),
        )

    a1, a2, b, a3 = asyncio.run(run())
    assert sorted(sent) == [(1, None), (6, 20.0)]  # the merged request keeps the latest deadline
    assert (a1, a2, a3, b) == ([0], [1, 2], [3, 4, 5], [0])


def test_merging_stops_at_max_n_and_a_failure_reaches_every_caller():
    sizes = []

    async def send(n, deadline):
        sizes.append(n)
        raise ServerError("vLLM server http://x: boom")

    async def run():
        c = Coalescer(window_s=0.005, max_n=4)
        return await asyncio.gather(*(c.request("k", 2, None, send) for _ in range(3)), return_exceptions=True)

    results = asyncio.run(run())
    assert sorted(sizes) == [2, 4]
    assert all(isinstance(r, ServerError) and "boom" in str(r) for r in results)


def test_a_merged_request_nobody_waits_for_is_cancelled():
    started, cancelled = asyncio.Event(), []

    async def send(n, deadline):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(n)
            raise

    async def run():
        c = Coalescer(window_s=0.001)
        callers = [asyncio.ensure_future(c.request("k", 1, None, send)) for _ in range(2)]
        await started.wait()
        callers[0].cancel()
        await asyncio.sleep(0.01)
        assert not cancelled  # the other caller still waits
        callers[1].cancel()
        await asyncio.sleep(0.01)
        return cancelled

    assert asyncio.run(run()) == [2]


def _choice(i, n_tokens=2):
    return {
        "index": i,
        "text": "x",
        "token_ids": list(range(n_tokens)),
        "logprobs": {"token_logprobs": [-0.5] * n_tokens},
    }


def _router(handler, urls=("http://a", "http://b"), **kw):
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    options = dict(max_in_flight=4, request_timeout_s=5.0, max_retries=2, retry_backoff_s=0.001) | kw
    return ReplicaRouter(list(urls), client, httpx, **options)


def test_requests_go_to_the_least_loaded_replica_counting_completions():
    seen, gate = [], asyncio.Event()

    async def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.host, body["n"], body["model"]))
        await gate.wait()
        return httpx.Response(200, json={"choices": [_choice(i) for i in reversed(range(body["n"]))]})

    async def run():
        router = _router(handler)
        router.replicas[0].model, router.replicas[1].model = "m-a", "m-b"
        calls = [asyncio.ensure_future(router.complete({"prompt": [1]}, n, None)) for n in (3, 1, 2, 1)]
        await asyncio.sleep(0.05)
        in_flight = [r.in_flight for r in router.replicas]
        gate.set()
        results = await asyncio.gather(*calls)
        return router, in_flight, results

    router, in_flight, results = asyncio.run(run())
    # 3 → a; 1 → b; 2 → b (b has 1, a has 3); 1 → a has 3 and b has 3: a (first); a holds 4 = the bound
    assert seen == [("a", 3, "m-a"), ("b", 1, "m-b"), ("b", 2, "m-b"), ("a", 1, "m-a")]
    assert in_flight == [4, 3]
    assert [r.in_flight for r in router.replicas] == [0, 0] and [r.completed for r in router.replicas] == [4, 3]
    assert [[c["index"] for c in choices] for _, choices in results] == [[0, 1, 2], [0], [0, 1], [0]]  # index order


def test_transient_errors_are_retried_and_an_unreachable_replica_is_dropped(caplog):
    tries = {"a": 0, "b": 0}

    def handler(request):
        host = request.url.host
        tries[host] += 1
        if host == "a":
            raise httpx.ConnectError("connection refused")
        if tries["b"] == 1:
            return httpx.Response(503, text="warming up")
        return httpx.Response(200, json={"choices": [_choice(0)]})

    router = _router(handler)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.server.sampler"):
        replicas = [asyncio.run(router.complete({"prompt": [1]}, 1, None))[0].url for _ in range(2)]
    assert replicas == ["http://b", "http://b"]
    assert tries["a"] == 3  # one try and max_retries=2 retries, then dropped
    assert router.replicas[0].down and "http://a" in router.failovers[0]
    assert "http://a is gone" in caplog.text


def test_errors_name_the_server_and_deadlines_hold():
    def refuses(request):
        return httpx.Response(400, text="bad prompt")

    with pytest.raises(ServerError, match=r"http://a refused a completion request \(400\): bad prompt"):
        asyncio.run(_router(refuses, urls=["http://a"]).complete({"prompt": [1]}, 1, None))

    def failing(request):
        return httpx.Response(500, text="engine dead")

    with pytest.raises(ServerError, match=r"http://a failed a completion request 3 times; last: .*engine dead"):
        asyncio.run(_router(failing, urls=["http://a"]).complete({"prompt": [1]}, 1, None))

    def wrong_count(request):
        return httpx.Response(200, json={"choices": [_choice(0)]})

    with pytest.raises(ServerError, match="answered 1 choices, asked for 2"):
        asyncio.run(_router(wrong_count, urls=["http://a"]).complete({"prompt": [1]}, 2, None))

    def gone(request):
        raise httpx.ConnectError("refused")

    with pytest.raises(ServerError, match="no vLLM server left: http://a: unreachable"):
        asyncio.run(_router(gone, urls=["http://a"]).complete({"prompt": [1]}, 1, None))

    def times_out(request):  # as httpx reports a server that does not answer within the timeout
        raise httpx.ReadTimeout("timed out")

    router = _router(times_out, urls=["http://a"], max_retries=5, retry_backoff_s=0.1)
    with pytest.raises(SamplerTimeout, match="http_timeout"):  # the deadline comes before the retries run out
        asyncio.run(router.complete({"prompt": [1]}, 1, time.monotonic() + 0.15))
    assert router.replicas[0].down is None  # a slow server is not a gone one


def test_a_failed_adapter_load_suggests_lora_only_when_the_server_lacks_it():
    from lit_grpo.samplers.server.adapters import why_load_failed

    url = "http://127.0.0.1:8000"
    missing = ServerError(f'vLLM server {url}: POST /v1/load_lora_adapter answered 404: {{"detail":"Not Found"}}')
    assert "lit_grpo.serve --lora-rank" in why_load_failed(missing)
    taken = ServerError(
        f"vLLM server {url}: POST /v1/load_lora_adapter answered 400: The lora adapter 'policy-v1' has already been "
        "loaded. If you want to load the adapter in place, set 'load_inplace' to True."
    )
    assert why_load_failed(taken) == ""  # the server's own answer says it all


class _HangingServer:
    """A loopback HTTP server that answers `/v1/models` and never answers `/v1/completions`: it
    records when a completion request's connection is closed by the client."""

    def __init__(self) -> None:
        import threading

        self.completion_started = threading.Event()
        self.completion_closed = threading.Event()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            await reader.readexactly(length)
            if head.startswith(b"GET /v1/models"):
                body = json.dumps({"data": [{"id": "tiny", "max_model_len": 4096}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()
                continue
            self.completion_started.set()
            await reader.read()  # the answer never comes; this returns when the client closes the connection
            self.completion_closed.set()
            return

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.timeout(60)
def test_cancel_closes_the_requests_in_flight(tmp_path):
    import threading
    import time

    from conftest import tiny_arithmetic_model

    from lit_grpo.samplers.server.sampler import VLLMServerSampler

    server = _HangingServer()
    _, tokenizer = tiny_arithmetic_model()
    sampler = VLLMServerSampler(
        tokenizer, [f"http://127.0.0.1:{server.port}"], weight_sync_dir=tmp_path, request_timeout_s=30
    )
    outcome: dict[str, BaseException] = {}

    def sample() -> None:
        try:
            asyncio.run(sampler.sample_with_prompt_tokens([5, 6, 7], n=1, max_tokens=4000))
        except BaseException as err:  # noqa: BLE001 (which one is the assertion's)
            outcome["error"] = err

    caller = threading.Thread(target=sample)
    caller.start()
    try:
        assert server.completion_started.wait(10)
        start = time.monotonic()
        sampler.cancel()
        caller.join(5)
        assert not caller.is_alive() and time.monotonic() - start < 3.0
        assert isinstance(outcome.get("error"), asyncio.CancelledError), outcome
    finally:
        sampler.close()  # the run's end closes right after it cancels: no connection is left open
        assert server.completion_closed.wait(5), (
            "the request's connection stayed open: the server would go on generating"
        )
        server.stop()


class _ScriptedServer(_HangingServer):
    """Answers `/v1/completions` as vLLM does: 400 for `n` > 1 in greedy sampling, else `n`
    choices of the tokens 9, 10 (records each request's body)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        super().__init__()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            request = json.loads(await reader.readexactly(length) or b"{}")
            status, answer = 200, {"data": [{"id": "tiny", "max_model_len": 4096}]}
            if head.startswith(b"POST /v1/completions"):
                self.bodies.append(request)
                if request["temperature"] == 0.0 and request["n"] > 1:
                    status, answer = (
                        400,
                        {"error": {"message": f"n must be 1 when using greedy sampling, got {request['n']}."}},
                    )
                else:
                    answer = {
                        "choices": [{**_choice(i), "token_ids": [9, 10], "text": "12"} for i in range(request["n"])]
                    }
            body = json.dumps(answer).encode()
            reason = b"OK" if status == 200 else b"Bad Request"
            writer.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (status, reason, len(body))
                + body
            )
            await writer.drain()


def test_greedy_requests_merged_into_one_ask_for_one_completion(tmp_path):
    """G concurrent greedy requests for one prompt (G episodes of a row at temperature 0): vLLM
    refuses `n` > 1 in greedy sampling, so one completion is asked for and each caller gets a copy."""
    from conftest import tiny_arithmetic_model

    from lit_grpo.samplers.server.sampler import VLLMServerSampler

    server = _ScriptedServer()
    _, tokenizer = tiny_arithmetic_model()
    sampler = VLLMServerSampler(tokenizer, [f"http://127.0.0.1:{server.port}"], weight_sync_dir=tmp_path)

    async def four(temperature):
        calls = (
            sampler.sample_with_prompt_tokens([5, 6], n=1, max_tokens=2, temperature=temperature) for _ in range(4)
        )
        return [c for group in await asyncio.gather(*calls) for c in group]

    try:
        greedy = asyncio.run(four(0.0))
        assert [b["n"] for b in server.bodies] == [1]
        assert [c.full_tokens for c in greedy] == [[5, 6, 9, 10]] * 4 and len({id(c) for c in greedy}) == 4
        assert len({id(c.sampling_logprobs) for c in greedy}) == 4  # copies: one caller's change is its own
        assert len(asyncio.run(four(1.0))) == 4 and server.bodies[-1]["n"] == 4  # sampled: merged as before
    finally:
        sampler.close()
        server.stop()
