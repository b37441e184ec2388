"""HttpJudger: a judging service reached over HTTP (a sandbox, a verifier farm, another team's scorer).

    judger = HttpJudger("sandbox", "http://judge:8000/score", kwargs={"lang": "python"}, timeout_s=30)

Each trajectory is one POST of the JSON body
    {"response": response_text, "label": label, "prompt": prompt_text, "metadata": {...}, **kwargs}
and the service answers a JSON object holding "reward" and any other named scores
({"reward": 1.0, "passed": 3}). A status other than 2xx, a body that is not such an object, a
connection error or no answer within timeout_s is that item's error (reward 0, flagged).

One httpx.AsyncClient (a connection pool) serves the judger; it is bound to the event loop that made
it, so a call from another loop (a second `asyncio.run`) gets a fresh client.
"""

from __future__ import annotations

import asyncio

import httpx

from rlmega.judgers.base import JudgeError, Judger, JudgeItem, RawVerdict


class HttpJudger(Judger):
    kind = "http"

    def __init__(
        self,
        name: str,
        url: str,
        *,
        kwargs: dict | None = None,
        timeout_s: float = 60.0,
        weight: float = 1.0,
    ):
        super().__init__(name, timeout_s=timeout_s, weight=weight)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"judger {name!r}: url={url!r} must start with http:// or https://")
        self.url, self.kwargs = url, dict(kwargs or {})
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    def _client_for_this_loop(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
            self._client_loop = loop
        return self._client

    async def _judge(self, item: JudgeItem) -> RawVerdict:
        body = {
            "response": item.response_text,
            "label": item.label,
            "prompt": item.prompt_text,
            "metadata": item.metadata,
            "columns": item.columns,
            **self.kwargs,
        }
        answer = await self._client_for_this_loop().post(self.url, json=body)
        if not answer.is_success:
            raise JudgeError(f"HTTP {answer.status_code} from {self.url}: {answer.text[:200]!r}")
        try:
            verdict = answer.json()
        except ValueError:
            raise JudgeError(f"{self.url} answered {answer.text[:200]!r}, not JSON") from None
        if not isinstance(verdict, dict):
            raise JudgeError(
                f"{self.url} answered {str(verdict)[:200]}, not a JSON object with 'reward'"
            )
        return verdict

    async def aclose(self) -> None:
        client, self._client, self._client_loop = self._client, None, None
        if client is not None:
            await client.aclose()

    def close(self) -> None:
        """Close the connection pool; from inside a running loop prefer `await aclose()`."""
        client, loop = self._client, self._client_loop
        self._client = self._client_loop = None
        if client is None or loop is None or loop.is_closed():
            # its loop is gone: nothing can await aclose; the sockets close when it is collected
            return
        if loop.is_running():
            loop.create_task(client.aclose())
        else:
            loop.run_until_complete(client.aclose())

    def __repr__(self) -> str:
        return f"HttpJudger(name={self.name!r}, url={self.url!r}, timeout_s={self.timeout_s:g})"
