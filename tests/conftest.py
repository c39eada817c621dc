"""What both suites share: the hypothesis profile, and the rule that nothing skips.

``tests/unit`` needs no server or external tool; ``tests/e2e`` starts or needs the real components
(vLLM, Prometheus, promtool, Alertmanager, PostgreSQL, systemd-analyze) and its fixtures live in
``tests/e2e/conftest.py``. A test that would skip fails instead: a missing component must fail the run
(CI), never pass it quietly.
"""

import os

import pytest
from hypothesis import settings

# Every run replays the same fuzz examples, so `./test.sh` is the same test on a laptop and in CI, and a
# landing is never refused by a newly drawn case; CANARYD_FUZZ_EXPLORE=1 draws new ones, which is where
# new cases get found (and then pinned as tests).
settings.register_profile("replay", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("CANARYD_FUZZ_EXPLORE") else "replay")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # A worker inherits the C environment of the process that spawned it, readline's COLUMNS and LINES
    # included (see `_no_stray_terminal_size`): only a test's own choice may set a child's width.
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)


# Collected last: modules that need what test.sh builds in the background (llama.cpp's server), so that the
# build overlaps the rest of the suite instead of delaying its start.
LAST = ("tests/e2e/test_llamacpp.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] in LAST)  # stable: the rest keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped, and nothing here may skip: {reason}"
    return report


@pytest.fixture(autouse=True)
def _fresh_logging():
    """Each test starts from structlog's defaults: a level set by an earlier test's `canaryd.log.configure`
    would otherwise filter the log lines a later test captures."""
    import structlog

    structlog.reset_defaults()
    yield


@pytest.fixture(autouse=True)
def _no_stray_terminal_size():
    """GNU readline, once a dependency imports it, exports COLUMNS and LINES into the C environment behind
    ``os.environ``'s back; every ``canaryd`` a test starts would then lay its tables out 80 columns wide.
    Only what ``os.environ`` holds (a test's own choice) reaches a child process."""
    for name in ("COLUMNS", "LINES"):
        if name not in os.environ:
            os.unsetenv(name)
    yield
