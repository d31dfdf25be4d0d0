"""targets/script_frames.py: inspect's cache answers for the files that belong to no module what its
scan of every loaded module would answer (None), and only for those."""
from __future__ import annotations

import inspect
import sys

CALL_FROM_A_STRING = compile("from kiln.targets.script_frames import remember_files_without_modules\n"
                             "remember_files_without_modules()\n"
                             "import sys\n"
                             "frame = sys._getframe()\n", "<kiln test string>", "exec")


def test_a_frame_run_from_a_string_is_cached_as_no_modules_and_module_files_keep_theirs():
    from kiln.targets.script_frames import NO_MODULE
    here = inspect.getmodule(sys._getframe(), __file__)
    namespace: dict = {}
    exec(CALL_FROM_A_STRING, namespace)
    assert inspect.modulesbyfile["<kiln test string>"] == NO_MODULE
    assert inspect.getmodule(namespace["frame"], "<kiln test string>") is None      # the scan's answer
    assert inspect.getmodule(sys._getframe(), __file__) is here is sys.modules[__name__]
    assert inspect.modulesbyfile.get(inspect.getabsfile(sys._getframe())) != NO_MODULE
    for name in ("<frozen importlib._bootstrap>", "<ast>"):
        assert inspect.modulesbyfile[name] == NO_MODULE and sys.modules.get(NO_MODULE) is None
