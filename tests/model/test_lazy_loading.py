"""Lazy sharded reading: a CheckpointSource's slices equal the same slices of the full load (every tensor,
MXFP4 experts included), it reads file by file, and a rank that reads only its slices peaks at about its
shard of host memory where the full load peaks at the whole model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import miles_k3.model.checkpoint as checkpoint
from megatron_patches.loading import local_state
from miles_k3.model import K3Config, K3ForCausalLM
from miles_k3.model.checkpoint import CheckpointSource, StateDictSource, as_stored, load_state_dict
from miles_k3.model.layout import a_log_heads

REPO = Path(__file__).resolve().parents[2]


def _saved(tmp_path: Path, config: K3Config, dtype: torch.dtype, seed: int) -> tuple[Path, dict]:
    """A checkpoint of a seeded model, sharded in small files; returns it and the state it must load as."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config).to(dtype)
    model.save_pretrained(tmp_path, max_shard_bytes=64 << 10)
    want = as_stored({k: v.float() for k, v in model.state_dict().items()}, config)
    return tmp_path, want


CONFIGS = {
    # K3: `language_model.` prefix, MXFP4 routed experts ([64, 64]: a quarter of a row is half a 32-block),
    # LatentMoE projections, the flat zero-padded A_log, fp32 throughout
    "k3-mxfp4": (K3Config.from_preset("k3-tiny", experts_mxfp4=True), torch.float32),
    # Kimi-Linear form, tied embeddings, A_log [1, 1, H, 1], stored in bf16 (read back as fp32)
    "kimi-tied-bf16": (
        K3Config.from_preset("k3-tiny").kimi_linear_form().replace(tie_word_embeddings=True),
        torch.bfloat16,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory):
    config, dtype = CONFIGS[request.param]
    path, want = _saved(tmp_path_factory.mktemp(request.param), config, dtype, seed=3)
    assert len(list(path.glob("model-*.safetensors"))) > 3
    return path, config, want


def _cuts(n: int) -> list[tuple[int, int]]:
    """(start, length) slices of a dim of size n: whole, each quarter (TP=4 ranks), and an unaligned one."""
    cuts = [(0, n)]
    if n % 4 == 0:
        cuts += [(r * n // 4, n // 4) for r in range(4)]
    if n > 2:
        cuts.append((1, n - 2))
    return cuts


def test_every_slice_of_every_tensor_equals_the_full_load(ckpt):
    path, config, want = ckpt
    full = load_state_dict(path, config)
    assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want)
    with CheckpointSource(path, config) as source:
        assert dict(source.shapes) == {k: tuple(v.shape) for k, v in full.items()}
        for name, t in full.items():
            got = source.read(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
            for dim, n in enumerate(t.shape):
                for start, length in _cuts(n):
                    part = source.narrow(name, dim, start, length)
                    assert part.is_contiguous() and torch.equal(part, t.narrow(dim, start, length)), (
                        name,
                        dim,
                        start,
                        length,
                    )
            if name.endswith(".A_log"):
                heads = a_log_heads(t, config.kda_num_heads)
                for start, length in _cuts(config.kda_num_heads):
                    assert torch.equal(source.a_log_heads(name, start, length), heads[start : start + length])
    experts = [n for n in full if ".experts." in n]
    assert experts and all(torch.equal(full[n], want[n]) for n in experts)


def test_a_state_dict_source_slices_as_the_checkpoint_does(ckpt):
    path, config, want = ckpt
    memory, disk = StateDictSource(want, config, torch.bfloat16), CheckpointSource(path, config, torch.bfloat16)
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    for a, b in [
        (memory.narrow(name, 1, 16, 16), disk.narrow(name, 1, 16, 16)),
        (memory.read("model.embed_tokens.weight"), disk.read("model.embed_tokens.weight")),
        (
            memory.a_log_heads("model.layers.0.self_attn.A_log", 2, 2),
            disk.a_log_heads("model.layers.0.self_attn.A_log", 2, 2),
        ),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert memory.read("model.layers.0.self_attn.dt_bias").dtype == torch.float32  # decay stays fp32
    disk.release()


def _rank_slicer(rank: int, size: int):
    """A test layout (TP-like): output projections cut along dim 1, other matrices along dim 0, KDA decay
    rates by head, vectors whole."""

    def slicer(name: str, source) -> torch.Tensor:
        shape = source.shapes[name]
        if name.endswith(".A_log"):
            heads = CONFIGS["k3-mxfp4"][0].kda_num_heads // size
            return source.a_log_heads(name, rank * heads, heads)
        if len(shape) < 2:
            return source.read(name)
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")) else 0
        step = shape[dim] // size
        return source.narrow(name, dim, rank * step, step)

    return slicer


def test_local_state_reads_file_by_file_and_casts(ckpt, monkeypatch):
    path, config, want = ckpt
    opened = []
    real_open = checkpoint._open
    monkeypatch.setattr(checkpoint, "_open", lambda f: opened.append(f.name) or real_open(f))
    source = CheckpointSource(path, config)
    files = len(list(path.glob("model-*.safetensors")))
    assert len(opened) == files  # validation reads each header once
    names = [n for n in reversed(list(source.shapes)) if not n.endswith("norm.weight")]  # any order, any subset
    local = local_state(source, names, _rank_slicer(1, 4), dtype=torch.bfloat16)
    assert list(local) == names
    reads = opened[files:]
    assert len(reads) == len(set(reads)) > files // 2  # each file mapped once, not once per tensor or switch
    assert source._mapped is None  # released
    ref = local_state(StateDictSource(want, config), names, _rank_slicer(1, 4), dtype=torch.bfloat16)
    for name in names:
        assert local[name].dtype == (torch.float32 if checkpoint.keeps_fp32(name) else torch.bfloat16)
        assert torch.equal(local[name], ref[name]), name
    with pytest.raises(ValueError, match="does not hold.*lm_head.bias"):
        local_state(source, ["lm_head.bias"], _rank_slicer(0, 4))


def test_a_slice_out_of_range_is_named(ckpt):
    path, config, _ = ckpt
    with (
        CheckpointSource(path, config) as source,
        pytest.raises(ValueError, match=r"'model.norm.weight' of shape \(128,\): no slice 100:140 along dim 0"),
    ):
        source.narrow("model.norm.weight", 0, 100, 40)


def test_a_tied_head_that_differs_is_named_when_its_slice_is_read(tmp_path):
    config = CONFIGS["kimi-tied-bf16"][0]
    path, _ = _saved(tmp_path, config.replace(), torch.float32, seed=4)
    index = json.loads((path / checkpoint.INDEX_FILE).read_text())
    f = path / index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(f)
    head = tensors["model.embed_tokens.weight"].clone()
    head[300] += 1.0  # differs in a row of the second half only
    tensors["lm_head.weight"] = head
    save_file(tensors, f)
    index["weight_map"]["lm_head.weight"] = f.name
    (path / checkpoint.INDEX_FILE).write_text(json.dumps(index))
    with CheckpointSource(path, config) as source:
        assert torch.equal(source.narrow("model.embed_tokens.weight", 0, 0, 256), head[:256])  # this half agrees
        with pytest.raises(ValueError, match="tie_word_embeddings=true but the stored lm_head differs"):
            source.narrow("model.embed_tokens.weight", 0, 256, 256)


# ------------------------------------------------------------------ peak host memory, measured
_MEASURE = textwrap.dedent("""
    import json, sys, torch
    from miles_k3.model import K3Config
    from miles_k3.model.checkpoint import CheckpointSource, load_state_dict

    def kib(key):
        return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))

    path, mode = sys.argv[1], sys.argv[2]
    config = K3Config.from_json_file(path + "/config.json")
    source = CheckpointSource(path, config)  # headers only
    if mode == "sharded":
        from megatron_patches.loading import local_state  # (imports megatron: only where it is used)
        from tests.model.test_lazy_loading import _rank_slicer
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS restarts from the current RSS
    before = kib("VmRSS")
    if mode == "full":
        state = load_state_dict(path, config)
    else:
        state = local_state(source, list(source.shapes), _rank_slicer(1, 4))
    held = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"peak": (kib("VmHWM") - before) * 1024, "held": held}))
""")


def _big_config() -> K3Config:
    """~220 MB of fp32 weights, most of it in tensors that a rank cuts to a quarter."""
    return K3Config.from_preset(
        "k3-tiny",
        vocab_size=16384,
        hidden_size=1024,
        kda_num_heads=8,
        kda_head_dim=128,
        dense_intermediate_size=2048,
        moe_latent_size=256,
        moe_intermediate_size=256,
    )


def _write_random_checkpoint(path: Path, config: K3Config, shard_bytes: int) -> int:
    """The config's layout as stored by K3 (`language_model.` prefix), random fp32 values, sharded."""
    from miles_k3.model.layout import hf_prefix, tensor_shapes

    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in tensor_shapes(config).items():
        t = torch.randn(shape, generator=g) * 0.02
        if shards[-1] and size + t.numel() * 4 > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_prefix(config) + name] = t
        size += t.numel() * 4
        total += t.numel() * 4
    path.mkdir()
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname))
        weight_map.update({n: fname for n in shard})
    (path / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    config.to_json_file(path / "config.json")
    return total


def _peak(path: Path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), mode], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_peaks_at_about_its_shard_of_host_memory(tmp_path):
    """Measure: the rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
    just before the load) over its resident set then, in a fresh process. It counts everything resident:
    the tensors read, transient copies and decodes, and the mapped checkpoint pages touched."""
    config = _big_config()
    shard_bytes = 24 << 20
    total = _write_random_checkpoint(tmp_path / "ckpt", config, shard_bytes)
    full, sharded = _peak(tmp_path / "ckpt", "full"), _peak(tmp_path / "ckpt", "sharded")
    assert full["held"] == total and full["peak"] >= total  # the full load holds every tensor
    assert sharded["held"] < 0.3 * total  # a quarter of nearly everything (vectors whole)
    # a rank's peak: what it keeps, plus at most one mapped shard file and one tensor in flight
    largest = max(t.numel() * 4 for t in load_file(next((tmp_path / "ckpt").glob("*.safetensors"))).values())
    assert sharded["peak"] <= sharded["held"] + shard_bytes + largest + (16 << 20), (sharded, full)
    assert sharded["peak"] < 0.5 * full["peak"], (sharded, full)
    print(
        f"peak rise: full load {full['peak'] / 2**20:.0f} MiB (holds {total / 2**20:.0f} MiB), rank 1 of 4 "
        f"{sharded['peak'] / 2**20:.0f} MiB (holds {sharded['held'] / 2**20:.0f} MiB)"
    )
