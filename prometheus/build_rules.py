#!/usr/bin/env python3
"""Generate ``prometheus/canaryd-alerts.yml`` from ``canaryd-alerts.template.yml``, with a job selector.

The rules select canaryd's series by a selector, as monitoring mixins do, so a Prometheus that scrapes
canaryd under another job name (or several canaryd deployments under different jobs) gets rules for its
own. The template writes it ``$selector``; ``$fallback_runbook`` is where the alerts about an unreachable
canaryd link (the others link to ``/runbook`` on the canaryd that raised them, the runbook of the version
it runs). A metric is written by the ``attr`` of its row in canaryd's metric table
(``canaryd/daemon/metric_table.py``), never by name: ``$probes`` is ``canaryd_backend_probes_total``,
``$verdict`` is ``canaryd_canary_verdict`` (``${duration}_bucket`` for a histogram's buckets). Go
templates' own variables (``$labels``, ``$value``, ``$i``, ``$s``) are left as they are; any other ``$name``
is an error, so a metric the table does not declare cannot reach the rules.

    python prometheus/build_rules.py                      # rewrite prometheus/canaryd-alerts.yml
    python prometheus/build_rules.py --check              # exit 1 if the committed file is stale
    python prometheus/build_rules.py --selector 'job="llm-canaries"' --output my-alerts.yml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from string import Template

from canaryd.daemon.metric_table import BY_ATTR

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "canaryd-alerts.template.yml"
OUTPUT = HERE / "canaryd-alerts.yml"
SELECTOR = 'job="canaryd"'
FALLBACK_RUNBOOK = "https://github.com/canaryd/canaryd/blob/main/docs/runbook.md"
GO_VARIABLES = {"labels", "value", "i", "s"}  # the template's Go templates bind these


def render(selector: str = SELECTOR, fallback_runbook: str = FALLBACK_RUNBOOK) -> str:
    if not selector.strip() or "%" in selector or "`" in selector:
        raise ValueError(f'--selector {selector!r}: label matchers such as job="canaryd", without % or `')
    template = Template(TEMPLATE.read_text())
    unknown = (
        set(template.get_identifiers()) - GO_VARIABLES - BY_ATTR.keys() - {"selector", "fallback_runbook"}
    )
    if unknown:
        raise ValueError(
            f"{TEMPLATE.name}: ${', $'.join(sorted(unknown))}: no such metric in the metric table"
        )
    metrics = {m.attr: m.sample for m in BY_ATTR.values()}
    return template.safe_substitute(metrics, selector=selector, fallback_runbook=fallback_runbook)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--selector", default=SELECTOR, help=f"label matchers for canaryd's series ({SELECTOR})")
    ap.add_argument(
        "--fallback-runbook", default=FALLBACK_RUNBOOK, help="runbook URL for canaryd-down alerts"
    )
    ap.add_argument("--output", type=Path, default=OUTPUT)
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if --output differs from what would be written"
    )
    args = ap.parse_args(argv)
    try:
        text = render(args.selector, args.fallback_runbook)
    except ValueError as e:
        print(f"build_rules: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not args.output.is_file() or args.output.read_text() != text:
            print(f"{args.output} is stale: run python prometheus/build_rules.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
