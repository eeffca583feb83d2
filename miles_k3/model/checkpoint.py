"""HF-layout checkpoints: read and write `config.json` + safetensors (sharded or not).

Reading validates the tensors against the layout the config implies before a
model is built: a missing tensor, an unexpected one, a wrong shape, an
unknown quantization or a file that is not safetensors raises ValueError naming
the tensor or file. Routed experts may be compressed-tensors MXFP4
(`weight_packed` uint8 [out, in/2], `weight_scale` E8M0 uint8 [out, in/32]);
they are dequantized into the dense in-memory model. `CheckpointSource` reads lazily: shapes from the
headers, then whole tensors or slices on demand (a rank of a sharded build reads only its slices);
`load_state_dict` reads everything through it. In K3's wrapper the text
weights carry `language_model.`; the vision tower and projector (`vision_tower.*`,
`mm_projector.*`, unprefixed) are not part of the text model and are skipped by it; the vision model
reads them from the same directory (`load_vision_state_dict`, validated against the config's
`vision_config` the same way), and `save_pretrained(..., vision=)` writes them into the same shards. A
KDA `A_log` may be stored in either published layout (`layout.a_log_heads`).
Writing is atomic: everything lands in a temporary sibling directory first, so a
crash never leaves a half-written tensor file (see `_publish` for the swap).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from miles_k3.model.config import K3Config
from miles_k3.model.layout import a_log_heads, hf_prefix, is_routed_expert_tensor, tensor_shapes
from miles_k3.model.vision_config import VisionConfig
from miles_k3.ops.mxfp4 import MXFP4_BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# Kept in fp32 whatever the model dtype: router and gate parameters whose precision steers routing/decay.
_FP32_TENSORS = re.compile(r"(\.gate\.weight|e_score_correction_bias|\.dt_bias|\.A_log)$")
# transformers' KimiLinear writes dense-MLP tensors under block_sparse_moe; the hub layout says mlp.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_QUANT_SUFFIX = re.compile(
    r"\.(weight_packed|weight_scale|weight_zero_point|weight_global_scale|input_scale|"
    r"weight_shape|input_global_scale)$"
)


def keeps_fp32(name: str) -> bool:
    return _FP32_TENSORS.search(name) is not None


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor `name` takes in a model of `dtype`: fp32 for the router / decay parameters."""
    return torch.float32 if keeps_fp32(name) else dtype


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: not a readable safetensors file ({e})") from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name (as stored) -> the safetensors file holding it."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (JSON object with 'weight_map'): {e}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        missing_files = sorted({f for f in weight_map.values() if not (path / f).exists()})
        if missing_files:
            raise ValueError(f"{index}: shard files missing: {missing_files}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    out: dict[str, Path] = {}
    for f in files:
        with _open(f) as fh:
            for name in fh.keys():
                if name in out:
                    raise ValueError(f"tensor {name!r} appears in both {out[name].name} and {f.name}")
                out[name] = f
    return out


def _logical_names(config: K3Config, stored: dict[str, Path]) -> dict[str, dict[str, tuple[str, Path]]]:
    """Group stored tensors by logical name: {logical: {"weight"|"weight_packed"|...: (stored, file)}}."""
    prefix = hf_prefix(config)
    dense_layers = {i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)}
    grouped: dict[str, dict[str, tuple[str, Path]]] = {}
    for stored_name, f in stored.items():
        if prefix:
            if stored_name.startswith(_VISION_PREFIXES):
                continue  # the wrapper's vision tower / projector: not part of the text model
            if not stored_name.startswith(prefix):
                raise ValueError(
                    f"tensor {stored_name!r}: K3's text weights are prefixed {prefix!r} (and the "
                    f"vision ones {' / '.join(_VISION_PREFIXES)}); this is neither"
                )
            name = stored_name[len(prefix) :]
        else:
            name = stored_name
        alias = _DENSE_ALIAS.match(name)
        if alias and int(alias.group(1).split(".")[-1]) in dense_layers:
            name = f"{alias.group(1)}.mlp.{alias.group(2)}"
        quant = _QUANT_SUFFIX.search(name)
        if quant:
            kind = quant.group(1)
            logical = name[: quant.start()] + ".weight"
            if kind not in ("weight_packed", "weight_scale"):
                raise ValueError(
                    f"tensor {stored_name!r}: unknown quantization tensor {kind!r}; only "
                    "compressed-tensors mxfp4-pack-quantized (weight_packed, weight_scale) is supported"
                )
            if not config.experts_mxfp4:
                raise ValueError(
                    f"tensor {stored_name!r} is quantized but config.json has no compressed-tensors quantization_config"
                )
            if not is_routed_expert_tensor(logical):
                raise ValueError(f"tensor {stored_name!r}: only routed experts may be MXFP4-quantized")
        else:
            kind, logical = "weight", name
        grouped.setdefault(logical, {})[kind] = (stored_name, f)
    return grouped


class TensorSource(Protocol):
    """Where a build reads its base weights from: the logical tensors of a K3 checkpoint (HF names without
    wrapper prefix, the config's layout, as `load_state_dict` returns them), read whole or in slices.

    Every read returns a fresh tensor (never a view of the source's storage) on the CPU, in the source's
    dtype (fp32 for router / decay parameters: `stored_dtype`). Implementations: `StateDictSource` (tensors
    in memory) and `CheckpointSource` (a checkpoint on disk, read lazily)."""

    shapes: Mapping[str, tuple[int, ...]]  # every logical name -> its full shape in the config's layout

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor."""

    def narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """`read(name).narrow(dim, start, length)`, without reading the rest."""

    def a_log_heads(self, name: str, start: int, length: int) -> torch.Tensor:
        """Decay rates of heads `start:start+length` of the KDA `A_log` `name`, flat [length] (A_log has two
        published layouts, `layout.a_log_heads`)."""

    def order(self, names: Iterable[str]) -> list[str]:
        """`names` in the order that is cheapest to read (a checkpoint: grouped by file)."""

    def release(self) -> None:
        """Drop what the reads keep open (mapped files); later reads reopen it."""


class StateDictSource:
    """A `TensorSource` over logical tensors in memory (e.g. `reference_state`, or `load_state_dict`'s
    result); the caller keeps ownership, reads copy."""

    def __init__(self, state: Mapping[str, torch.Tensor], config: K3Config, dtype: torch.dtype = torch.float32):
        self.state, self.num_heads, self.dtype = state, config.kda_num_heads, dtype
        self.shapes = {name: tuple(t.shape) for name, t in state.items()}

    def read(self, name: str) -> torch.Tensor:
        return _fresh(name, self.state[name], self.dtype)

    def narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        return _fresh(name, self.state[name].narrow(dim, start, length), self.dtype)

    def a_log_heads(self, name: str, start: int, length: int) -> torch.Tensor:
        return _fresh(name, a_log_heads(self.state[name], self.num_heads)[start : start + length], self.dtype)

    def order(self, names: Iterable[str]) -> list[str]:
        return list(names)

    def release(self) -> None:
        return None


def _fresh(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a fresh (aligned) allocation: BLAS picks kernels by alignment, and a view into the mapped file
    # would make a loaded model differ from the saved one in the last bit
    return t.to(dtype=stored_dtype(name, dtype), memory_format=torch.contiguous_format, copy=True)


class CheckpointSource:
    """The checkpoint at `path` as a lazy `TensorSource`: shapes from the headers, data read on demand.

    Opening reads only the safetensors headers and validates them against the config's layout (a missing,
    unexpected or wrongly shaped tensor, an unknown quantization, a non-float dtype: ValueError naming the
    tensor or file), so a bad checkpoint fails before any tensor data is read. A slice reads only its own
    bytes (`safe_open(...).get_slice`); an MXFP4 expert decodes only its rows, or the 32-wide blocks that
    cover its columns. At most one file is mapped at a time (a read from another file closes it, and
    `release()` does), so the pages of the checkpoint a rank has mapped never exceed one shard file; use it
    as a context manager, or call `release()`, to unmap the last one.

    With `tie_word_embeddings` a stored `lm_head.weight` must equal the embedding: each read of (a slice of)
    the embedding compares the same slice of the stored head.
    """

    def __init__(self, path: str | Path, config: K3Config, dtype: torch.dtype = torch.float32):
        self.path, self.config, self.dtype = Path(path), config, dtype
        self.shapes = tensor_shapes(config)
        grouped = _logical_names(config, _tensor_files(self.path))
        self._tied_head = grouped.pop("lm_head.weight", None) if config.tie_word_embeddings else None
        missing = [n for n in self.shapes if n not in grouped]
        if missing:
            raise ValueError(f"checkpoint {self.path}: {len(missing)} tensor(s) missing, e.g. {missing[:5]}")
        unexpected = [n for n in grouped if n not in self.shapes]
        if unexpected:
            raise ValueError(
                f"checkpoint {self.path}: {len(unexpected)} tensor(s) not in the config's layout "
                f"(config inconsistent with tensors?), e.g. {unexpected[:5]}"
            )
        self._parts = grouped  # logical -> {"weight" | "weight_packed" | "weight_scale": (stored, file)}
        self._mapped: tuple[Path, object] | None = None
        try:
            for name in self.order(self.shapes):
                self._check_header(name)
        finally:
            self.release()

    def read(self, name: str) -> torch.Tensor:
        t = self._stored(name, ())
        if name.endswith(".A_log") and tuple(t.shape) != self.shapes[name]:
            t = _a_log_as(t, self.shapes[name], self.config.kda_num_heads, name)
        return _fresh(name, t, self.dtype)

    def narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        shape = self.shapes[name]
        if not (0 <= dim < len(shape) and start >= 0 and length >= 0 and start + length <= shape[dim]):
            raise ValueError(f"tensor {name!r} of shape {shape}: no slice {start}:{start + length} along dim {dim}")
        if name.endswith(".A_log"):  # tiny, and its stored layout may differ from the config's
            return self.read(name).narrow(dim, start, length).clone()
        return _fresh(name, self._stored(name, (slice(None),) * dim + (slice(start, start + length),)), self.dtype)

    def a_log_heads(self, name: str, start: int, length: int) -> torch.Tensor:
        heads = a_log_heads(self._stored(name, ()), self.config.kda_num_heads)
        return _fresh(name, heads[start : start + length], self.dtype)

    def order(self, names: Iterable[str]) -> list[str]:
        return sorted(names, key=lambda n: str(next(iter(self._parts[n].values()))[1]))

    def release(self) -> None:
        if self._mapped is not None:
            self._mapped[1].__exit__(None, None, None)  # type: ignore[attr-defined]
            self._mapped = None

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _get(self, stored: str, f: Path, index: tuple = (), header: bool = False):
        """Stored tensor `stored` of file `f` indexed by `index` (a view of the mapping; () = whole), or with
        `header` its (shape, safetensors dtype) without reading data."""
        if self._mapped is None or self._mapped[0] != f:
            self.release()
            handle = _open(f)
            handle.__enter__()
            self._mapped = (f, handle)
        handle = self._mapped[1]
        try:
            if header:
                s = handle.get_slice(stored)  # type: ignore[attr-defined]
                return tuple(s.get_shape()), s.get_dtype()
            return handle.get_slice(stored)[index] if index else handle.get_tensor(stored)  # type: ignore
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: tensor {stored!r} cannot be read ({e})") from None

    def _check_header(self, name: str) -> None:
        shape, parts, heads = self.shapes[name], self._parts[name], self.config.kda_num_heads
        if "weight" in parts:
            if len(parts) > 1:
                raise ValueError(f"tensor {name!r}: stored both dense and quantized")
            got, dtype = self._get(*parts["weight"], header=True)
            if name.endswith(".A_log") and a_log_heads(torch.empty(got, device="meta"), heads) is None:
                raise ValueError(
                    f"tensor {name!r}: shape {got} is no A_log layout for {heads} heads "
                    f"(expected [1, 1, {heads}, 1] or a flat vector of >= {heads} entries)"
                )
            if got != shape and not name.endswith(".A_log"):
                raise ValueError(f"tensor {name!r}: shape {got} does not match config (expected {shape})")
            if not dtype.startswith(("F", "BF")):
                raise ValueError(f"tensor {name!r}: dtype {dtype} is not floating point")
            return
        if set(parts) != {"weight_packed", "weight_scale"}:
            raise ValueError(f"tensor {name!r}: MXFP4 needs weight_packed and weight_scale, found {sorted(parts)}")
        (packed, p_dtype), (scale, s_dtype) = (
            self._get(*parts[k], header=True) for k in ("weight_packed", "weight_scale")
        )
        want_p, want_s = (shape[0], shape[1] // 2), (shape[0], shape[1] // 32)
        if packed != want_p or scale != want_s:
            raise ValueError(
                f"tensor {name!r}: MXFP4 shapes packed {packed} / scale {scale} do not match config "
                f"(expected {want_p} / {want_s})"
            )
        if p_dtype != "U8" or s_dtype != "U8":
            raise ValueError(f"tensor {name!r}: MXFP4 tensors must be uint8, got {p_dtype} / {s_dtype}")

    def _stored(self, name: str, index: tuple) -> torch.Tensor:
        """`name` as stored (any dtype; MXFP4 decoded to fp32) indexed by `index`: () whole, else slices
        along the leading dims. A view of the mapping (it keeps that file mapped while it lives, even after
        another file is opened) or a fresh decode; callers copy it."""
        parts = self._parts[name]
        if "weight" not in parts:
            return self._mxfp4(parts, index)
        t = self._get(*parts["weight"], index)
        if name == "model.embed_tokens.weight" and self._tied_head is not None:
            if not torch.equal(self._get(*self._tied_head["weight"], index), t):
                raise ValueError(
                    "tensor 'lm_head.weight': config has tie_word_embeddings=true but the stored "
                    "lm_head differs from model.embed_tokens.weight"
                )
        return t

    def _mxfp4(self, parts: dict[str, tuple[str, Path]], index: tuple) -> torch.Tensor:
        """Decode an MXFP4 [out, in] tensor's rows (index on dim 0), or the blocks covering its columns."""
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        if len(index) < 2:  # whole, or rows: packed and scale share the row index
            return dequantize_mxfp4(self._get(*packed, index), self._get(*scale, index), dtype=torch.float32)
        cols, block = index[1], MXFP4_BLOCK_SIZE
        b0, b1 = cols.start // block, -(-cols.stop // block)  # the 32-wide blocks covering the columns
        p = self._get(*packed, (slice(None), slice(b0 * block // 2, b1 * block // 2)))
        s = self._get(*scale, (slice(None), slice(b0, b1)))
        return dequantize_mxfp4(p, s, dtype=torch.float32)[:, cols.start - b0 * block : cols.stop - b0 * block]


def load_state_dict(path: str | Path, config: K3Config, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read and validate every tensor of the checkpoint at `path` for `config`. Returns logical names -> tensors
    in `dtype` (fp32 for router/gate parameters), MXFP4 experts dequantized. (`CheckpointSource` reads slices.)"""
    with CheckpointSource(path, config, dtype) as source:
        state = {name: source.read(name) for name in source.order(source.shapes)}
    return {name: state[name] for name in source.shapes}


def _a_log_as(t: torch.Tensor, shape: tuple[int, ...], num_heads: int, name: str) -> torch.Tensor:
    """A per-head A_log stored in the other layout (or padded to another length), in `shape`."""
    heads = a_log_heads(t, num_heads)
    if heads is None:
        raise ValueError(
            f"tensor {name!r}: shape {tuple(t.shape)} is no A_log layout for {num_heads} heads "
            f"(expected [1, 1, {num_heads}, 1] or a flat vector of >= {num_heads} entries)"
        )
    out = torch.zeros(shape, dtype=t.dtype)
    out.view(-1)[:num_heads] = heads
    return out


def load_pretrained(cls, path: str | Path, dtype: torch.dtype, device: str | torch.device):
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: no config.json")
    config = K3Config.from_json_file(path / "config.json")
    state = load_state_dict(path, config, dtype)
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device)


def load_vision_state_dict(
    path: str | Path, config: VisionConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The `vision_tower.*` / `mm_projector.*` tensors of the checkpoint at `path`, in `dtype`. The headers are
    checked against `config.tensor_shapes()` first (a missing, unexpected or wrongly shaped tensor, a
    non-float dtype: ValueError naming the tensor), so a bad checkpoint fails before any data is read."""
    path = Path(path)
    shapes = config.tensor_shapes()
    stored = {name: f for name, f in _tensor_files(path).items() if name.startswith(_VISION_PREFIXES)}
    if not stored:
        raise ValueError(
            f"checkpoint {path}: no vision tensors ({' / '.join(_VISION_PREFIXES)}*): a text-only checkpoint"
        )
    missing = [n for n in shapes if n not in stored]
    if missing:
        raise ValueError(f"checkpoint {path}: {len(missing)} vision tensor(s) missing, e.g. {missing[:5]}")
    unexpected = [n for n in stored if n not in shapes]
    if unexpected:
        raise ValueError(
            f"checkpoint {path}: {len(unexpected)} vision tensor(s) not in the vision_config's layout, "
            f"e.g. {unexpected[:5]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(stored[name], []).append(name)
    for f, names in by_file.items():  # headers first: nothing is read from a checkpoint that does not fit
        with _open(f) as handle:
            for name in names:
                s = handle.get_slice(name)
                if tuple(s.get_shape()) != shapes[name]:
                    raise ValueError(
                        f"tensor {name!r}: shape {tuple(s.get_shape())} does not match vision_config "
                        f"(expected {shapes[name]})"
                    )
                if not s.get_dtype().startswith(("F", "BF")):
                    raise ValueError(f"tensor {name!r}: dtype {s.get_dtype()} is not floating point")
    state: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with _open(f) as handle:
            for name in names:
                state[name] = handle.get_tensor(name).to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    return {name: state[name] for name in shapes}


def load_vision_pretrained(cls, path: str | Path, dtype: torch.dtype, device: str | torch.device):
    """`cls` (K3VisionModel) built from the checkpoint at `path`: its config.json's `vision_config`, checked
    against the text config it sits beside, then the tensors (`load_vision_state_dict`)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: no config.json")
    text = K3Config.from_json_file(path / "config.json")
    vision = text.vision_config
    if vision is None:
        raise ValueError(f"{path / 'config.json'}: no vision_config (a text-only checkpoint)")
    if vision.text_hidden_size != text.hidden_size:
        raise ValueError(
            f"{path / 'config.json'} vision_config.text_hidden_size: {vision.text_hidden_size} differs "
            f"from text_config.hidden_size {text.hidden_size} (the projector writes text embeddings)"
        )
    state = load_vision_state_dict(path, vision, dtype)
    with torch.device("meta"):
        model = cls(vision)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device)


def as_stored(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """`state` (logical names, fp32) as a save/load round trip returns it: with `config.experts_mxfp4`, the
    routed experts snapped to the MXFP4 grid (K3 ships them so); other tensors are the same objects.
    A random-init base needs this so the trainer's dense experts equal what an MXFP4 engine holds,
    as they do for a real K3 checkpoint; otherwise the two disagree by the quantization error."""
    if not config.experts_mxfp4:
        return state
    return {
        name: dequantize_mxfp4(*quantize_mxfp4(t), dtype=t.dtype) if is_routed_expert_tensor(name) else t
        for name, t in state.items()
    }


def _stored_tensors(model: torch.nn.Module, config: K3Config) -> dict[str, torch.Tensor]:
    prefix = hf_prefix(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if config.experts_mxfp4 and is_routed_expert_tensor(name):
            packed, scale = quantize_mxfp4(t)
            base = prefix + name[: -len(".weight")]
            out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = packed, scale
        else:
            out[prefix + name] = t.clone()
    return out


@contextmanager
def staged_dir(path: Path, *, last: str, stale: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary sibling of `path` to write a directory's files into. On normal exit it is published at
    `path`: a new directory appears whole (one rename); into an existing one each file is replaced
    atomically with `last` moved last (a reader that sees it sees the rest), files that are not ours stay
    untouched, and existing files matching the `stale` globs that this write did not produce are removed
    (e.g. shards of an earlier save with another shard count). On an exception it is removed."""
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if not path.exists():
            os.replace(tmp, path)
            return
        new_files = sorted(p.name for p in tmp.iterdir())
        for name in sorted(new_files, key=lambda n: n == last):
            os.replace(tmp / name, path / name)
        for old in (f for pattern in stale for f in path.glob(pattern)):
            if old.name not in new_files:
                old.unlink()
        tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _vision_tensors(vision: torch.nn.Module, config: K3Config) -> dict[str, torch.Tensor]:
    """The vision model's tensors as stored (its state-dict names are the checkpoint's), checked to be the
    tower the text config's `vision_config` describes (a VL checkpoint has one config.json for both)."""
    if not config.vl_wrapper:
        raise ValueError("save_pretrained(vision=...): vision weights need K3's wrapper layout (vl_wrapper=True)")
    if config.vision_config != vision.config:  # type: ignore[attr-defined]
        raise ValueError(
            "save_pretrained(vision=...): the vision model's config differs from the text config's "
            "vision_config (the checkpoint's config.json would describe another tower)"
        )
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in vision.state_dict().items()}


def save_pretrained(
    model: torch.nn.Module, path: str | Path, max_shard_bytes: int = 4 << 30, vision: torch.nn.Module | None = None
) -> None:
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes`), atomically. With
    `vision` (a `K3VisionModel` of the config's `vision_config`) its tensors go into the same shards and
    index, unprefixed, as K3 ships them; without it the checkpoint holds the text model only."""
    config: K3Config = model.config  # type: ignore[assignment]
    path = Path(path)
    extra = {} if vision is None else _vision_tensors(vision, config)
    with staged_dir(path, last="config.json", stale=("model*.safetensors", INDEX_FILE)) as tmp:
        tensors = {**_stored_tensors(model, config), **extra}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=meta)
                weight_map.update({n: fname for n in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        config.to_json_file(tmp / "config.json")
