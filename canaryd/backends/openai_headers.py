"""The response headers an OpenAI-style answer records: which ones (exact names, never credentials or
cookies), cut to what length, the ``gateway.*`` stack fields a LiteLLM proxy's headers become, and the
per-response stack fields an answer contributes (`reply_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from canaryd.backends.hostfacts import redact_url
from canaryd.observation import storable

# Headers that identify the serving side; they join the stack snapshot, so they must be stable per stack.
# Azure names the model version, the deployment's session and the region serving it.
IDENTITY_HEADERS = (
    "server",
    "openai-version",
    "openai-model",
    "x-openrouter-provider",
    "azureml-model-session",
    "x-ms-region",
)
# Response headers worth keeping with each observation (never credentials or cookies): exact names only, so
# a server sending hundreds of ``x-ratelimit-*`` variants cannot bloat every stored event.
RECORDED_HEADERS = frozenset(
    {
        *IDENTITY_HEADERS,
        "openai-processing-ms",
        "x-request-id",
        "apim-request-id",
        "retry-after",
        "via",
        *(
            f"x-ratelimit-{what}-{unit}"
            for what in ("limit", "remaining", "reset")
            for unit in ("requests", "tokens")
        ),
    }
)
MAX_HEADER_VALUE = 256  # characters kept of each recorded header's value
# What a LiteLLM proxy says about the deployment that served a request, as the stack field ``gateway.<name>``
# (litellm 1.110 sends these on every answer: proxy/common_request_processing.py, get_custom_headers). Each
# is stable per deployment; per-request ones (call id, durations, spend, retries) are left out.
GATEWAY_HEADERS = {
    "x-litellm-model-group": "model_group",  # the name the client asked for
    "x-litellm-model-id": "model_id",  # the deployment: a hash of its settings, unless the config names it
    "x-litellm-model-name": "model_name",  # what the deployment calls upstream, e.g. hosted_vllm/my-model
    "x-litellm-model-api-base": "api_base",  # where (LiteLLM strips the query)
    "x-litellm-model-region": "region",
    "x-litellm-version": "version",
    "llm_provider-server": "upstream_server",  # the upstream's own Server header, forwarded
}


def keep_header(name: str) -> bool:
    """Whether a response header (lower-cased name) is recorded with the observation."""
    return name in RECORDED_HEADERS


def kept_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    """The response headers an observation records: the allow-listed names (lower-cased), each value cut to
    `MAX_HEADER_VALUE` characters (what a transport sets as ``obs.headers``).
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for name, value in items:
        key = str(name).lower()
        if keep_header(key):
            out[key] = storable(str(value)[:MAX_HEADER_VALUE])
    return out


def gateway_fields(headers: Mapping[str, str]) -> dict[str, str]:
    """``gateway.*`` stack fields from a gateway's response headers (none when no gateway answered)."""
    out = {}
    for header, name in GATEWAY_HEADERS.items():
        value = headers.get(header)
        if value:  # credentials in a URL (user:password@) never reach the stack
            out[f"gateway.{name}"] = storable(redact_url(value)[:MAX_HEADER_VALUE])
    return out


def reply_fields(
    model: object,
    system_fingerprint: object,
    service_tier: str | None,
    provider: str | None,
    headers: Mapping[str, str],
) -> dict[str, str]:
    """Per-response serving facts (they join the backend snapshot in an observation's stack): the body's
    model, fingerprint, service tier and upstream provider, the identity headers and the gateway's.
    ``headers`` looked up by lower-case name. The HTTP kinds record these; `canaryd.api` reads a harness's
    replies through the same function, so a sample's configuration is the one a probe would record."""
    fields = {"response.model": str(model), "response.system_fingerprint": str(system_fingerprint)}
    if service_tier is not None:
        fields["response.service_tier"] = service_tier
    if provider is not None:
        fields["response.provider"] = provider
    fields.update({f"header.{h}": headers[h] for h in IDENTITY_HEADERS if h in headers})
    fields.update(gateway_fields(headers))
    return fields
