"""Every recorded body under tests/fixtures/ is in the one format the harness loads
(`tests.harness.fixtures`): a JSON object that names where it was recorded from."""

from tests.harness.fixtures import ROOT, read


def test_every_recording_is_json_and_names_its_source():
    files = sorted(p for p in ROOT.rglob("*") if p.is_file())
    assert len(files) > 50
    assert [p for p in files if p.suffix != ".json"] == []
    for path in files:
        assert read(path)["_source"].strip(), path
