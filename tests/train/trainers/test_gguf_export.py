"""The merged GGUF export: the file `gguf`'s own reader and writer would write, metadata copied as stored."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from rollgym.train.trainers.gguf_export import GGUFTemplate, permute_rows, write_merged_gguf  # noqa: E402
from rollgym.train.trainers.policy import bundled_gguf  # noqa: E402

pytestmark = pytest.mark.slow


def reference_merged_gguf(template: str, deltas: dict[str, np.ndarray], output: Path, dtype: str) -> Path:
    """The merged file through gguf's GGUFReader (every metadata value decoded) and GGUFWriter."""
    reader = gguf.GGUFReader(template)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, int(reader.fields["llama.block_count"].contents()))
    by_tensor = {}
    for module, delta in deltas.items():
        if module.endswith(("q_proj", "k_proj")):
            heads = int(reader.fields[f"llama.attention.head_count{'_kv' if module.endswith('k_proj') else ''}"].contents())
            delta = permute_rows(delta, heads, heads)
        by_tensor[names.get_name(module) + ".weight"] = delta
    writer = gguf.GGUFWriter(str(output), "llama")
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(int({"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]))
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32) + by_tensor.get(tensor.name, 0)
        if dtype == "q8_0" and weights.ndim > 1:
            writer.add_tensor(tensor.name, gguf.quants.quantize(np.ascontiguousarray(weights), gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(weights, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output


@pytest.mark.parametrize("dtype", ["q8_0", "f32"])
def test_merged_gguf_is_the_file_ggufs_writer_writes(tmp_path: Path, dtype: str) -> None:
    """Byte for byte: the metadata entries copied as stored equal those decoded and written again, the
    tensors (a q and a k projection, rows permuted, and an MLP one moved) equal the writer's."""
    rng = np.random.default_rng(0)
    deltas = {"model.layers.29.self_attn.q_proj": rng.normal(0, 0.01, (576, 576)).astype(np.float32),
              "model.layers.29.self_attn.k_proj": rng.normal(0, 0.01, (192, 576)).astype(np.float32),
              "model.layers.20.mlp.down_proj": rng.normal(0, 0.01, (576, 1536)).astype(np.float32)}
    got = write_merged_gguf(bundled_gguf(), deltas, tmp_path / "merged.gguf", dtype).read_bytes()
    base = write_merged_gguf(bundled_gguf(), {}, tmp_path / "base.gguf", dtype).read_bytes()
    assert got != base, "the deltas changed nothing: the comparison would prove nothing"
    assert got == reference_merged_gguf(bundled_gguf(), deltas, tmp_path / "reference.gguf", dtype).read_bytes()


def test_template_reads_what_ggufs_reader_reads() -> None:
    """Every metadata entry's value (the arrays' bytes) and every tensor's bytes, as gguf's reader has them."""
    template, reader = GGUFTemplate(bundled_gguf()), gguf.GGUFReader(bundled_gguf())
    fields = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(template.entries) == list(fields)
    for name, field in fields.items():
        stored = reader.data[field.offset:field.offset + sum(part.nbytes for part in field.parts)].tobytes()
        assert template.entries[name] == stored, name
        if field.types[0] != gguf.GGUFValueType.ARRAY:
            assert template.values[name] == field.contents(), name
    assert [(name, kind) for name, _, kind, _ in template.tensors] == [(t.name, t.tensor_type) for t in reader.tensors]
    for (name, dims, _, raw), tensor in zip(template.tensors, reader.tensors):
        assert dims == tuple(int(d) for d in tensor.shape), name
        assert raw.tobytes() == np.asarray(tensor.data).tobytes(), name


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFTemplate(path)
