"""`canaryd ops export` from the source tree (the wheel's copy: tests/e2e/test_wheel.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from canaryd.errors import InputError
from canaryd.scaffold import export_files, shipped

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SHIPPED = REPO / "canaryd" / "_shipped"


def test_shipped_files_are_symlinks_to_the_canonical_top_level_files():
    """One copy of each file in git: the package holds links, the top-level folders the contents."""
    links = [p for p in SHIPPED.rglob("*") if not p.is_dir()]
    assert links
    for link in links:
        rel = link.relative_to(SHIPPED)
        assert link.is_symlink() and not os.path.isabs(os.readlink(link)), rel
        assert link.resolve() == (REPO / rel).resolve(), rel
    assert sorted(str(r) for r in shipped()) == sorted(str(p.relative_to(SHIPPED)) for p in links)


def test_export_writes_every_file_world_readable_under_a_private_umask(tmp_path):
    dest = tmp_path / "new" / "ops"
    old = os.umask(0o077)  # canaryd's own (cli.main)
    try:
        written = export_files(dest)
    finally:
        os.umask(old)
    assert sorted(written) == sorted(dest / r for r in shipped())
    for path in written:
        assert path.read_bytes() == (REPO / path.relative_to(dest)).read_bytes()
        assert path.stat().st_mode & 0o777 == 0o644
        assert path.parent.stat().st_mode & 0o777 == 0o755
    assert not [p for p in dest.rglob(".*")]  # no temporary files left


def test_an_existing_file_refuses_the_whole_export(tmp_path):
    mine = tmp_path / "systemd" / "canaryd.service"
    mine.parent.mkdir()
    mine.write_text("edited")
    with pytest.raises(InputError, match=r"canaryd\.service: already exists \(use --force"):
        export_files(tmp_path)
    assert mine.read_text() == "edited"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["canaryd.service", "systemd"]  # nothing else


def test_force_replaces_a_symlink_without_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "ops" / "docs").mkdir(parents=True)
    (tmp_path / "ops" / "docs" / "runbook.md").symlink_to(victim)
    with pytest.raises(InputError, match="already exists"):  # a dangling or live link counts as existing
        export_files(tmp_path / "ops")
    export_files(tmp_path / "ops", force=True)
    runbook = tmp_path / "ops" / "docs" / "runbook.md"
    assert not runbook.is_symlink() and runbook.read_bytes() == (REPO / "docs" / "runbook.md").read_bytes()
    assert victim.read_text() == "keep"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d.write_text("x"), "not a directory"),
        (lambda d: (d.mkdir(), (d / "docs").write_text("x")), "cannot write"),  # a file where a dir goes
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path, setup, message):
    dest = tmp_path / "ops"
    setup(dest)
    p = subprocess.run(
        [sys.executable, "-m", "canaryd", "ops", "export", "--force", str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("canaryd: error: ") and message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
