"""The replay core: a JSON server on loopback that answers from recorded bodies, and the rules every replayed
server fills a recorded answer in by.

Two route tables sit on it: the cloud providers (`tests.harness.providers`: which recorded body a request
gets, by each provider's documented acceptance rule) and the self-hosted engines (`tests.harness.engines`:
which recorded body each endpoint answers). An answer gets the text a test wants for its prompt
(`answer_for`), split into one token per word (`tokens`), with deterministic logprobs (`logprobs`) and the
usage counts that text implies (`prompt_tokens`).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

DEFAULT_ANSWER = "OK"


class KeepAliveHandler(BaseHTTPRequestHandler):
    """A quiet handler that keeps connections open as real servers do. A reply goes out in two writes
    (headers, body): without TCP_NODELAY the body waits on the client's delayed ACK, about 40 ms."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:
        pass


class Server:
    """A threaded JSON server on a free loopback port; a subclass answers each request in `_answer`."""

    def __init__(self) -> None:
        server = self

        class Handler(KeepAliveHandler):
            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = server._answer(self.command, self.path, self.headers, raw)
                out = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def _answer(self, method: str, url: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        raise NotImplementedError

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompt_of(body: dict) -> str:
    """The user's text: the last message, the raw prompt, or the Responses API's input."""
    if isinstance(body.get("messages"), list) and body["messages"]:
        content = body["messages"][-1].get("content", "")
        return content if isinstance(content, str) else json.dumps(content)
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return json.dumps(value)
    return ""


def answer_for(prompt: str, *tables: dict[str, str]) -> str:
    """The answer of the first table entry whose key is in the prompt (else `DEFAULT_ANSWER`)."""
    for table in tables:
        for key, answer in table.items():
            if key in prompt:
                return answer
    return DEFAULT_ANSWER


def tokens(text: str) -> list[str]:
    """The answer's tokens: a word each (with its leading space), as a tokenizer would cut simple text."""
    return re.findall(r"\s*\S+", text) or [text]


def prompt_tokens(prompt: str) -> int:
    """What the prompt costs: a fixed template overhead and a token per word."""
    return 8 + len(prompt.split())


def top_k(body: dict) -> int:
    """How many alternatives each token lists: ``top_logprobs``, within what OpenAI accepts (0 to 20)."""
    top = body.get("top_logprobs")
    return max(0, min(int(top), 20)) if isinstance(top, int) and not isinstance(top, bool) else 0


def logprobs(
    answer: list[str], top: int, shift: float = 0.0
) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Deterministic logprobs: token i gets -0.01·(i+1), its alternatives one nat apart below it; ``shift``
    moves every one (a silent change of the weights)."""
    out = []
    for i, tok in enumerate(answer):
        lp = round(-0.01 * (i + 1) + shift, 6)
        alts = [(tok, lp)] + [(f"{tok.strip()}~{j}", lp - j) for j in range(1, top)]
        out.append((tok, lp, alts[:top]))
    return out


def entries(answer: list[str], top: int, shift: float = 0.0, *, with_bytes: bool = True) -> list[dict]:
    """The logprobs in OpenAI's ``content`` shape (each entry with its top list; ``bytes`` unless the
    server leaves them out)."""

    def one(token: str, lp: float) -> dict:
        entry = {"token": token, "logprob": lp}
        return {**entry, "bytes": list(token.encode())} if with_bytes else entry

    return [
        {**one(t, v), "top_logprobs": [one(a, x) for a, x in alts]}
        for t, v, alts in logprobs(answer, top, shift)
    ]
