"""A real nginx (Debian's ``nginx-light``) as the load balancer in front of servers on loopback: each
request to its port goes to one upstream, picked by nginx's ``random`` (or round-robin) balancing, the way
a production fleet hides several servers behind one URL; snapshot requests (``/metrics``, ``/version``)
included. It runs in the foreground (``daemon off``), as this user, on a free port, with its pid file,
logs and temporary paths in its own directory, so it needs no root path. A missing nginx is an error,
never a skip."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from canaryd.lab.vllm_process import free_port

NGINX = "/usr/sbin/nginx"


def config(root: Path, port: int, upstreams: list[int], balance: str) -> str:
    servers = "".join(f"        server 127.0.0.1:{p};\n" for p in upstreams)
    temp = "".join(
        f"    {name}_temp_path {root / name};\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
worker_processes 1;
pid {root / "nginx.pid"};
error_log {root / "error.log"} info;
events {{ worker_connections 256; }}
http {{
    log_format upstream '$upstream_addr';
    access_log {root / "access.log"} upstream;
{temp}    upstream fleet {{
        {balance};
{servers}    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fleet;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


class Nginx:
    """``with Nginx(root, [port_a, port_b]) as lb:`` balances ``lb.base_url`` over the upstreams;
    ``balance``: nginx's ``upstream`` directive (``random`` by default; ``""`` round-robin)."""

    def __init__(self, root: Path, upstreams: list[int], *, port: int | None = None, balance: str = "random"):
        if shutil.which(NGINX) is None and not Path(NGINX).exists():
            raise RuntimeError(f"{NGINX} is missing: install Debian's nginx-light (./test.sh does)")
        self.root, self.port = root, port or free_port()
        root.mkdir(parents=True, exist_ok=True)
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (root / name).mkdir(exist_ok=True)
        self.conf = root / "nginx.conf"
        self.conf.write_text(config(root, self.port, upstreams, balance if balance else ""))
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def served(self) -> dict[int, int]:
        """Requests each upstream port answered, from nginx's access log (one ``$upstream_addr`` a line)."""
        log = self.root / "access.log"
        counts: dict[int, int] = {}
        for line in log.read_text().splitlines() if log.exists() else ():
            for addr in line.split(", "):  # an upstream tried, then the next
                if addr.rsplit(":", 1)[-1].isdigit():
                    port = int(addr.rsplit(":", 1)[-1])
                    counts[port] = counts.get(port, 0) + 1
        return counts

    def __enter__(self) -> Nginx:
        cmd = [NGINX, "-p", str(self.root), "-c", str(self.conf), "-e", str(self.root / "error.log")]
        check = subprocess.run([*cmd, "-t"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise RuntimeError(f"nginx refused its config: {check.stderr.strip()[-500:]}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}: {self._log_tail()}")
            try:
                urllib.request.urlopen(self.base_url + "/version", timeout=2).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answered (an upstream's status)
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"nginx did not listen on {self.port}: {self._log_tail()}") from None
                time.sleep(0.1)

    def _log_tail(self) -> str:
        log = self.root / "error.log"
        return log.read_text()[-1000:] if log.exists() else "(no error log)"

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
