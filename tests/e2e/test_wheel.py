"""The package as a user installs it: `python -m build` (sdist, then the wheel built from that sdist, as a
release is made), installed with its dependencies into an empty venv, then run from there, never from this
checkout (no PYTHONPATH, a working directory outside it).

Dependencies come from the package index pip is configured with (PyPI on a fresh CI machine). Timings of
each step are printed (``pytest -s``) and asserted nowhere.
"""

import json
import os
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import canaryd
from canaryd import __version__

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# The agreed contract with the metrics side: these ship, at their repository paths.
OPS_FILES = (
    "prometheus/canaryd-alerts.yml",
    "prometheus/canaryd-alerts.test.yml",
    "grafana/canaryd-dashboard.json",
    "systemd/canaryd.service",
    "docs/runbook.md",
)


@dataclass
class Installed:
    sdist: Path
    wheel: Path
    venv: Path
    work: Path  # a scratch directory outside the checkout

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.venv / "bin" / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            cwd=self.work,
            env=clean_env(),
            timeout=120,
        )


def clean_env() -> dict[str, str]:
    """The environment without this checkout on the path (its egg-info would pass for an install)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def timed(what: str, cmd: list[str]) -> None:
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=clean_env())
    assert p.returncode == 0, f"{what} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    print(f"test_wheel: {what}: {time.perf_counter() - start:.1f} s")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    dist, venv, work = root / "dist", root / "venv", root / "work"
    work.mkdir()
    timed("python -m build (sdist, then wheel from it)", [sys.executable, "-m", "build", "-o", dist, REPO])
    (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
    timed("empty venv", [sys.executable, "-m", "venv", venv])
    timed("pip install wheel + dependencies", [venv / "bin/python", "-m", "pip", "install", "-q", wheel])
    return Installed(sdist, wheel, venv, work)


def test_sdist_and_wheel_carry_the_license_and_the_ops_files_contents(installed):
    assert installed.wheel.name.startswith(PROJECT["name"].replace("-", "_") + "-")
    license_text = (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0" in license_text
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
        (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(lic) == license_text
        for rel in OPS_FILES:  # the file's bytes, not a symlink
            assert whl.read(f"canaryd/_shipped/{rel}") == (REPO / rel).read_bytes(), rel
    with tarfile.open(installed.sdist) as sd:
        top = sd.getnames()[0].split("/")[0]
        assert sd.extractfile(f"{top}/LICENSE").read() == license_text
        for rel in OPS_FILES:
            member = sd.getmember(f"{top}/canaryd/_shipped/{rel}")
            assert member.isfile(), rel


def test_the_installed_command_is_the_installed_package(installed):
    where = installed.run("python", "-c", "import canaryd; print(canaryd.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(installed.venv)), where
    meta = installed.run(
        "python", "-c", f"import importlib.metadata as m; print(m.version({PROJECT['name']!r}))"
    )
    assert meta.stdout.strip() == canaryd.__version__, meta  # pyproject's dynamic version is the package's
    v = installed.run("canaryd", "--version")
    assert v.returncode == 0 and v.stdout.startswith(f"canaryd {canaryd.__version__} "), v


def test_ops_export_writes_the_repos_files_and_refuses_to_overwrite(installed):
    dest = installed.work / "ops"
    p = installed.run("canaryd", "ops", "export", str(dest))
    assert p.returncode == 0, p.stderr
    written = sorted(f.relative_to(dest).as_posix() for f in dest.rglob("*") if f.is_file())
    assert set(OPS_FILES) <= set(written)
    shipped = REPO / "canaryd" / "_shipped"
    assert written == sorted(f.relative_to(shipped).as_posix() for f in shipped.rglob("*") if f.is_file())
    for rel in written:
        assert (dest / rel).read_bytes() == (REPO / rel).read_bytes(), rel
        assert (dest / rel).stat().st_mode & 0o777 == 0o644, rel  # prometheus, grafana, systemd read them
    assert sorted(p.stdout.split()) == sorted(["wrote"] * len(written) + [str(dest / r) for r in written])

    (dest / OPS_FILES[0]).write_text("mine")
    again = installed.run("canaryd", "ops", "export", str(dest))
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
    assert (dest / OPS_FILES[0]).read_text() == "mine"  # refused means untouched
    forced = installed.run("canaryd", "ops", "export", "--force", str(dest))
    assert forced.returncode == 0, forced.stderr
    assert (dest / OPS_FILES[0]).read_bytes() == (REPO / OPS_FILES[0]).read_bytes()


def test_init_from_the_wheel_writes_a_config_that_validates(installed):
    cfg = installed.work / "etc" / "canaryd.toml"
    p = installed.run("canaryd", "init", str(cfg))
    assert p.returncode == 0, p.stderr
    assert (cfg.parent / "canaries" / "default.toml").read_bytes() == (
        REPO / "canaries" / "default.toml"
    ).read_bytes()
    v = installed.run("canaryd", "-c", str(cfg), "validate")
    assert v.returncode == 0, v.stderr


def test_the_installed_package_probes_stores_and_writes_the_html_report(installed):
    """From the wheel alone: two passes of a scripted backend into a new SQLite history, a `history`
    that reads it, and the HTML report of both runs (the paths that read the installed version)."""
    root = installed.work / "probe"
    root.mkdir()
    (root / "plain.toml").write_text(
        '[suite]\nname = "plain"\n[[canary]]\nid = "add"\n'
        'messages = [{ role = "user", content = "What is 17 + 25?" }]\n'
        'expect = { number = 42, answer = "42" }\n'
    )
    cfg = root / "canaryd.toml"
    cfg.write_text(
        f'state_dir = "{root / "state"}"\nsuites = ["plain.toml"]\n'
        '[[backends]]\nname = "fake"\nkind = "scripted"\nlatency_s = 0\n'
    )
    for expected in ("baseline", "identical"):
        p = installed.run("canaryd", "-c", str(cfg), "check", "--json")
        assert p.returncode == 0, p.stderr
        assert expected in p.stdout
    h = installed.run("canaryd", "history", "-c", str(cfg), "--json")
    assert h.returncode == 0 and json.loads(h.stdout)["exit_code"] == 0, h.stderr
    out = root / "report.html"
    r = installed.run("canaryd", "-c", str(cfg), "report", "1", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert "<html" in page[:200] and "add" in page and f"canaryd {__version__}" in page
