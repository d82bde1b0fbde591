"""`sekv-local convert bake` / `inspect`: a model GGUF plus trained parameters -> one GGUF carrying both.

The output is a copy of the model (every metadata key and tensor byte for byte, quantized tensors
untouched) with the parameters added as metadata: a SeKV router as `sekv.*`, Meta-Soft's soft tokens as
`metasoft.*` (an older entry of the same kind is replaced). It is written
to a temporary file and renamed, so a failed or killed bake never leaves half a GGUF behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from sekv_local.errors import SekvError
from sekv_local.models.gguf_file import GGUFModelFile
from sekv_local.metasoft.params_file import PREFIX as METASOFT_PREFIX
from sekv_local.metasoft.params_file import gguf_entries as metasoft_entries
from sekv_local.metasoft.params_file import dims_of, load_library, read_gguf_library
from sekv_local.sekv.router_file import PREFIX, gguf_entries, load_router

ProgressFn = Callable[[int, int], None]


def bake(model: str | Path, params: str | Path, out: str | Path, progress: ProgressFn | None = None) -> Path:
    """Write `out`: `model` with the trained parameters in `params` baked in (a SeKV router file, or a
    Meta-Soft parameter file: told apart by their metadata). Returns `out`."""
    model, out = Path(model), Path(out)
    if out.exists() and out.resolve() == model.resolve():
        raise SekvError(f"the output {out} is the input model; write to another file")
    source = GGUFModelFile(model)
    if parameter_kind(params) == "metasoft":
        library, info = load_library(params, source.config)
        entries, prefix = metasoft_entries(library, info), METASOFT_PREFIX
    else:
        router = load_router(params)
        router.check_model(source.config, str(params))
        entries, prefix = gguf_entries(router), PREFIX
    _write_copy(source, entries, prefix, out, progress)
    return out


def parameter_kind(path: str | Path) -> str:
    """"metasoft" for a Meta-Soft parameter file, else "sekv" (the router loader reports what is wrong)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
    except (SafetensorError, OSError, ValueError):
        return "sekv"
    return "metasoft" if "metasoft.format_version" in meta else "sekv"


def _write_copy(source: GGUFModelFile, entries: list[tuple[str, Any, str]], prefix: str, out: Path,
                progress: ProgressFn | None) -> None:
    import gguf

    from sekv_local.persistence import atomic_write

    reader = gguf.GGUFReader(str(source.path), "r")  # the package's reader: its fields carry their GGUF types
    kinds = {"u32": gguf.GGUFValueType.UINT32, "str": gguf.GGUFValueType.STRING}
    with atomic_write(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), source.architecture)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name.startswith(prefix):
                continue  # GGUF.* are the header's own fields; the writer adds the architecture
            if name == "general.alignment":
                writer.add_custom_alignment(int(f.contents()))
                continue
            kind = f.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_key_value(name, f.contents(), kind, sub_type=f.types[-1])
            else:
                writer.add_key_value(name, f.contents(), kind)
        for key, value, kind in entries:
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
    """Human-readable lines: the model and, when present, its baked SeKV router and Meta-Soft tokens."""
    gguf_file = GGUFModelFile(path)
    c = gguf_file.config
    lines = [f"{Path(path).name}: {c.architecture}, {c.n_layers} layers, {c.n_heads} heads, "
             f"{c.n_kv_heads} KV heads, head_dim {c.head_dim}, context {c.context_length}"]
    return lines + _router_lines(gguf_file) + _metasoft_lines(gguf_file)


def _router_lines(gguf_file: GGUFModelFile) -> list[str]:
    params = gguf_file.router_params()
    if params is None:
        return ["no SeKV router (sekv.*): SeKV runs with untrained defaults"]
    lines = [f"sekv.format_version: {gguf_file.metadata(PREFIX + 'format_version')}",
             "sekv dims: " + ", ".join(f"{k} {v}" for k, v in params.dims.items())]
    for title, values in (("sekv.hparams", params.hparams), ("sekv.info", params.info)):
        if values:
            lines.append(f"{title}: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(values.items())))
    n_values = sum(t.numel() for t in params.tensors.values())
    lines.append(f"sekv parameters: {n_values} values in {len(params.tensors)} x {params.dims['n_layers']} arrays")
    for name, t in params.tensors.items():
        lines.append(f"  sekv.blk.N.{name:<18s} {list(params.shape(name, per_layer=True))}  "
                     f"mean {float(t.mean()):+.4f}  std {float(t.std()):.4f}")
    return lines


def _metasoft_lines(gguf_file: GGUFModelFile) -> list[str]:
    found = read_gguf_library(gguf_file.metadata, gguf_file.keys(), gguf_file.path.name, gguf_file.config)
    if found is None:
        return ["no Meta-Soft soft tokens (metasoft.*): Meta-Soft runs with untrained defaults"]
    library, info = found
    lines = [f"metasoft.format_version: {gguf_file.metadata(METASOFT_PREFIX + 'format_version')}",
             "metasoft dims: " + ", ".join(f"{k} {v}" for k, v in dims_of(library).items())]
    if info:
        lines.append("metasoft.info: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(info.items())))
    lines.append(f"metasoft parameters: {library.n_parameters()} values; library orthogonality "
                 f"{float(library.orthogonality()):.4f}")
    for name, t in library.state_dict().items():
        lines.append(f"  metasoft.{name:<20s} {list(t.shape)}  mean {float(t.mean()):+.4f}  std {float(t.std()):.4f}")
    return lines


def _short(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."

