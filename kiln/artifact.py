"""The artifact format: a directory with manifest.json, the compiled library, weights and tokenizer.

manifest.json records what the runtime needs to drive the compiled `forward`
(interface version, inputs, stored weights in argument order, KV layout) and a
SHA-256 of every other file, checked when the artifact is opened.

An artifact is written into a sibling `OUT.partial-XXXX` directory and renamed into place once its
manifest is written (`new_artifact_dir`), so OUT is never half-written and a failed or interrupted
compile leaves nothing behind. Only a kiln artifact is ever replaced, and only when asked to.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from kiln import __version__
from kiln.errors import KilnError

INTERFACE_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(artifact_dir: Path, manifest: dict) -> dict:
    """Add the kiln version, interface version and file checksums, then write manifest.json."""
    files = sorted(p for p in artifact_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {"kiln_version": __version__, "interface_version": INTERFACE_VERSION, **manifest,
                "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in files}}
    (artifact_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(artifact_dir: str | Path, verify: bool = True) -> dict:
    """Read manifest.json; with verify, check the interface version and every file's checksum."""
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / MANIFEST
    if not artifact_dir.is_dir():
        raise KilnError(f"artifact {artifact_dir} does not exist")
    if not path.exists():
        raise KilnError(f"{artifact_dir} is not a kiln artifact: no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise KilnError(f"{path}: not valid JSON ({e})") from None
    version = manifest.get("interface_version")
    if version != INTERFACE_VERSION:
        raise KilnError(f"{artifact_dir}: interface version {version} is not supported by this kiln "
                        f"(it runs version {INTERFACE_VERSION}); recompile the model")
    if verify:
        for name, info in manifest.get("files", {}).items():
            file = artifact_dir / name
            if not file.exists():
                raise KilnError(f"{artifact_dir}: file {name} named in the manifest is missing")
            if file.stat().st_size != info["bytes"] or sha256_file(file) != info["sha256"]:
                raise KilnError(f"{artifact_dir}: checksum mismatch for {name} (the file is corrupted or was changed)")
    return manifest


def is_artifact(path: Path) -> bool:
    """Whether `path` is a directory holding a manifest.json that parses as a kiln manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "kiln_version" in manifest and "interface_version" in manifest


def check_output_dir(out_dir: str | Path, force: bool) -> None:
    """Refuse an output path that writing an artifact there would destroy: anything but a missing
    path, an empty directory, or (with `force`) an existing kiln artifact."""
    out = Path(out_dir)
    if out.is_symlink():
        raise KilnError(f"{out} is a symbolic link; kiln will not write through it: name the directory itself")
    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.is_dir() and is_artifact(out):
        if not force:
            raise KilnError(f"{out} is an existing kiln artifact; give --force to replace it")
        return
    raise KilnError(f"{out} exists and is not a kiln artifact (nor an empty directory); "
                    "kiln will not overwrite it: choose another output directory")


@contextlib.contextmanager
def new_artifact_dir(out_dir: str | Path, force: bool) -> Iterator[Path]:
    """Yield an empty directory beside `out_dir` to write an artifact into; when the block ends
    normally, put it in place of `out_dir`; when it raises (KeyboardInterrupt too), delete it.

    Replacing an old artifact renames it aside (into OUT.old-XXXX), renames the new one in, then
    deletes the old one: OUT is never a mix of the two, and an interruption between the renames
    puts the old one back (only a crash of the machine there leaves it aside, in OUT.old-XXXX)."""
    out = Path(os.path.abspath(out_dir))
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = _sibling(out, "partial")
    partial.mkdir()                            # with the umask's permissions, as OUT would have
    try:
        yield partial
        check_output_dir(out, force)           # the compile took a while: look again
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            partial.rename(out)
            return
        old = _sibling(out, "old")
        out.rename(old)
        try:
            partial.rename(out)
        except BaseException:
            old.rename(out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _sibling(out: Path, kind: str) -> Path:
    """A fresh name beside `out` on the same file system (so that renames are atomic)."""
    while (path := out.with_name(f"{out.name}.{kind}-{secrets.token_hex(4)}")).exists():
        pass
    return path
