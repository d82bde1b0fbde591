"""GGUF copies the tests compare engines on."""

from __future__ import annotations

import numpy as np


def f32_copy(src, dst) -> None:
    """Write `src` GGUF with every tensor dequantized to F32 (same metadata, same values)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = 0 if name == "general.file_type" else field.contents()  # 0 = ALL_F32
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        writer.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
