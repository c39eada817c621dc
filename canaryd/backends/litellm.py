"""Kind ``litellm``: a LiteLLM proxy (gateway) in front of one or more upstream deployments.

The proxy rewrites ``model`` in every answer to the name the client asked for, so the answer alone says
nothing about the upstream. What it does say: each response's ``x-litellm-*`` headers name the deployment
that served it (its id, the upstream model and API base, the proxy's version), recorded per response as
``gateway.*`` (`openai_headers.GATEWAY_HEADERS`), and ``/v1/model/info`` lists the model group's deployments
with their settings, in the snapshot as ``gateway.deployment.<id>.*`` (never a credential: LiteLLM strips
``api_key`` from that listing, and canaryd records only the named keys below).

A gateway may drop parameters silently: ``drop_params`` drops whatever the upstream provider does not
support, ``additional_drop_params`` whatever it lists (logprobs, say). canaryd reports both, once and
clearly: the snapshot's ``gateway.deployment.<id>.drops`` names the parameters canaryd sends that the
deployment drops (with a warning logged once per backend), and each answer that came back without the
logprobs asked for carries ``gateway.logprobs = dropped`` (judged on its text, as a stack change: never
``identical`` on evidence that was not there).
"""

from __future__ import annotations

from typing import Literal

from canaryd.backends import openai_compat
from canaryd.backends.base import HttpSettings, log
from canaryd.backends.hostfacts import redact_url

EXAMPLE = """\
# A LiteLLM proxy: canaryd records which deployment served each answer (x-litellm-* headers) and the
# model group's deployments (/v1/model/info), and reports parameters the proxy drops (drop_params).
# [[backends]]
# name = "gateway"
# kind = "litellm"
# base_url = "http://127.0.0.1:4000/v1"
# model = "my-model-group"
# api_key_env = "LITELLM_KEY"   # a virtual key (or the master key) allowed to read /v1/model/info
"""
ENGINE_VERSION_FIELD = "gateway.version"
# Request parameters canaryd may send (openai_request.request_body), whose silent loss changes what is
# measured.
SENT_PARAMS = ("logprobs", "top_logprobs", "seed", "temperature", "top_p", "max_tokens", "n", "stop")
# Deployment settings that decide what reaches the upstream; recorded by name, nothing else is.
_RECORDED = ("model", "api_base", "drop_params", "additional_drop_params", "api_version", "region_name")


def dropped_params(params: dict, supported: list | None) -> list[str]:
    """Of `SENT_PARAMS`, those a deployment's ``litellm_params`` drop: listed in ``additional_drop_params``,
    or, with ``drop_params``, missing from the provider's ``supported_openai_params`` (when known)."""
    extra = params.get("additional_drop_params") or []
    drops = {p for p in SENT_PARAMS if p in extra}
    if params.get("drop_params") is True and supported is not None:
        drops |= {p for p in SENT_PARAMS if p not in supported}
    return sorted(drops)


def deployment_fields(model_info: dict, group: str) -> dict[str, str]:
    """``gateway.*`` snapshot fields for the deployments of model group ``group`` in a ``/v1/model/info``
    body (its ``data`` list); a group the proxy does not serve is a ``gateway.error`` field."""
    rows = [d for d in model_info.get("data") or [] if isinstance(d, dict) and d.get("model_name") == group]
    if not rows:
        return {"gateway.error": f"the proxy serves no model group {group!r}"}
    out: dict[str, str] = {}
    ids = []
    for d in rows:
        params = d.get("litellm_params") or {}
        info = d.get("model_info") or {}
        dep = str(info.get("id") or params.get("model"))[:16]  # LiteLLM's id: a hash of the settings
        ids.append(dep)
        for key in _RECORDED:
            if params.get(key) not in (None, "", []):
                value = params[key]
                value = ",".join(sorted(map(str, value))) if isinstance(value, list) else str(value)
                out[f"gateway.deployment.{dep}.{key}"] = redact_url(value)
        if info.get("litellm_provider"):
            out[f"gateway.deployment.{dep}.provider"] = str(info["litellm_provider"])
        drops = dropped_params(params, info.get("supported_openai_params"))
        if drops:
            out[f"gateway.deployment.{dep}.drops"] = ",".join(drops)
    out["gateway.deployments"] = ",".join(sorted(ids))
    return out


class Settings(HttpSettings):
    kind: Literal["litellm"] = "litellm"


class Prober(openai_compat.Prober):
    kind = "litellm"

    def __init__(self, cfg: HttpSettings) -> None:
        super().__init__(cfg)
        self._drops_logged = False

    def snapshot(self) -> dict[str, str]:
        from httpx2 import HTTPStatusError

        fields = super().snapshot()
        try:
            fields.update(
                deployment_fields(self.call("GET", f"{self.cfg.base_url}/model/info").json(), self.cfg.model)
            )
        except HTTPStatusError as e:
            fields["gateway.error"] = f"/v1/model/info: HTTP {e.response.status_code}"
        except (ValueError, AttributeError, TypeError) as e:
            fields["gateway.error"] = f"/v1/model/info unreadable: {e.__class__.__name__}"
        drops = {k: v for k, v in fields.items() if k.endswith(".drops")}
        if drops and not self._drops_logged:
            self._drops_logged = True
            log.warning(
                "gateway_drops_params",
                backend=self.name,
                drops="; ".join(
                    f"{k.removeprefix('gateway.deployment.')}={v}" for k, v in sorted(drops.items())
                ),
                consequence="the upstream never sees them: dropped logprobs are judged on text",
            )
        return fields
