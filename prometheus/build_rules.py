#!/usr/bin/env python3
"""Generate ``prometheus/canaryd-alerts.yml`` from ``canaryd-alerts.template.yml``, with a job selector.

The rules select canaryd's series by a selector, as monitoring mixins do, so a Prometheus that scrapes
canaryd under another job name (or several canaryd deployments under different jobs) gets rules for its
own. The template writes it ``$selector``; ``$fallback_runbook`` is where the alerts about an unreachable
canaryd link (the others link to ``/runbook`` on the canaryd that raised them, the runbook of the version
it runs). Everything else in the template (Go templates, ``$labels``, ``$value``) is left as it is.

    python prometheus/build_rules.py                      # rewrite prometheus/canaryd-alerts.yml
    python prometheus/build_rules.py --check              # exit 1 if the committed file is stale
    python prometheus/build_rules.py --selector 'job="llm-canaries"' --output my-alerts.yml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from string import Template

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "canaryd-alerts.template.yml"
OUTPUT = HERE / "canaryd-alerts.yml"
SELECTOR = 'job="canaryd"'
FALLBACK_RUNBOOK = "https://github.com/canaryd/canaryd/blob/main/docs/runbook.md"


def render(selector: str = SELECTOR, fallback_runbook: str = FALLBACK_RUNBOOK) -> str:
    if not selector.strip() or "%" in selector or "`" in selector:
        raise ValueError(f'--selector {selector!r}: label matchers such as job="canaryd", without % or `')
    return Template(TEMPLATE.read_text()).safe_substitute(
        selector=selector, fallback_runbook=fallback_runbook
    )


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
