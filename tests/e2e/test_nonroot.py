"""``canaryd check`` as an unprivileged user (``nobody``), as the systemd unit's ``DynamicUser=`` or a
packaged service account runs it. Needs root, to drop privileges (``setpriv``, else ``runuser``).

* a ``state_dir`` owned by root, mode 0755 (a package's directory that was never handed over): exit 2
  with one line naming ``state_dir`` and the path, no traceback;
* a ``state_dir`` the user may create: the same check works (exit 0 or 1), the directory is created 0700
  and the database files are 0600 and the user's, whatever the umask it was started with.

Nothing skips: not root, no way to drop privileges, or a Python that ``nobody`` cannot run with this
checkout's code and dependencies fails with what to fix.
"""

from __future__ import annotations

import os
import pwd
import shutil
import site
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.scripted_lab import PLAIN

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
USER = "nobody"
# What `canaryd check` imports on the way; a Python that cannot import these as the user is no use.
IMPORTS = "canaryd.cli, canaryd.store, canaryd.probe.run, sqlalchemy, alembic, pydantic_core, numpy, rich"


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.fail(
            f"tests/e2e/test_nonroot.py drops privileges to {USER!r} and must run as root (CI does); "
            f"this run is uid {os.geteuid()}",
            pytrace=False,
        )


def _launcher(uid: int, gid: int) -> list[str]:
    """The command prefix that runs what follows as uid:gid with no supplementary groups."""
    if shutil.which("setpriv"):
        return [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]  # type: ignore[list-item]
    if shutil.which("runuser"):
        return [shutil.which("runuser"), "-u", USER, "--"]  # type: ignore[list-item]
    pytest.fail(
        "neither setpriv nor runuser is installed (util-linux): cannot drop privileges", pytrace=False
    )


class Nobody:
    """Runs ``python -m canaryd`` as ``nobody``, with a Python it can run and this checkout's code."""

    def __init__(self, work: Path) -> None:
        _need_root()
        try:
            entry = pwd.getpwnam(USER)
        except KeyError:
            pytest.fail(f"no user {USER!r} on this system", pytrace=False)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.prefix = _launcher(self.uid, self.gid)
        self.work = work
        self.pythonpath = ""
        self.pythonpath = self._pythonpath()
        self.python = self._python()

    def _as_user(self, argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": self.pythonpath,
            "LANG": "C.UTF-8",
            "NO_COLOR": "1",
            "COLUMNS": "200",
        }
        return subprocess.run(
            [*self.prefix, *argv],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            umask=0o022,  # what files would get without canaryd's own care
            check=False,
        )

    def _readable(self, path: Path) -> bool:
        p = self._as_user(["/bin/sh", "-c", 'test -r "$0" && test -x "$0"', str(path)], cwd=Path("/"))
        return p.returncode == 0

    def _pythonpath(self) -> str:
        """This checkout's code (copied to the test's own folder if the user cannot read it where it is),
        then the virtual environment's packages (too big to copy: they must be readable)."""
        code = REPO
        if not self._readable(REPO / "canaryd"):
            code = self.work / "code"
            shutil.copytree(REPO / "canaryd", code / "canaryd", ignore=shutil.ignore_patterns("__pycache__"))
            for p in [code, *code.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
        packages = [p for p in site.getsitepackages() if Path(p).is_dir()]
        unreadable = [p for p in packages if not self._readable(Path(p))]
        if unreadable:
            pytest.fail(
                f"{USER} cannot read the virtual environment's packages {unreadable}: make them and every "
                "folder above them world-readable (o+rX) to run this test",
                pytrace=False,
            )
        return os.pathsep.join([str(code), *packages])

    def _python(self) -> str:
        """This interpreter if the user can run it, else the system's of the same version (a pyenv build
        under /root is out of reach); either way it must import canaryd from this checkout."""
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
        probe = (
            f"import sys, canaryd, {IMPORTS}; "
            f"assert sys.version_info[:2] == {tuple(sys.version_info[:2])}, sys.version; "
            "print(canaryd.__file__)"
        )
        tried = []
        for python in dict.fromkeys(candidates):
            real = Path(os.path.realpath(python))
            if not real.exists():
                continue
            if not self._readable(real):  # e.g. /root/.pyenv/...: the user may not reach the binary itself
                tried.append(f"{python}: {USER} cannot read and execute {real}")
                continue
            p = self._as_user([python, "-c", probe], cwd=self.work)
            expected = self.pythonpath.split(os.pathsep)[0]
            if p.returncode == 0 and p.stdout.strip().startswith(expected):
                return python
            tried.append(f"{python}: exit {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}")
        pytest.fail(
            f"no Python that {USER} can run imports canaryd from {REPO} with its dependencies "
            f"(PYTHONPATH={self.pythonpath}); tried:\n" + "\n".join(tried),
            pytrace=False,
        )

    def canaryd(self, config: Path, *args: str) -> subprocess.CompletedProcess:
        return self._as_user([self.python, "-m", "canaryd", "-c", str(config), *args], cwd=config.parent)


@pytest.fixture(scope="module")
def nobody() -> Iterator[Nobody]:
    """A folder of the test's own under /tmp (pytest's tmp_path is under a 0700 folder the user cannot
    enter), readable by the user, and the way to run canaryd as the user."""
    _need_root()
    work = Path(tempfile.mkdtemp(prefix="canaryd-nonroot-"))
    try:
        work.chmod(0o755)
        yield Nobody(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _config(folder: Path, state_dir: Path) -> Path:
    folder.mkdir(mode=0o755)
    (folder / "plain.toml").write_text(PLAIN)
    path = folder / "canaryd.toml"
    path.write_text(
        f'state_dir = "{state_dir}"\nsuites = ["plain.toml"]\n'
        '[[backends]]\nname = "fake"\nkind = "scripted"\nlatency_s = 0\nretry_backoff = 0\n'
    )
    for p in folder.iterdir():
        p.chmod(0o644)
    return path


def test_a_state_dir_the_user_cannot_write_is_a_config_error_naming_it(nobody):
    state = nobody.work / "root-owned-state"
    state.mkdir()
    state.chmod(0o755)  # root's, as a package would leave it
    assert state.stat().st_uid == 0
    config = _config(nobody.work / "unwritable", state)

    p = nobody.canaryd(config, "check")
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 2, f"exit {p.returncode} (2: config error), stderr: {p.stderr}"
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "state_dir" in lines[0] and str(state) in lines[0], lines[0]
    assert list(state.iterdir()) == []  # nothing was created in it, nothing half-made


def test_a_writable_state_dir_works_as_the_user_with_private_files(nobody):
    home = nobody.work / "home"
    home.mkdir()
    os.chown(home, nobody.uid, nobody.gid)
    state = home / "state"  # not there yet: canaryd creates it
    config = _config(nobody.work / "writable", state)

    for round_ in ("baseline", "identical"):
        p = nobody.canaryd(config, "check")
        assert "Traceback" not in p.stderr, p.stderr
        assert p.returncode in (0, 1), f"{round_}: exit {p.returncode}, stderr: {p.stderr}"
        assert round_ in p.stdout, p.stdout

    st = state.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.uid, 0o700), oct(st.st_mode)
    files = sorted(state.glob("canaryd.db*"))
    assert state / "canaryd.db" in files, list(state.iterdir())
    for f in files:  # the database and whatever WAL or shared-memory file is left
        st = f.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.uid, 0o600), (f, oct(st.st_mode))
