"""Make TVMScript's frame lookups cheap where a frame's file belongs to no module.

TVMScript parses each `T.prim_func` by asking `inspect` about every frame of the stack, and
`inspect.getmodule` scans every loaded module whenever a frame's file is not in its cache of
module files: importlib's frozen frames under an import, the `<ast>` code TVMScript evaluates,
code a host runs from a string or a file it executes (pytest-xdist's workers). Importing TVM's
tensor intrinsics (~500 functions parsed, inside an import) spent ~35 s of a 43 s CUDA build so,
and kiln's kernels took 2x as long to lower in a test worker. For such a file the scan finds no
module and getmodule answers None; recording the file in its cache under a name that is no
module gives that answer at once. (Where a file is on disk, inspect reads its source without the
module, so even a module imported from it later loses nothing.)
"""
from __future__ import annotations

import inspect
import sys

NO_MODULE = "<no module>"          # sys.modules never holds it: getmodule's cache lookup answers None
PSEUDO_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>", "<frozen runpy>",
                "<string>", "<ast>")


def remember_files_without_modules() -> None:
    """Cache PSEUDO_FILES, and the files of the calling stack that are no module's, as no module's."""
    for name in PSEUDO_FILES:
        inspect.modulesbyfile.setdefault(name, NO_MODULE)
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name not in inspect.modulesbyfile and inspect.getmodule(frame, name) is None:
            inspect.modulesbyfile[name] = inspect.modulesbyfile[inspect.getabsfile(frame, name)] = NO_MODULE
        frame = frame.f_back
