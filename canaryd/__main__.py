"""``python -m canaryd`` and the ``canaryd`` console script.

`canaryd run` catches its signals before anything heavy is imported (`canaryd.daemon.signals`), so that a
SIGTERM in the first second of start-up leads to a clean exit instead of the default handler's kill.
"""

import sys


def main() -> None:
    from canaryd.daemon import signals
    from canaryd.lazy import skip_pydantic_plugins

    skip_pydantic_plugins()  # before the first model is built

    if signals.runs_daemon(sys.argv[1:]):
        signals.install()
    from canaryd.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
