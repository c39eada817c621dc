"""The systemd unit through systemd-analyze, and its hardening around canaryd's real runtime.

* ``systemd-analyze verify`` and ``security --offline`` on ``systemd/canaryd.service``. Neither needs systemd
  as PID 1, so they run in CI containers. A missing ``systemd-analyze`` fails the tests (it does not skip).
* The unit's ``SystemCallFilter=`` and ``MemoryDenyWriteExecute=`` emulated (libseccomp + ``PR_SET_MDWE``)
  around canaryd's real runtime work, so hardening that would break the daemon fails here, not in production.
  Without libseccomp or on a kernel older than 6.3 this fails (it does not skip).

What the unit says (type, reload, exit codes) and the sd_notify client are in tests/unit/test_systemd.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from canaryd.daemon import sdnotify
from tests.unit.test_systemd import REPO, UNIT, _unit_settings

# Measured with systemd 252: "Overall exposure level for canaryd.service: 1.1 OK". --threshold is on a
# 0-100 scale (ten times the printed 0-10 value); 15 leaves a small margin and still fails a lost setting
# such as MemoryDenyWriteExecute= or SystemCallFilter=.
SECURITY_THRESHOLD = 15


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail("systemd-analyze not found: install systemd (Debian: apt-get install systemd)")
    return exe


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart= pointing at this environment's real ``canaryd`` (verify checks it exists)."""
    exe = Path(sysconfig.get_path("scripts")) / "canaryd"
    if not exe.exists():
        pytest.fail(f"{exe} not found: install canaryd into this environment (pip install -e .)")
    text = UNIT.read_text(encoding="utf-8")
    shipped = "ExecStart=/usr/local/bin/canaryd "
    assert text.count(shipped) == 1
    copy = tmp_path / "canaryd.service"  # verify wants a valid unit name
    copy.write_text(text.replace(shipped, f"ExecStart={exe.resolve()} "), encoding="utf-8")
    return copy


def test_systemd_analyze_verify_is_silent(unit_copy: Path):
    # systemd 252 only *warns* (exit 0) about unknown keys, so any output at all is a failure.
    proc = subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", str(unit_copy)], capture_output=True, text=True, timeout=60
    )
    print(f"systemd-analyze verify: rc={proc.returncode} output={proc.stdout + proc.stderr!r}")
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


def test_systemd_analyze_verify_catches_a_misspelt_setting(unit_copy: Path):
    """Guards the check above against passing vacuously (e.g. verify not reading the file at all)."""
    unit_copy.write_text(unit_copy.read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    proc = subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", str(unit_copy)], capture_output=True, text=True, timeout=60
    )
    assert "NoNewPrivilege" in proc.stdout + proc.stderr


def test_systemd_analyze_security_exposure_is_low(unit_copy: Path):
    proc = subprocess.run(
        [
            _systemd_analyze(),
            "security",
            "--offline=true",
            f"--threshold={SECURITY_THRESHOLD}",
            "--no-pager",
            str(unit_copy),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"Overall exposure level for canaryd\.service: (\d+\.\d+) (\w+)", out)
    assert m, out
    score = float(m.group(1))
    print(f"systemd-analyze security: exposure {score} {m.group(2)} (threshold {SECURITY_THRESHOLD / 10})")
    assert proc.returncode == 0 and score * 10 <= SECURITY_THRESHOLD, out


# --- the unit's syscall filter and MemoryDenyWriteExecute around canaryd's real work --------------------

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1  # <linux/prctl.h>, Linux >= 6.3


def _expand_syscall_groups(names: list[str]) -> set[str]:
    listing = subprocess.run(
        [_systemd_analyze(), "syscall-filter", "--no-pager"], capture_output=True, text=True, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        if line.startswith("@"):
            current = line.split()[0]
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.strip())
    result: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name.startswith("@"):
            todo.extend(groups.pop(name, []))
        else:
            result.add(name)
    return result


def _apply_unit_sandbox() -> None:
    """Install the unit's SystemCallFilter=/SystemCallErrorNumber= (seccomp) and MemoryDenyWriteExecute=.

    systemd 252 implements MemoryDenyWriteExecute= as a seccomp filter against W+X mmap and adding
    PROT_EXEC; ``PR_SET_MDWE(REFUSE_EXEC_GAIN)`` enforces the same rule in the kernel.
    """
    settings = _unit_settings(UNIT.read_text(encoding="utf-8"))
    filters = [v.split() for k, v in settings if k == "SystemCallFilter"]
    assert filters and not filters[0][0].startswith("~"), "expected an allow list first"
    allowed = _expand_syscall_groups(filters[0]) - _expand_syscall_groups(
        [n.lstrip("~") for f in filters[1:] for n in f]
    )
    errno_name = dict(settings)["SystemCallErrorNumber"]
    assert dict(settings)["MemoryDenyWriteExecute"] == "yes"

    seccomp = ctypes.CDLL(ctypes.util.find_library("seccomp"))
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    scmp_act_errno, scmp_act_allow = 0x00050000 | getattr(errno, errno_name), 0x7FFF0000
    ctx = seccomp.seccomp_init(scmp_act_errno)
    for name in sorted(allowed):
        nr = seccomp.seccomp_syscall_resolve_name(name.encode())
        if nr >= 0:  # names from other architectures resolve to an error
            assert seccomp.seccomp_rule_add(ctx, scmp_act_allow, nr, 0) == 0, name
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    assert seccomp.seccomp_load(ctx) == 0


def _sandboxed_workload() -> None:
    """Run in a child: sandbox first, then the imports and I/O the daemon does (each step asserts)."""
    _apply_unit_sandbox()
    import mmap
    import ssl
    import tempfile
    import threading

    import httpx2
    from apscheduler.schedulers.background import BackgroundScheduler
    from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, start_http_server

    import canaryd.cli
    import canaryd.daemon.metrics
    import canaryd.probe.run
    from canaryd.store import Store

    if importlib.util.find_spec("canaryd.daemon.service"):
        import canaryd.daemon.service  # noqa: F401

    with pytest.raises(PermissionError):  # the sandbox is really on
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    ssl.create_default_context()
    with tempfile.TemporaryDirectory() as d:
        store = Store(f"sqlite:///{d}/canaryd.db")
        assert store.start_run("b") >= 1
        store.close()

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        Gauge("canaryd_sandbox_test", "x", registry=registry).set(1)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        body = httpx2.get(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).text
        assert "canaryd_sandbox_test 1.0" in body and "process_resident_memory_bytes" in body
        server.shutdown()

        scheduler = BackgroundScheduler()
        ticked = threading.Event()
        scheduler.add_job(ticked.set, "interval", seconds=0.05)
        scheduler.start()
        assert ticked.wait(5)
        scheduler.shutdown()

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
            receiver.bind(f"{d}/notify")
            os.environ["NOTIFY_SOCKET"] = f"{d}/notify"
            assert sdnotify.notify("READY=1") and receiver.recv(64) == b"READY=1"
    from canaryd.backends import make_backend
    from canaryd.backends.openai_compat import Settings

    make_backend(Settings(name="s", model="m", base_url="http://127.0.0.1:1/v1")).close()  # TLS context
    print("SANDBOX-OK")


def test_daemon_runtime_survives_the_units_syscall_filter_and_mdwe():
    if not ctypes.util.find_library("seccomp"):
        pytest.fail("libseccomp not installed: install libseccomp2 (it emulates SystemCallFilter= here)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE + 1, 0, 0, 0, 0) < 0 and ctypes.get_errno() == errno.EINVAL:  # PR_GET_MDWE
        pytest.fail("kernel < 6.3 has no PR_SET_MDWE to emulate MemoryDenyWriteExecute=: run on Linux >= 6.3")
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.e2e.test_systemd import _sandboxed_workload as w; w()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # A syscall outside the filter fails with EPERM (SystemCallErrorNumber=) and surfaces as an exception.
    assert proc.returncode == 0 and "SANDBOX-OK" in proc.stdout, proc.stdout + proc.stderr
