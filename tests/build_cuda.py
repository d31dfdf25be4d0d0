"""Run several `kiln compile --target cuda` jobs in this one process (tests/artifact_cache.py).

    python tests/build_cuda.py FOLDER     # FOLDER/jobs.json: {name: {"model": dir, "flags": [...]}}

Each job's artifact goes to FOLDER/<name>; FOLDER/errors.json maps the jobs that failed to their
error. One process pays TVM's tensor-intrinsic import (~40 s) once for every job.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    from kiln.targets.cuda import ensure_cuda_loader
    ensure_cuda_loader()                    # before TVM is imported, as `kiln compile` does
    from kiln.cli import main as kiln
    errors = {}
    for name, job in json.loads((folder / "jobs.json").read_text()).items():
        args = ["--debug", "compile", job["model"], "--target", "cuda", *job["flags"], "-o", str(folder / name)]
        try:
            kiln.main(args, standalone_mode=False)
        except Exception:              # kept for the tests that read this artifact; the others go on
            errors[name] = traceback.format_exc()
    (folder / "errors.json").write_text(json.dumps(errors, indent=1))


if __name__ == "__main__":
    main()
