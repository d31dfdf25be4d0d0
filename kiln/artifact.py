"""The artifact format: a directory with manifest.json, the compiled library, weights and tokenizer.

manifest.json records what the runtime needs to drive the compiled `forward`
(interface version, inputs, stored weights in argument order, KV layout) and a
BLAKE3 digest of every other file (SHA-256 in artifacts from before it), checked
when the artifact is opened: BLAKE3 runs at memory speed on every core, so the
check costs about what reading the weights once does, and the runtime runs it
beside the loading (`start_verify`). Compile hashes the weights as it writes them.

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
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import blake3

from kiln import __version__
from kiln.errors import KilnError
from kiln.interface import INTERFACE_VERSION, MANIFEST, WEIGHTS, Manifest

T = TypeVar("T")          # what write_in_place returns


def file_digest(path: Path, algorithm: str = "blake3") -> str:
    """The hex digest of a file: BLAKE3 (memory-mapped, multi-threaded, without the GIL) or SHA-256."""
    if algorithm == "blake3":
        hasher = new_hasher()
        hasher.update_mmap(str(path))
        return hasher.hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def new_hasher():
    """A BLAKE3 hasher on every core."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def write_manifest(artifact_dir: Path, manifest: Manifest, digests: dict[str, str] | None = None) -> Manifest:
    """Add the kiln version, interface version and file checksums, then write manifest.json.
    `digests` gives the BLAKE3 of files already hashed as they were written."""
    digests = digests or {}
    files = sorted(p for p in artifact_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = manifest.replace(kiln_version=__version__, interface_version=INTERFACE_VERSION, files={
        p.name: {"blake3": digests.get(p.name) or file_digest(p), "bytes": p.stat().st_size} for p in files})
    save_manifest(artifact_dir / MANIFEST, manifest)
    return manifest


def save_manifest(path: Path, manifest: Manifest) -> None:
    path.write_text(json.dumps(manifest.to_json(), indent=1))


def read_manifest(artifact_dir: str | Path, verify: bool = True) -> Manifest:
    """Read manifest.json; check the interface version, and with `verify` every file's checksum."""
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / MANIFEST
    if artifact_dir.exists() and not artifact_dir.is_dir():
        raise KilnError(f"{artifact_dir} is a file; an artifact is the directory `kiln compile -o` writes")
    if not artifact_dir.is_dir():
        raise KilnError(f"artifact {artifact_dir} does not exist")
    if not path.exists():
        if (artifact_dir / "config.json").exists():
            raise KilnError(f"{artifact_dir} is a Hugging Face model directory, not a kiln artifact: compile it "
                            f"first (kiln compile {artifact_dir} -o {artifact_dir.name}.kiln)")
        raise KilnError(f"{artifact_dir} is not a kiln artifact: no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise KilnError(f"{path}: not valid JSON ({e})") from None
    version = manifest.get("interface_version") if isinstance(manifest, dict) else None
    if version != INTERFACE_VERSION:
        raise KilnError(f"{artifact_dir}: interface version {version} is not supported by this kiln "
                        f"(it runs version {INTERFACE_VERSION}); recompile the model")
    manifest = Manifest.from_json(manifest)
    if verify:
        verify_files(artifact_dir, manifest)
    return manifest


def check_sizes(artifact_dir: Path, manifest: Manifest) -> None:
    """Every file the manifest names is present with its recorded size (cheap: no byte is read)."""
    for name, info in manifest.files.items():
        file = artifact_dir / name
        if not file.exists():
            raise KilnError(f"{artifact_dir}: file {name} named in the manifest is missing")
        if file.stat().st_size != info["bytes"]:
            raise KilnError(f"{artifact_dir}: {name} has {file.stat().st_size} bytes, the manifest says "
                            f"{info['bytes']} (the file is corrupted or was changed)")


def verify_files(artifact_dir: Path, manifest: Manifest, names=None) -> int:
    """Check the size and digest of every file (or of `names`); return the bytes hashed."""
    check_sizes(artifact_dir, manifest)
    hashed = 0
    for name, info in manifest.files.items():
        if names is not None and name not in names:
            continue
        algorithm = "blake3" if "blake3" in info else "sha256"
        if file_digest(artifact_dir / name, algorithm) != info[algorithm]:
            raise KilnError(f"{artifact_dir}: checksum mismatch for {name} (the file is corrupted or was changed)")
        hashed += info["bytes"]
    return hashed


def start_verify(artifact_dir: Path, manifest: Manifest) -> Callable[[], None]:
    """Check every file but the weights now (the library is checked before it is loaded) and the
    weights in a background thread (hashing releases the GIL, so they load beside it); return
    `wait()`, which blocks until the check is done and raises what it found."""
    files = set(manifest.files)
    verify_files(artifact_dir, manifest, files - {WEIGHTS})
    errors: list[BaseException] = []

    def work():
        try:
            verify_files(artifact_dir, manifest, files & {WEIGHTS})
        except BaseException as e:       # handed to the waiting thread
            errors.append(e)
    thread = threading.Thread(target=work, name="kiln-verify", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]
    return wait


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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = _sibling(out, "partial")
        partial.mkdir()                        # with the umask's permissions, as OUT would have
    except OSError as e:
        raise KilnError(f"cannot create the artifact directory {out}: {e.strerror or e}"
                        + (f" ({e.filename})" if e.filename and str(e.filename) != str(out) else "")) from None
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


def write_in_place(path: Path, write: Callable[[Path], T]) -> T:
    """`write(partial)` a file beside `path`, then rename it to `path`: never a half-written file
    there. Returns what `write` returns."""
    partial = _sibling(path, "partial")
    try:
        result = write(partial)
        os.replace(partial, path)
        return result
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _sibling(out: Path, kind: str) -> Path:
    """A fresh name beside `out` on the same file system (so that renames are atomic)."""
    while (path := out.with_name(f"{out.name}.{kind}-{secrets.token_hex(4)}")).exists():
        pass
    return path
