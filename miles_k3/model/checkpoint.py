"""HF-layout checkpoints: read and write `config.json` + safetensors (sharded or not).

Reading validates the tensors against the layout the config implies before a
model is built: a missing tensor, an unexpected one, a wrong shape, an
unknown quantization or a file that is not safetensors raises ValueError naming
the tensor or file. Routed experts may be compressed-tensors MXFP4
(`weight_packed` uint8 [out, in/2], `weight_scale` E8M0 uint8 [out, in/32]);
they are dequantized into the dense in-memory model. In K3's wrapper the text
weights carry `language_model.`; the vision tower and projector (`vision_tower.*`,
`mm_projector.*`, unprefixed) are not part of the text model and are skipped. A
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from miles_k3.model.config import K3Config
from miles_k3.model.layout import a_log_heads, hf_prefix, is_routed_expert_tensor, tensor_shapes
from miles_k3.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4

INDEX_FILE = "model.safetensors.index.json"
# Kept in fp32 whatever the model dtype: router and gate parameters whose precision steers routing/decay.
_FP32_TENSORS = re.compile(r"(\.gate\.weight|e_score_correction_bias|\.dt_bias|\.A_log)$")
# transformers' KimiLinear writes dense-MLP tensors under block_sparse_moe; the hub layout says mlp.
_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_QUANT_SUFFIX = re.compile(r"\.(weight_packed|weight_scale|weight_zero_point|weight_global_scale|input_scale|"
                           r"weight_shape|input_global_scale)$")


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
                raise ValueError(f"tensor {stored_name!r}: K3's text weights are prefixed {prefix!r} (and the "
                                 f"vision ones {' / '.join(_VISION_PREFIXES)}); this is neither")
            name = stored_name[len(prefix):]
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
                raise ValueError(f"tensor {stored_name!r}: unknown quantization tensor {kind!r}; only "
                                 "compressed-tensors mxfp4-pack-quantized (weight_packed, weight_scale) is supported")
            if not config.experts_mxfp4:
                raise ValueError(f"tensor {stored_name!r} is quantized but config.json has no "
                                 "compressed-tensors quantization_config")
            if not is_routed_expert_tensor(logical):
                raise ValueError(f"tensor {stored_name!r}: only routed experts may be MXFP4-quantized")
        else:
            kind, logical = "weight", name
        grouped.setdefault(logical, {})[kind] = (stored_name, f)
    return grouped


def load_state_dict(path: str | Path, config: K3Config, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read and validate every tensor of the checkpoint at `path` for `config`. Returns logical names -> tensors
    in `dtype` (fp32 for router/gate parameters), MXFP4 experts dequantized."""
    path = Path(path)
    expected = tensor_shapes(config)
    grouped = _logical_names(config, _tensor_files(path))
    tied_head = grouped.pop("lm_head.weight", None) if config.tie_word_embeddings else None
    missing = [n for n in expected if n not in grouped]
    if missing:
        raise ValueError(f"checkpoint {path}: {len(missing)} tensor(s) missing, e.g. {missing[:5]}")
    unexpected = [n for n in grouped if n not in expected]
    if unexpected:
        raise ValueError(f"checkpoint {path}: {len(unexpected)} tensor(s) not in the config's layout "
                         f"(config inconsistent with tensors?), e.g. {unexpected[:5]}")
    handles: dict[Path, object] = {}

    def read(stored: str, f: Path) -> torch.Tensor:
        if f not in handles:
            handles[f] = _open(f)
        try:
            return handles[f].get_tensor(stored)  # type: ignore[attr-defined]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: tensor {stored!r} cannot be read ({e})") from None

    state: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        parts = grouped[name]
        if "weight" in parts:
            if len(parts) > 1:
                raise ValueError(f"tensor {name!r}: stored both dense and quantized")
            t = read(*parts["weight"])
        else:
            if set(parts) != {"weight_packed", "weight_scale"}:
                raise ValueError(f"tensor {name!r}: MXFP4 needs weight_packed and weight_scale, found {sorted(parts)}")
            packed, scale = read(*parts["weight_packed"]), read(*parts["weight_scale"])
            want_p, want_s = (shape[0], shape[1] // 2), (shape[0], shape[1] // 32)
            if tuple(packed.shape) != want_p or tuple(scale.shape) != want_s:
                raise ValueError(f"tensor {name!r}: MXFP4 shapes packed {tuple(packed.shape)} / scale "
                                 f"{tuple(scale.shape)} do not match config (expected {want_p} / {want_s})")
            if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
                raise ValueError(f"tensor {name!r}: MXFP4 tensors must be uint8, got {packed.dtype} / {scale.dtype}")
            t = dequantize_mxfp4(packed, scale, dtype=torch.float32)
        if name.endswith(".A_log") and tuple(t.shape) != shape:
            t = _a_log_as(t, shape, config.kda_num_heads, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r}: shape {tuple(t.shape)} does not match config (expected {shape})")
        if not t.is_floating_point():
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not floating point")
        # a fresh (aligned) allocation: BLAS picks kernels by alignment, and a view into the mapped file
        # would make a loaded model differ from the saved one in the last bit
        state[name] = t.to(stored_dtype(name, dtype), copy=True)
    if tied_head is not None and not torch.equal(read(*tied_head["weight"]), read(*grouped[
            "model.embed_tokens.weight"]["weight"])):
        raise ValueError("tensor 'lm_head.weight': config has tie_word_embeddings=true but the stored lm_head "
                         "differs from model.embed_tokens.weight")
    return state


def _a_log_as(t: torch.Tensor, shape: tuple[int, ...], num_heads: int, name: str) -> torch.Tensor:
    """A per-head A_log stored in the other layout (or padded to another length), in `shape`."""
    heads = a_log_heads(t, num_heads)
    if heads is None:
        raise ValueError(f"tensor {name!r}: shape {tuple(t.shape)} is no A_log layout for {num_heads} heads "
                         f"(expected [1, 1, {num_heads}, 1] or a flat vector of >= {num_heads} entries)")
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


def as_stored(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """`state` (logical names, fp32) as a save/load round trip returns it: with `config.experts_mxfp4`, the
    routed experts snapped to the MXFP4 grid (K3 ships them so); other tensors are the same objects.
    A random-init base needs this so the trainer's dense experts equal what an MXFP4 engine holds,
    as they do for a real K3 checkpoint; otherwise the two disagree by the quantization error."""
    if not config.experts_mxfp4:
        return state
    return {name: dequantize_mxfp4(*quantize_mxfp4(t), dtype=t.dtype) if is_routed_expert_tensor(name) else t
            for name, t in state.items()}


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


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes`), atomically."""
    config: K3Config = model.config  # type: ignore[assignment]
    path = Path(path)
    with staged_dir(path, last="config.json", stale=("model*.safetensors", INDEX_FILE)) as tmp:
        tensors = _stored_tensors(model, config)
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
            (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2))
        config.to_json_file(tmp / "config.json")
