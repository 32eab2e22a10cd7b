"""optc's GGUF header reader against gguf-py's ``GGUFReader`` (the reference), on files written by
gguf-py's ``GGUFWriter`` with every value type, plain and block tensor types, a custom alignment
and both byte orders."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from optc.model.gguf_index import read_gguf_index


def _write(path, endian) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**40 + 3)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 0.25])
    rng = np.random.default_rng(0)
    w.add_tensor("plain32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain16", rng.standard_normal((2, 4, 6)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16):
        w.add_tensor(f"q.{qtype.name}", gguf.quantize(weights, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_index_reads_what_gguf_py_reads(tmp_path, endian) -> None:
    path = tmp_path / "m.gguf"
    _write(path, getattr(gguf.GGUFEndian, endian))
    ref = gguf.GGUFReader(str(path))
    index = read_gguf_index(path)
    assert index.byteorder == ("<" if endian == "LITTLE" else ">")
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(index.fields) == keys
    for key in keys:
        want, got = ref.fields[key].contents(), index.fields[key]
        if isinstance(want, list) and want and not isinstance(want[0], str):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want, dtype=np.asarray(got).dtype))
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert index.string("t.str") == "héllo" and index.string("t.u8") is None
    assert [t.name for t in index.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(index.tensors, ref.tensors):
        assert mine.qtype == int(theirs.tensor_type) and mine.type_name == theirs.tensor_type.name
        assert mine.shape == tuple(int(x) for x in theirs.shape)
        assert (mine.offset, mine.n_bytes, mine.n_elements) == (theirs.data_offset, theirs.n_bytes, theirs.n_elements)
        assert mine.offset % 64 == 0
        data = index.data(mine)
        assert data.shape == theirs.data.shape
        np.testing.assert_array_equal(data.astype(data.dtype.newbyteorder("=")), np.asarray(theirs.data))
    q4 = next(t for t in index.tensors if t.type_name == "Q4_0")
    np.testing.assert_array_equal(gguf.dequantize(index.data(q4), gguf.GGMLQuantizationType.Q4_0),
                                  gguf.dequantize(ref.tensors[index.tensors.index(q4)].data, q4.qtype))


def test_index_refuses_what_is_not_a_whole_gguf_file(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    _write(path, gguf.GGUFEndian.LITTLE)
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for keep, says in ((10, "too short"), (200, "truncated"), (len(raw) - 10, "past the file")):
        cut.write_bytes(raw[:keep])
        with pytest.raises(ValueError, match=says):
            read_gguf_index(cut)
    cut.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf_index(cut)
    cut.write_bytes(raw[:4] + (9).to_bytes(4, "little") + raw[8:])
    with pytest.raises(ValueError, match="version 9"):
        read_gguf_index(cut)
    at = raw.index(b"general.alignment") + len(b"general.alignment") + 4  # past the key and its type
    cut.write_bytes(raw[:at] + (48).to_bytes(4, "little") + raw[at + 4:])
    with pytest.raises(ValueError, match="48 is not a power of two"):
        read_gguf_index(cut)
