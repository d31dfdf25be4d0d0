"""Bad GGUF files fail `kiln compile` with one line naming what is wrong, exit 2, and leave nothing at -o:
a truncated file, an architecture kiln does not compile, a tensor type gguf does not know, metadata that
contradicts the tensors, and a split model missing a shard."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf_files import converted, rewritten
from test_cli import assert_clean_error, kiln

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def source(make_model):
    return converted(make_model("llama"))


def compile_fails(path, tmp_path, *words):
    """compile_model refuses `path` with a KilnError naming the file and `words`, and writes nothing."""
    from kiln.compiler import compile_model
    from kiln.errors import KilnError
    out = tmp_path / "artifact"
    with pytest.raises(KilnError) as refused:
        compile_model(path, out, show=None)
    assert "\n" not in str(refused.value)
    for word in (str(path.name), *words):
        assert word in str(refused.value), (word, str(refused.value))
    assert not out.exists() and not any(p.name.startswith("artifact") for p in tmp_path.iterdir())


def test_truncated_file_fails_the_command_with_one_line(source, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:source.stat().st_size * 2 // 3])
    out = tmp_path / "artifact"
    assert_clean_error(kiln("compile", cut, "-o", out), "cut.gguf", "truncated")
    assert not out.exists()
    compile_fails(cut, tmp_path, "truncated")


def test_unknown_architecture(source, tmp_path):
    compile_fails(rewritten(source, tmp_path / "rwkv.gguf", "general.architecture", "rwkv6"), tmp_path,
                  "'rwkv6' is not supported")


def test_unknown_tensor_type(source, tmp_path):
    """A tensor whose type id gguf does not know: the id patched in the file's tensor table."""
    data = bytearray(source.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * dims
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    compile_fails(bad, tmp_path, "blk.0.attn_q.weight", "type id 99")


def test_metadata_contradicts_tensors(source, tmp_path):
    bad = rewritten(source, tmp_path / "heads.gguf", "llama.embedding_length", 512)
    compile_fails(bad, tmp_path, "token_embd.weight", "the metadata implies")


def test_split_model_reads_as_the_whole(source, tmp_path):
    """gguf-py's writer split into three shards (as gguf-split does): named by any shard or by their
    directory, the model has the same config and the same tensors as the single file."""
    from kiln.frontend import load_model
    rewritten(source, tmp_path / "model.gguf", split_max_tensors=8)
    shards = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(shards) == 3
    whole = load_model(source)
    for named in (shards[1], tmp_path):
        split = load_model(named)
        assert split.config == whole.config
        assert split.file.tensors.keys() == whole.file.tensors.keys()
        for name, t in whole.file.tensors.items():
            np.testing.assert_array_equal(split.file.tensors[name].data, t.data)


def test_split_model_missing_a_shard(source, tmp_path):
    first = tmp_path / "model-00001-of-00002.gguf"
    shutil.copy(source, first)
    compile_fails(first, tmp_path, "lacks model-00002-of-00002.gguf")
