"""`kiln compile -o OUT` never destroys what OUT holds and never leaves half an artifact: it writes
beside OUT and renames into place; only a kiln artifact is replaced, and only with --force."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kiln.errors import KilnError
from kiln.options import CompileOptions

KILN = [sys.executable, "-m", "kiln.cli"]


def kiln(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*KILN, *map(str, args)], capture_output=True, text=True, timeout=600)


def _one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln: error:") and "Traceback" not in proc.stderr
    for w in words:
        assert w in last, (w, last)


def _leftovers(parent) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def built(llama_cpu):
    """A compiled artifact to copy as 'an existing artifact'."""
    return llama_cpu[0]


def test_a_folder_with_user_files_is_never_touched(make_model, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    for flags in ([], ["--force"]):
        _one_line_error(kiln("compile", make_model("llama"), "-o", tmp_path, *flags), "not a kiln artifact")
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "sub").is_dir()
    assert _leftovers(tmp_path) == []


def test_a_file_or_a_non_kiln_manifest_is_refused(make_model, tmp_path):
    from kiln.artifact import check_output_dir
    (tmp_path / "file").write_text("x")
    with pytest.raises(KilnError, match="not a kiln artifact"):
        check_output_dir(tmp_path / "file", force=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"name": "someone else's"}))
    with pytest.raises(KilnError, match="not a kiln artifact"):
        check_output_dir(other, force=True)


def test_an_existing_artifact_needs_force(make_model, built, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(built, out)
    before = (out / "manifest.json").read_text()
    _one_line_error(kiln("compile", make_model("llama"), "-o", out), "--force")
    assert (out / "manifest.json").read_text() == before
    (out / "stale.txt").write_text("left by the old artifact")
    proc = kiln("compile", make_model("llama"), "-o", out, "--force")
    assert proc.returncode == 0, proc.stderr
    for phase in ("import", "passes", "codegen", "build", "weights"):     # each phase is shown as it runs
        assert phase in proc.stderr
    assert not (out / "stale.txt").exists()                        # a new directory, not an overlay
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == set(json.loads(before)["files"])
    assert _leftovers(tmp_path) == []
    proc = kiln("run", out, "--prompt", "def", "--max-tokens", "2", "--json")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.build
def test_an_empty_directory_is_used(make_model, tmp_path):
    from kiln.compiler import compile_model
    (tmp_path / "out").mkdir()
    compile_model(make_model("llama"), tmp_path / "out", CompileOptions(target="cpu"), show=None)
    assert (tmp_path / "out" / "manifest.json").is_file() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_compile_leaves_nothing_behind(make_model, built, tmp_path, monkeypatch, error, existing):
    """The build fails after the library and the weights are written, before the manifest: OUT is
    absent (or still the old artifact, byte for byte) and no partial directory remains."""
    import kiln.compiler
    out = tmp_path / "art"
    if existing:
        shutil.copytree(built, out)
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir()) if existing else None

    def fail(*args, **kw):
        raise error
    monkeypatch.setattr(kiln.compiler, "write_manifest", fail)
    with pytest.raises(type(error)):
        kiln.compiler.compile_model(make_model("llama"), out, CompileOptions(target="cpu"), show=None, force=True)
    if existing:
        assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before
    else:
        assert not out.exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.build
def test_the_manifest_record_keeps_every_field_of_the_file_and_names_a_missing_one(llama_cpu, tmp_path):
    """Manifest.from_json then to_json gives manifest.json back whole (nothing a reader needs is
    dropped); a manifest without a required field is refused with the field's name."""
    from kiln.artifact import read_manifest
    from kiln.interface import Manifest
    text = json.loads((llama_cpu[0] / "manifest.json").read_text())
    assert Manifest.from_json(text).to_json() == text
    assert read_manifest(llama_cpu[0], verify=False).kv.page_size == text["kv"]["page_size"]
    broken = shutil.copytree(llama_cpu[0], tmp_path / "broken")
    del text["target"]
    (broken / "manifest.json").write_text(json.dumps(text))
    with pytest.raises(KilnError, match="manifest lacks the field 'target'"):
        read_manifest(broken, verify=False)
