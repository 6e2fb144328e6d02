"""AsyncTaskProducer on the real stack, driven from an ASGI (Starlette, as FastAPI builds on) app."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from taskq import AsyncTaskProducer, DeliveryError, PayloadValidationError, Settings, TaskSpec
from taskq._core.envelope import Topics
from taskq._core.kafka import Admin
from taskq.schemas.registry import Registry

FIELDS = [{"name": "to", "type": "string"}, {"name": "n", "type": "long"}]


@pytest.fixture
def email_type(settings: Settings, task_schema: Callable[..., dict[str, Any]]) -> str:
    with Registry(settings.schema_registry_url) as registry:
        return registry.register(task_schema("SendEmail", FIELDS)).subject


def app_for(producer: AsyncTaskProducer, task_type: str) -> Starlette:
    async def signup(request: Request) -> JSONResponse:
        body = await request.json()
        receipt = await producer.enqueue(task_type, {"to": body["email"], "n": body["n"]}, wait=True)
        return JSONResponse(
            {"task_id": receipt.task_id, "partition": receipt.partition, "offset": receipt.offset}
        )

    return Starlette(routes=[Route("/signup", signup, methods=["POST"])])


async def post(app: Starlette, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One HTTP request through the ASGI interface, as a server would make it."""
    body = json.dumps(payload).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(data)


def test_an_app_enqueues_a_thousand_tasks_without_blocking_its_loop(
    settings: Settings, email_type: str
) -> None:
    async def main() -> tuple[list[dict[str, Any]], int]:
        async with AsyncTaskProducer(settings) as producer:
            app = app_for(producer, email_type)
            ticks = 0
            running = True

            async def ticker() -> None:
                nonlocal ticks
                while running:
                    await asyncio.sleep(0)  # one tick per turn of the loop
                    ticks += 1

            tick_task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            before = ticks

            async def client(c: int) -> list[tuple[int, dict[str, Any]]]:
                # One client's 100 requests, one after the other.
                return [
                    await post(app, "/signup", {"email": f"u{c}-{i}@example.com", "n": i}) for i in range(100)
                ]

            answers = [a for one in await asyncio.gather(*(client(c) for c in range(10))) for a in one]
            during = ticks - before
            running = False
            await tick_task
        assert all(status == 200 for status, _ in answers)
        return [body for _, body in answers], during

    bodies, ticks_during = asyncio.run(main())
    # Each request awaited its acknowledgement by suspending, and only itself: the loop turned at least once
    # per request of a client and ran the ticker. A producer that waits for acks on the loop's thread never
    # suspends a request, so each client runs its 100 requests without the ticker getting a turn.
    assert ticks_during >= 100
    assert len({b["task_id"] for b in bodies}) == 1000
    assert all(b["offset"] is not None and b["offset"] >= 0 for b in bodies)
    # Every acknowledged task is in the tier, once.
    topic = Topics(settings.namespace).tier("normal")
    assert sum(Admin(settings).end_offsets([topic]).values()) == 1000


def test_refusals_and_delivery_failures_are_the_same_exceptions(settings: Settings, email_type: str) -> None:
    orphan = settings.with_namespace(settings.namespace + "x")  # topics never created

    async def main() -> None:
        async with AsyncTaskProducer(settings) as producer:
            with pytest.raises(PayloadValidationError):
                await producer.enqueue(email_type, {"to": "a@example.com", "n": "one"})
            receipts = await producer.enqueue_many(
                [TaskSpec(task_type=email_type, payload={"to": "b@example.com", "n": i}) for i in range(3)],
                wait=True,
            )
            assert [r.offset is not None for r in receipts] == [True] * 3
        producer = AsyncTaskProducer(orphan, kafka_config={"message.timeout.ms": 1500})
        try:
            with pytest.raises(DeliveryError):
                await producer.enqueue(email_type, {"to": "c@example.com", "n": 1}, wait=True)
            unawaited = await producer.enqueue(email_type, {"to": "d@example.com", "n": 2})
            with pytest.raises(DeliveryError) as raised:
                await producer.flush(30)
            assert [task_id for task_id, _ in raised.value.failures] == [unawaited.task_id]
        finally:
            await producer.close(5)

    asyncio.run(main())
