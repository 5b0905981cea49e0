"""A GGUF's scalar metadata read from its header alone equals what `gguf.GGUFReader` reads, every
value type included, past string arrays, number arrays and arrays of arrays; a damaged or foreign
file reads as no metadata, never an error."""

import json

import gguf
import numpy as np
import pytest

from engine.decoding.defaults import resolve_defaults
from engine.loading.gguf_metadata import scalar_metadata

pytestmark = pytest.mark.fast


def write(path, extra=()) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(3000)])
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -100)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -30000)
    writer.add_uint32("tokenizer.ggml.fim_pre_token_id", 7)
    writer.add_int32("i32", -7)
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_bool("flag", True)
    writer.add_string("general.name", "Ünïcode model ✓")
    writer.add_array("scores", np.linspace(0, 1, 500, dtype=np.float32).tolist())
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_uint64("u64", 2**40)
    writer.add_int64("i64", -2**40)
    writer.add_float64("f64", 1 / 3)
    for key, value in extra:
        writer.add_string(key, value)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_scalars_equal_gguf_readers_and_arrays_are_stepped_over(tmp_path):
    path = tmp_path / "model.gguf"
    write(path)
    fields = gguf.GGUFReader(str(path)).fields
    expected = {key: field.contents() for key, field in fields.items()
                if not key.startswith("GGUF.") and field.types[0] != gguf.GGUFValueType.ARRAY}
    found = scalar_metadata(path)
    assert found == expected
    assert found["general.name"] == "Ünïcode model ✓" and found["f64"] == 1 / 3
    assert not {"tokenizer.ggml.tokens", "scores", "nested"} & found.keys()
    assert found["i64"] == -2**40 and found["flag"] is True


def test_a_rewritten_file_is_read_again(tmp_path):
    path = tmp_path / "model.gguf"
    write(path)
    assert "general.sampling.top_k" not in scalar_metadata(path)
    write(path, extra=[("later", "x" * 50)])
    assert scalar_metadata(path)["later"] == "x" * 50


def test_damaged_and_foreign_files_read_as_nothing(tmp_path):
    path = tmp_path / "model.gguf"
    write(path)
    whole = path.read_bytes()
    for name, data in (("cut", whole[:200]), ("text", b"not a gguf at all" * 4), ("empty", b""),
                       ("v1", b"GGUF" + (1).to_bytes(4, "little") + whole[8:])):
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        assert scalar_metadata(bad) == {}, name


def test_a_ggufs_sampling_keys_are_the_models_defaults(tmp_path):
    """llama.cpp's `general.sampling.*` keys of the GGUF a folder was converted from."""
    path = tmp_path / "model.gguf"
    write(path)
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "source.json").write_text(json.dumps({"gguf": str(path)}))
    temperature = resolve_defaults("some-model", folder, "llama")["temperature"]
    assert (round(temperature.value, 6), temperature.source) == (0.6, "gguf")
