"""A real, throw-away PostgreSQL server for the tests and the benchmark (never skipped).

``PostgresServer`` runs ``initdb`` into a temporary directory (as the ``postgres`` user when running as
root, since initdb refuses root), starts ``postgres`` on a free loopback port and a private socket
directory with trust authentication, and stops it and deletes everything on exit. The binaries are found
in ``$PG_BINDIR``, on ``PATH`` or under ``/usr/lib/postgresql/*/bin`` (Debian's ``postgresql`` package);
if there are none, it raises, so the tests that need it fail rather than skip.

    with PostgresServer() as pg:
        url = pg.create_database("t1")   # postgresql+psycopg://postgres@127.0.0.1:PORT/t1
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def find_bindir() -> Path:
    candidates = [os.environ.get("PG_BINDIR", "")]
    if on_path := shutil.which("pg_ctl"):
        candidates.append(str(Path(on_path).parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))[::-1]
    for c in candidates:
        if c and all((Path(c) / b).exists() for b in ("initdb", "pg_ctl", "postgres", "createdb")):
            return Path(c)
    raise RuntimeError(
        "PostgreSQL server binaries not found (initdb, pg_ctl, postgres, createdb): install Debian's "
        "`postgresql` package, or set PG_BINDIR"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, *, timezone: str | None = None, settings: dict[str, str] | None = None) -> None:
        self.bindir = find_bindir()
        # Server settings: throw-away data needs no fsync (the benchmark passes its own); a TimeZone that
        # is not UTC (the tests use one on purpose) shows any time that went through the server shifted.
        self.settings = {"fsync": "off", **(settings or {})}
        if timezone:
            self.settings["timezone"] = timezone
        self.root = Path(tempfile.mkdtemp(prefix="canaryd-pg-"))
        self.data, self.sockdir, self.log = self.root / "data", self.root / "sock", self.root / "server.log"
        self.port = 0
        self.user = "postgres"
        self._as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres system user
            pw = pwd.getpwnam("postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        else:
            self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.root.chmod(0o755)

    def _run(self, *argv: str | Path, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [*self._as, *map(str, argv)], capture_output=True, text=True, timeout=120, cwd=self.root
        )
        if check and p.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{argv[0]} failed ({p.returncode}): {p.stderr.strip()}\n{log}")
        return p

    def start(self) -> PostgresServer:
        self._run(
            self.bindir / "initdb", "-D", self.data, "-U", self.user, "--auth=trust", "-E", "UTF8",
            "--no-locale", "--no-sync",
        )  # fmt: skip
        self._run("mkdir", "-p", self.sockdir)
        opts = f"-p {{port}} -k {self.sockdir} -c listen_addresses=127.0.0.1"
        opts += "".join(f" -c {k}={v}" for k, v in self.settings.items())
        for attempt in range(3):  # a free port can be taken between free_port() and the bind
            self.port = free_port()
            p = self._run(
                self.bindir / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60",
                "-o", opts.format(port=self.port), "start", check=attempt == 2,
            )  # fmt: skip
            if p.returncode == 0:
                break
        return self

    def stop(self) -> None:
        if self.data.exists():
            self._run(self.bindir / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, dbname: str) -> str:
        """A new, empty database; its SQLAlchemy URL."""
        self._run(self.bindir / "createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, dbname)
        return self.url(dbname)
