"""What the engine kinds (``vllm``, ``sglang``, ``tgi``, ``ollama`` …) share: an introspection endpoint read
into flat stack fields without ever raising, and the canonical form of the values they report.

Every engine reports its launch arguments its own way (SGLang's server args, TGI's ``/info``, Ollama's
Modelfile parameters); all of them land in the one ``engine.*`` family, so that `explain` ranks a changed
argument before the sizes and answers it moved. Values are strings: JSON spelling for booleans, null and
containers, so ``true`` and ``"true"`` never look alike. A field whose name says it holds a credential
(`hostfacts.is_secret_name`, the one rule) is never recorded, whatever its value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from canaryd.backends.hostfacts import is_secret_name


def text(value: Any) -> str:
    """A reported value as a stack field: strings as they are, everything else in its JSON spelling."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def flatten(
    doc: dict, prefix: str, *, skip: frozenset[str] = frozenset(), rename: dict[str, str] | None = None
) -> dict[str, str]:
    """``prefix.<key>`` for each key of ``doc`` with a value, credentials and ``skip`` left out; ``rename``
    maps a key to a whole field name of its own."""
    out: dict[str, str] = {}
    for key, value in doc.items():
        if value is None or key in skip or is_secret_name(key):
            continue
        out[(rename or {}).get(key, f"{prefix}.{key}")] = text(value)
    return out


def nested(prefix: str, value: Any) -> dict[str, str]:
    """Nested objects as dotted fields (credentials left out, at any depth); lists and scalars as one
    value each."""
    if not isinstance(value, dict):
        return {prefix: text(value)}
    return {
        k: v
        for key, sub in value.items()
        if not is_secret_name(str(key))
        for k, v in nested(f"{prefix}.{key}", sub).items()
    }


def section(name: str, read: Callable[[], dict[str, str]]) -> dict[str, str]:
    """One introspection endpoint; an HTTP error or an unreadable body becomes ``<name>.error`` (a change
    too), never an exception. A backend that cannot be reached at all still raises `BackendUnavailable`."""
    from httpx2 import HTTPStatusError

    try:
        return read()
    except HTTPStatusError as e:
        return {f"{name}.error": f"HTTP {e.response.status_code}"}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return {f"{name}.error": f"unreadable: {e.__class__.__name__}"}


def obj(value: Any, what: str) -> dict:
    """``value`` if it is a JSON object, else a `TypeError` naming ``what`` (read by `section`)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is not a JSON object")
    return value
