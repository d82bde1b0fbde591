"""`sekv-local convert bake` / `inspect`: a model GGUF plus a router file -> one GGUF carrying both.

The output is a copy of the model (every metadata key and tensor byte for byte, quantized tensors
untouched) with the router's `sekv.*` metadata added (an older `sekv.*` is replaced). It is written
to a temporary file and renamed, so a failed or killed bake never leaves half a GGUF behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sekv_local.errors import SekvError
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.sekv.router_file import PREFIX, RouterParams, gguf_entries, load_router

ProgressFn = Callable[[int, int], None]


def bake(model: str | Path, router: str | Path, out: str | Path, progress: ProgressFn | None = None) -> Path:
    """Write `out`: `model` with the router file `router` baked in. Returns `out`."""
    model, out = Path(model), Path(out)
    if out.exists() and out.resolve() == model.resolve():
        raise SekvError(f"the output {out} is the input model; write to another file")
    source = GGUFModelFile(model)
    params = load_router(router)
    params.check_model(source.config, str(router))
    _write_copy(source, params, out, progress)
    return out


def _write_copy(source: GGUFModelFile, params: RouterParams, out: Path, progress: ProgressFn | None) -> None:
    import gguf

    from sekv_local.persistence import atomic_write

    reader = source._reader
    kinds = {"u32": gguf.GGUFValueType.UINT32, "str": gguf.GGUFValueType.STRING}
    with atomic_write(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), source.architecture)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name.startswith(PREFIX):
                continue  # GGUF.* are the header's own fields; the writer adds the architecture
            if name == "general.alignment":
                writer.add_custom_alignment(int(f.contents()))
                continue
            kind = f.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(name, f.contents(), kind, sub_type=f.types[-1])
            else:
                writer.add_key_value(name, f.contents(), kind)
        for key, value, kind in gguf_entries(params):
            if kind == "f32[]":
                writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
            else:
                writer.add_key_value(key, value, kinds[kind])
        for tensor in reader.tensors:  # quantized data is copied as bytes: raw_dtype keeps its type
            data = tensor.data
            writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, total = 0, len(reader.tensors)
        for tensor in reader.tensors:
            writer.write_tensor_data(tensor.data)
            done += 1
            if progress is not None:
                progress(done, total)
        writer.close()


def inspect(path: str | Path) -> list[str]:
    """Human-readable lines: the model and, when present, its baked SeKV router."""
    gguf_file = GGUFModelFile(path)
    c = gguf_file.config
    lines = [f"{Path(path).name}: {c.architecture}, {c.n_layers} layers, {c.n_heads} heads, "
             f"{c.n_kv_heads} KV heads, head_dim {c.head_dim}, context {c.context_length}"]
    params = gguf_file.router_params()
    if params is None:
        lines.append("no SeKV router (sekv.*): SeKV runs with untrained defaults")
        return lines
    lines.append(f"sekv.format_version: {gguf_file.metadata(PREFIX + 'format_version')}")
    lines.append("sekv dims: " + ", ".join(f"{k} {v}" for k, v in params.dims.items()))
    for title, values in (("sekv.hparams", params.hparams), ("sekv.info", params.info)):
        if values:
            lines.append(f"{title}: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(values.items())))
    n_values = sum(t.numel() for t in params.tensors.values())
    lines.append(f"sekv parameters: {n_values} values in {len(params.tensors)} x {params.dims['n_layers']} arrays")
    for name, t in params.tensors.items():
        lines.append(f"  sekv.blk.N.{name:<18s} {list(params.shape(name, per_layer=True))}  "
                     f"mean {float(t.mean()):+.4f}  std {float(t.std()):.4f}")
    return lines


def _short(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."

