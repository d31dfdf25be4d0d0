"""The artifact format: a directory with manifest.json, the compiled library, weights and tokenizer.

manifest.json records what the runtime needs to drive the compiled `forward`
(interface version, inputs, stored weights in argument order, KV layout) and a
SHA-256 of every other file, checked when the artifact is opened.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
