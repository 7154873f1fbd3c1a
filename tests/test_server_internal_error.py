"""A route that raises unexpectedly: one 500 in the OpenAI shape with an error id, and one
logged traceback (the exception handler used to re-raise it to the server, which logged the
same traceback again)."""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import asyncio
import logging

from tests.optional import require

require("serve")
import httpx

from loopserve.llm import LLM
from loopserve.server import api_server


def test_an_unhandled_error_is_one_500_and_one_logged_traceback(tiny_tok_dir, monkeypatch, caplog):
    engine = LLM(str(tiny_tok_dir), dtype="float32", num_blocks=32).engine

    def broken_card(_ctx):
        raise RuntimeError("a bug in the models route")

    monkeypatch.setattr(api_server, "_model_card", broken_card)

    async def main():
        from loopserve.engine.async_llm import AsyncLLM

        client = AsyncLLM(engine)
        client.start()
        assert await client.wait_ready(timeout_s=30)
        # raise_app_exceptions: an exception that leaves the app (to reach the server's own
        # logging, a second traceback) fails this request here instead of answering.
        transport = httpx.ASGITransport(
            app=api_server.build_app(client, "tiny"), raise_app_exceptions=True
        )
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return await http.get("/v1/models")
        finally:
            await client.shutdown(1.0)

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(main())
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "error id" in error["message"] and "a bug" not in error["message"]
    logged = [r for r in caplog.records if r.exc_info and "unhandled error" in r.getMessage()]
    assert len(logged) == 1 and "a bug in the models route" in str(logged[0].exc_info[1])
