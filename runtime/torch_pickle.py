"""Tensors of a PyTorch checkpoint file (torch.save's zip format: a pickle plus one file per storage)
read as NumPy arrays without torch (the runtime never imports it), for adapter_model.bin.

The pickle may build only dicts of tensors (and Parameters of them); any other object is refused, so
reading a file runs no code of its."""
from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

_STORAGE_DTYPES = {"FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
                   "DoubleStorage": "float64"}


class _Storage:
    def __init__(self, dtype: str):
        self.dtype = dtype


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_rest) -> np.ndarray:
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * storage.itemsize for s in stride))
    return view.copy()


def _rebuild_parameter(data, *_rest):
    return data


_ALLOWED = {("collections", "OrderedDict"): OrderedDict, ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """name -> array of the state dict `torch.save` wrote to `path` (float32/16, bfloat16, float64)."""
    import ml_dtypes
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise KilnError(f"{path}: not a PyTorch zip checkpoint ({e}); save the adapter as safetensors") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise KilnError(f"{path}: no single data.pkl in the archive")
        prefix = pickles[0][:-len("data.pkl")]

        class Reader(pickle.Unpickler):
            def find_class(self, module, name):
                if module == "torch" and name in _STORAGE_DTYPES:
                    return _Storage(_STORAGE_DTYPES[name])
                if (module, name) in _ALLOWED:
                    return _ALLOWED[(module, name)]
                raise KilnError(f"{path}: holds a {module}.{name}, which a state dict of tensors does not")

            def persistent_load(self, pid):
                if not (isinstance(pid, tuple) and pid[0] == "storage" and isinstance(pid[1], _Storage)):
                    raise KilnError(f"{path}: a storage kiln cannot read ({pid[:2]!r})")
                dtype = ml_dtypes.bfloat16 if pid[1].dtype == "bfloat16" else np.dtype(pid[1].dtype)
                return np.frombuffer(archive.read(f"{prefix}data/{pid[2]}"), dtype)

        with archive.open(pickles[0]) as f:
            state = Reader(f).load()
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise KilnError(f"{path}: does not hold a dict of tensors")
    return dict(state)
