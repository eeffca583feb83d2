"""PEFT-format adapter files (adapter_config.json + adapter_model.safetensors) in the naming of the model family
the checkpoint belongs to, read back from any of the formats below.

Formats that exist for Kimi K3 / Kimi-Linear LoRA adapters, and which we read (R) and write (W):

  k3 (R, W)  K3's published modeling code and our engine's names: `...block_sparse_moe.shared_experts.*`,
             `self_attn.f_a_proj`, one module per routed expert:
                 base_model.model.<module>.lora_A.weight [r, in], .lora_B.weight [out, r]
                 base_model.model.<..>.block_sparse_moe.experts.<e>.w1|w2|w3.lora_A|lora_B.weight
             `target_modules` one regex, full-matched by PEFT: the alternation of the adapted modules (expert
             index generalized to `\\d+`). K3's VL checkpoint wants module_prefix="language_model.".
  kimi_linear (R, W)  transformers' own KimiLinearForCausalLM (PEFT >= 0.21): `mlp.shared_experts.*`,
             `self_attn.forget_gate.f_a_proj`, and the stacked experts `mlp.experts.gate_up_proj` [E, 2I, H]
             (w1's rows, then w3's) and `down_proj` [E, H, I] adapted through `target_parameters` (PEFT's
             ParamWrapper): lora_A [E*r, in] (expert-major rows), lora_B [out, r*E] (column j*E + e is rank j
             of expert e); the wrapper of gate_up_proj sits inside down_proj's, so with both adapted its keys
             are `<..>.mlp.experts.base_layer.lora_A.weight` and down_proj's `<..>.mlp.experts.lora_A.weight`.
             gate_up_proj has one A per expert: our w1 and w3 adapters are written as one rank-2r block-diagonal
             adapter (rank_pattern 2r, alpha_pattern 2 alpha: the same scale), or rank r when their A are equal.
             ParamWrapper refuses lora_dropout != 0, so the config says 0 and our dropout travels in the
             safetensors metadata.
  stacked (R)  one 3-D tensor per expert projection, `<..>.experts.w1.lora_A.weight` [E or 1, r, in],
             `.lora_B.weight` [E or 1, out, r]; a leading 1 is shared by every expert (the shared-outer layout of
             Miles' K3 recipe: w1 / w3 share A across experts, w2 shares B; vLLM's FusedMoEWithSharedOuterLoRA
             computes that sharing).
  vLLM (its LoRA loader, vllm/lora/lora_model.py): reads per-expert keys `...experts.<e>.<proj>` (our k3
             format) and PEFT's 3-D layout where `experts.base_layer` is gate_up_proj and `experts` down_proj
             (our kimi_linear format); its Kimi model classes' own module-name mapping was not checked here.
  sglang (W)  what SGLang's LoRA loader applies to its KimiK3 / KimiLinear model (read from sgl-project/sglang,
             python/sglang/srt/lora/: lora.py `LoRAAdapter._normalize_weights`, mem_pool.py
             `load_lora_weight_to_buffer`, utils.py `get_normalized_target_modules` / `get_target_module_name`,
             lora_manager.py `init_lora_modules`): the k3 names with per-expert 2-D keys `experts.<e>.w1|w2|w3`
             (renamed to gate/up/down_proj, w1 and w3 stacked into `gate_up_proj_moe`), `target_modules` a list
             of leaf names (a string other than "all" / "all-linear" is refused; w1 / w3 / w2 listed as gate_proj
             / up_proj / down_proj: FusedMoE is wrapped only with both gate_up_proj and down_proj targeted). Its
             buffers are keyed by layer index and a substring of the leaf name, so every gate / up pair, expert
             triple w1 / w3 / w2 and MLA q_a / kv_a pair is written whole (a missing partner as zeros, left out of
             `miles_k3.modules`). One r and alpha (rank_pattern is not read). Modules it cannot apply fail the
             write (`sglang_unsupported`): KDA q / k / v / g / b / f_a / f_b (fused into fused_qkvg_proj or not
             LoRA targets), MLA q_proj and g_proj, the LatentMoE routed_expert_down / up_proj (no target; their
             names would land in the down_proj / up_proj buffers).

Every tensor of a file is placed (but PEFT's copy of a targeted lm_head's or embedding's base weight,
`<..>.base_layer.weight`, which is no delta: its shape is checked against `config`) or `load_peft` fails
naming its module and the file (a module no K3-family
model has, one `config` lacks, a shape that does not fit); what `save_peft` writes is applied whole by PEFT
on the family's model (tests/megatron_patches/test_peft_transformers.py). rank_pattern / alpha_pattern are
read: modules of lower rank are zero-padded to the largest, and a module's alpha / r folded into its B where
it differs from the adapter's, so the engine's one rank and scale compute the same deltas.

The safetensors metadata of a file we write names its engine modules (`miles_k3.modules`, so a w1-only expert
adapter reads back without w3), the gate_up adapters written block-diagonal (`miles_k3.block_gate_up`) and the
true dropout (`miles_k3.lora_dropout`): a round trip is bit-exact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from miles_k3.model.checkpoint import staged_dir
from miles_k3.model.config import K3Config
from miles_k3.model.layout import tensor_shapes
from miles_k3.model.lora_spec import (
    ADAPTER_FAMILIES,
    FAMILY_K3,
    FAMILY_KIMI_LINEAR,
    LoraSpec,
    adaptable_modules,
    is_adaptable_name,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>w[123])$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>w[123])$")
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_[AB])\.weight$")
_NESTED = re.compile(r"^(?P<module>.+?)(?P<nest>(?:\.base_layer)*)$")
_FORGET = re.compile(r"\.self_attn\.f_([ab])_proj$")
_FORGET_HF = re.compile(r"\.self_attn\.forget_gate\.f_([ab])_proj$")
_MLP_MOE = re.compile(r"\.mlp\.(?=(?:shared_experts|experts|routed_expert_(?:down|up)_proj)(?:\.|$))")
_EMBED_COPY = re.compile(r"^(lm_head|model\.embed_tokens)\.base_layer\.weight$")
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
FAMILY_SGLANG = "sglang"  # written only (`export-adapter --format sglang`): k3 names, SGLang's target_modules
_WRITE_FAMILIES = (*ADAPTER_FAMILIES, FAMILY_SGLANG)
# engine modules SGLang's LoRA cannot apply to K3 / Kimi-Linear, and why (module docstring)
_SGLANG_UNSUPPORTED = (
    (
        re.compile(r"\.self_attn\.(?:q_proj|k_proj|v_proj|g_proj|b_proj|f_a_proj|f_b_proj)$"),
        "SGLang's K3 fuses KDA q/k/v/g into fused_qkvg_proj and keeps b/f_a/f_b and the MLA gate as modules its "
        "LoRA does not wrap",
    ),
    (
        re.compile(r"\.routed_expert_(?:down|up)_proj$"),
        "SGLang has no LoRA target for the LatentMoE projections (its loader would file them under down_proj / "
        "up_proj)",
    ),
)
_SGLANG_LEAF = {
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}  # what get_normalized_target_modules wants  # KimiLinearExperts' parameters, in registration order
META_MODULES, META_BLOCK, META_DROPOUT = "miles_k3.modules", "miles_k3.block_gate_up", "miles_k3.lora_dropout"


def _modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Engine module names, each with both A and B present (ValueError otherwise)."""
    mods = set()
    for key in tensors:
        if not key.endswith((".lora_A", ".lora_B")):
            raise ValueError(f"adapter tensor {key!r}: name must end in .lora_A or .lora_B")
        mods.add(key[: -len(".lora_A")])
    for m in sorted(mods):
        for ab in ("lora_A", "lora_B"):
            if f"{m}.{ab}" not in tensors:
                raise ValueError(f"adapter module {m!r} has no {ab}")
    return sorted(mods)


def family_name(module: str, family: str) -> str:
    """An engine module name (K3's published naming) in `family`'s naming (module docstring)."""
    if family not in _WRITE_FAMILIES:
        raise ValueError(f"adapter family must be one of {_WRITE_FAMILIES}, got {family!r}")
    if family in (FAMILY_K3, FAMILY_SGLANG):
        return module
    return _FORGET.sub(r".self_attn.forget_gate.f_\1_proj", module.replace(".block_sparse_moe.", ".mlp."))


def engine_name(module: str) -> str:
    """A module name of any family -> the engine's (K3's published naming); names it does not know pass."""
    return _FORGET_HF.sub(r".self_attn.f_\1_proj", _MLP_MOE.sub(".block_sparse_moe.", module))


def infer_family(tensors: dict[str, torch.Tensor], module_prefix: str = "") -> str:
    """The family an adapter without a config is written in: `k3` when it adapts a module only K3 has
    (LatentMoE projections, a full-rank KDA gate or MLA output gate `self_attn.g_proj`) or sits under a
    wrapper prefix (K3's VL checkpoint), else `kimi_linear`. Pass `family=` (`adapter_family(config)`) where
    the config is at hand: an adapter of a K3 model that touches none of those modules would be misread."""
    k3_only = re.compile(r"\.(routed_expert_(down|up)_proj|self_attn\.g_proj)\.lora_[AB]$")
    return FAMILY_K3 if module_prefix or any(k3_only.search(k) for k in tensors) else FAMILY_KIMI_LINEAR


def sglang_unsupported(modules: Iterable[str]) -> dict[str, str]:
    """Engine modules SGLang's LoRA cannot apply to a K3 / Kimi-Linear model -> why (module docstring)."""
    out = {}
    for m in modules:
        reason = next((why for pattern, why in _SGLANG_UNSUPPORTED if pattern.search(m)), None)
        if reason is not None:
            out[m] = reason
    return out


def sglang_tensors(
    tensors: dict[str, torch.Tensor], config: K3Config, *, drop_unsupported: bool = False
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Engine-named tensors -> (what `save_peft(family="sglang")` writes: SGLang-unsupported modules dropped or
    refused, each gate / up pair, expert triple and MLA q_a / kv_a pair completed with zero partners; the zero
    partners' module names; the dropped module names). ValueError, one line naming the unsupported modules and
    why, unless `drop_unsupported`; or when a partner SGLang needs is not a module of `config`."""
    mods = _modules(tensors)
    bad = sglang_unsupported(mods)
    if bad and not drop_unsupported:
        by_reason: dict[str, list[str]] = {}
        for m, why in bad.items():
            by_reason.setdefault(why, []).append(m)
        raise ValueError(
            "SGLang cannot apply "
            + "; ".join(f"{', '.join(ms[:6])}{' ...' if len(ms) > 6 else ''} ({why})" for why, ms in by_reason.items())
            + " (--drop-unsupported leaves them out)"
        )
    out = {k: t for k, t in tensors.items() if k.rsplit(".", 1)[0] not in bad}
    if not out:
        raise ValueError("SGLang can apply none of the adapter's modules")
    kept = set(mods) - set(bad)
    groups = (
        ((".gate_proj", ".up_proj"), re.compile(r"\.(?:gate|up)_proj$")),
        ((".experts.w1", ".experts.w3", ".experts.w2"), re.compile(r"\.experts\.w[123]$")),
        ((".q_a_proj", ".kv_a_proj_with_mqa"), re.compile(r"\.(?:q_a_proj|kv_a_proj_with_mqa)$")),
    )
    shapes = _module_shapes(config)
    rank = tensors[f"{mods[0]}.lora_A"].shape[-2]
    partners: list[str] = []
    for m in sorted(kept):
        for suffixes, pattern in groups:
            hit = pattern.search(m)
            if hit is None:
                continue
            base = m[: hit.start()]
            for suffix in suffixes:
                p = base + suffix
                if p in kept or p in partners:
                    continue
                if p not in shapes:
                    raise ValueError(f"SGLang loads {m!r} together with {p!r}, which this model does not have")
                (o, i), a = shapes[p], tensors[f"{m}.lora_A"]
                lead = tuple(a.shape[:-2])  # routed experts: [E]
                out[f"{p}.lora_A"] = a.new_zeros(*lead, rank, i)
                out[f"{p}.lora_B"] = a.new_zeros(*lead, o, rank)
                partners.append(p)
    return out, sorted(partners), sorted(bad)


def _check_shapes(m: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> None:
    lead = 1 if _STACKED.match(m) else 0
    if (
        a.dim() != 2 + lead
        or b.dim() != 2 + lead
        or a.shape[-2] != rank
        or b.shape[-1] != rank
        or a.shape[:lead] != b.shape[:lead]
    ):
        raise ValueError(
            f"adapter module {m!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
            f"{'[E, ' if lead else '['}r, in] / {'[E, ' if lead else '['}out, r] with r={rank}"
        )


def _gate_up(ws: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """w1 / w3 adapters ([E, r, H], [E, I, r]) -> one gate_up_proj adapter (A [E, r', H], B [E, 2I, r'], whether
    it is block-diagonal): r' = r when only one is adapted or their A are equal, else 2r (block-diagonal)."""
    (a1, b1), (a3, b3) = ws.get("w1", (None, None)), ws.get("w3", (None, None))
    if a1 is None or a3 is None:
        a, b = (a1, b1) if a3 is None else (a3, b3)
        zero = torch.zeros_like(b)
        return a, torch.cat([b, zero] if a3 is None else [zero, b], dim=1), False
    if torch.equal(a1, a3):
        return a1, torch.cat([b1, b3], dim=1), False
    e, i, r = b1.shape
    b = b1.new_zeros(e, 2 * i, 2 * r)
    b[:, :i, :r], b[:, i:, r:] = b1, b3
    return torch.cat([a1, a3], dim=1), b, True


def peft_tensors(
    tensors: dict[str, torch.Tensor], rank: int, module_prefix: str = "", family: str = FAMILY_K3
) -> tuple[dict[str, torch.Tensor], dict]:
    """Engine-named adapter tensors -> (PEFT state-dict tensors, the adapter_config.json entries that say what
    they adapt: target_modules, and for kimi_linear target_parameters / rank_pattern / alpha_pattern with
    alpha_pattern as multiples of the adapter's alpha). Validates shapes vs rank (ValueError naming the
    module)."""
    out, targets = _peft_part(tensors, rank, module_prefix, family)
    return out, _config_targets(targets, rank, family)


def _config_targets(t: dict, rank: int, family: str = FAMILY_K3) -> dict:
    """The adapter_config.json entries of `_peft_part`'s targets (of one part, or of several merged)."""
    config: dict = {"target_modules": "(?:" + "|".join(t["linear"]) + ")" if t["linear"] else []}
    if family == FAMILY_SGLANG:  # SGLang: a list of leaf names (get_normalized_target_modules)
        config["target_modules"] = sorted(set(t["leaves"]))
    if t["params"]:
        config.update(
            target_parameters=t["params"],
            rank_pattern=t["rank_pattern"],
            alpha_pattern={k: r // rank for k, r in t["rank_pattern"].items()},  # x alpha: the same alpha / r
            block=t["block"],
        )
    return config


def _peft_part(
    tensors: dict[str, torch.Tensor], rank: int, module_prefix: str, family: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """`peft_tensors` of some of an adapter's modules (whole expert projections of a layer together): the PEFT
    tensors and what they target (linear regex parts, target parameters, rank pattern, block-diagonal
    gate_up prefixes), which merge across parts by concatenation."""
    family_name("", family)  # validates family
    if family == FAMILY_SGLANG and (bad := sglang_unsupported(_modules(tensors))):
        raise ValueError(f"SGLang cannot apply {sorted(bad)[:6]}: {next(iter(bad.values()))} (see sglang_tensors)")
    out: dict[str, torch.Tensor] = {}
    linear: list[str] = []  # target_modules regex parts
    params: list[str] = []  # target_parameters
    rank_pattern: dict[str, int] = {}
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    leaves: list[str] = []  # SGLang's target_modules
    for m in _modules(tensors):
        a, b = tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"]
        _check_shapes(m, a, b, rank)
        leaf = m.rsplit(".", 1)[-1]
        leaves.append(_SGLANG_LEAF.get(leaf, leaf) if _STACKED.match(m) else leaf)
        stacked = _STACKED.match(m)
        if stacked and family == FAMILY_KIMI_LINEAR:
            experts.setdefault(stacked["prefix"], {})[stacked["proj"]] = (a, b)
        elif stacked:
            for e in range(a.shape[0]):
                name = f"{module_prefix}{stacked['prefix']}.{e}.{stacked['proj']}"
                out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a[e].contiguous()
                out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b[e].contiguous()
            linear.append(re.escape(module_prefix + stacked["prefix"]) + r"\.\d+\." + stacked["proj"])
        else:
            name = module_prefix + family_name(m, family)
            out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous()
            out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.contiguous()
            linear.append(re.escape(name))
    block: list[str] = []
    for prefix, ws in experts.items():
        wrapped = []  # (parameter, A [E, r', in], B [E, out, r']) in KimiLinearExperts' parameter order
        if "w1" in ws or "w3" in ws:
            a, b, is_block = _gate_up(ws)
            wrapped.append(("gate_up_proj", a, b))
            if is_block:
                block.append(prefix)
        if "w2" in ws:
            wrapped.append(("down_proj", *ws["w2"]))
        module = module_prefix + family_name(prefix, family)
        for i, (param, a, b) in enumerate(wrapped):
            e, r = a.shape[0], a.shape[1]
            key = f"{_PEFT_PREFIX}{module}{'.base_layer' * (len(wrapped) - 1 - i)}"
            out[f"{key}.lora_A.weight"] = a.reshape(e * r, a.shape[2]).contiguous()
            out[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
            params.append(f"{module}.{param}")
            if r != rank:
                rank_pattern[re.escape(f"{module}.{param}")] = r
    return out, {"linear": linear, "params": params, "rank_pattern": rank_pattern, "block": block, "leaves": leaves}


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class _SafetensorsStream:
    """A safetensors file written tensor by tensor: the data goes to `<path>.data` as it comes, the header
    (whose offsets it must know) is written at `finish`, and the data copied in behind it in chunks, so no
    more than the tensors of one `add` call are ever in memory."""

    def __init__(self, path: Path):
        self.path, self.data = path, path.with_name(path.name + ".data")
        self.header: dict[str, dict] = {}
        self.offset = 0
        self._file = self.data.open("wb")

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.header:
            raise ValueError(f"adapter tensor {name!r} written twice")
        t = t.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self.header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self.offset, self.offset + len(raw)],
        }
        self._file.write(raw)
        self.offset += len(raw)

    def finish(self, metadata: dict[str, str]) -> None:
        self._file.close()
        head = json.dumps({"__metadata__": metadata, **self.header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
        with self.path.open("wb") as out, self.data.open("rb") as data:
            out.write(len(head).to_bytes(8, "little"))
            out.write(head)
            while chunk := data.read(64 << 20):
                out.write(chunk)
        self.data.unlink()


def save_peft(
    path: str | Path,
    tensors: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]],
    lora: LoraSpec,
    *,
    module_prefix: str = "",
    base_model_name_or_path: str | None = None,
    family: str | None = None,
    zero_partners: Iterable[str] = (),
) -> None:
    """Write `tensors` (engine naming, full tensors on any device) as a PEFT LoRA adapter directory in
    `family`'s naming (`k3` or `kimi_linear`, module docstring; None: `infer_family`). PEFT's
    `PeftModel.from_pretrained` on that family's model applies every module of it. `family="sglang"` writes
    what SGLang's loader applies (pass `sglang_tensors`' output, its zero partners as `zero_partners`: they are
    left out of the metadata's module list, so `load_peft` reads back the adapter's own modules).

    `tensors` may also be an iterable of parts (each whole modules, a layer's expert projections together:
    what `TrainerGroup.adapter_parts` yields), converted and written one at a time, so the whole adapter is
    never in memory at once; `family` must then be given.
    Atomic: a new directory appears whole; an existing one gets the weights, then the config, each by one
    rename (other files in it stay)."""
    if isinstance(tensors, dict):
        parts: Iterable[dict[str, torch.Tensor]] = [tensors]
        if not tensors:
            raise ValueError("save_peft: no adapter tensors to save")
        family = infer_family(tensors, module_prefix) if family is None else family
    elif family is None:
        raise ValueError("save_peft: an adapter in parts needs its family (adapter_family(config))")
    else:
        parts = tensors
    targets: dict = {"linear": [], "params": [], "rank_pattern": {}, "block": [], "leaves": []}
    modules: list[str] = []
    with staged_dir(Path(path), last=CONFIG_FILE) as tmp:  # config last: a reader that sees it sees its weights
        stream = _SafetensorsStream(tmp / WEIGHTS_FILE)
        for part in parts:
            modules += _modules(part)
            weights, t = _peft_part(part, lora.rank, module_prefix, family)
            for key in ("linear", "params", "block", "leaves"):
                targets[key] += t[key]
            targets["rank_pattern"].update(t["rank_pattern"])
            for name, w in weights.items():
                stream.add(name, w)
        if not modules:
            raise ValueError("save_peft: no adapter tensors to save")
        config_targets = _config_targets(targets, lora.rank, family)
        block = config_targets.pop("block", [])
        alpha_pattern = {k: lora.alpha * x for k, x in config_targets.pop("alpha_pattern", {}).items()}
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            # PEFT's ParamWrapper (stacked experts) refuses dropout; the true value is in the metadata
            "lora_dropout": 0.0 if config_targets.get("target_parameters") else lora.dropout,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": alpha_pattern,
            **config_targets,
        }
        meta = {
            "format": "pt",
            META_MODULES: json.dumps(sorted(set(modules) - set(zero_partners))),
            META_BLOCK: json.dumps(block),
            META_DROPOUT: repr(float(lora.dropout)),
        }
        stream.finish(meta)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _read_config(path: Path) -> dict:
    f = path / CONFIG_FILE
    if not f.is_file():
        raise ValueError(f"{path}: no {CONFIG_FILE}")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{f}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
    }
    for key, default in unsupported.items():
        if cfg.get(key) not in (None, default):
            raise ValueError(f"{f}: {key}={cfg[key]!r} is not supported (expected {default!r})")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise ValueError(f"{f}: missing {key!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pattern.values()
        ):
            raise ValueError(f"{f}: {key} must map module patterns to positive numbers, got {pattern!r}")
        for k in pattern:
            try:
                re.compile(k)
            except re.error as e:
                raise ValueError(f"{f}: {key} key {k!r} is not a regex: {e}") from None
    targets = cfg.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{f}: target_parameters must be a list of parameter names, got {targets!r}")
    return cfg


def _pattern(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of `name` at a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _targets_parameter(target_parameters: list[str], name: str) -> bool:
    """Whether PEFT's `target_parameters` select the parameter `name` (its whole name or a dotted suffix)."""
    return any(name == t or name.endswith("." + t) for t in target_parameters)


def _metadata(f: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(f), "pt") as fh:
        return fh.metadata() or {}


def _module_shapes(config: K3Config) -> dict[str, tuple[int, int]]:
    """Engine module -> (out, in) of its weight (stacked experts: of one expert)."""
    out: dict[str, tuple[int, int]] = {}
    shapes = tensor_shapes(config)
    for m in adaptable_modules(config):
        stacked = _STACKED.match(m)
        key = f"{stacked['prefix']}.0.{stacked['proj']}.weight" if stacked else f"{m}.weight"
        out[m] = tuple(shapes[key])
    return out


def load_peft(
    path: str | Path, *, module_prefix: str = "", config: K3Config | None = None
) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """Read a PEFT LoRA adapter directory in any format of the module docstring -> (tensors in engine naming,
    experts stacked [E, r, in] / [E, out, r]; LoraSpec whose targets select exactly those modules, anchored).
    With `config`, every module must be one of its adaptable modules with its shapes. ValueError, one line
    naming the file and the module, on a malformed config, a tensor no module takes, a module no K3-family
    model (or `config`) has, incomplete A / B pairs, or shapes that disagree with the ranks; nothing is
    returned partially."""
    path = Path(path)
    cfg = _read_config(path)
    try:
        lora = LoraSpec(
            rank=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0) or 0.0, targets=("^$",)
        )  # replaced below, once the modules are known
    except ValueError as e:
        raise ValueError(f"{path / CONFIG_FILE}: {e}") from None
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE}")
    try:
        raw = load_file(str(f))
        meta = _metadata(f)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: cannot read safetensors: {e}") from None
    if not raw:
        raise ValueError(f"{f}: holds no tensors")
    bad = next((k for k, t in sorted(raw.items()) if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:  # a diverged or corrupted adapter: refused at load, never served, generated or resumed
        raise ValueError(f"{f}: tensor {bad!r} holds non-finite values (NaN or inf)")
    try:
        tensors, rank, alpha = _read_modules(raw, meta, cfg, lora, module_prefix, config)
        dropout = float(meta[META_DROPOUT]) if META_DROPOUT in meta else lora.dropout
        spec = LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=("^$",))
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None
    targets = tuple("^" + re.escape(m) + "$" for m in _modules(tensors))
    return tensors, LoraSpec(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, targets=targets)


def _read_modules(
    raw: dict[str, torch.Tensor], meta: dict, cfg: dict, lora: LoraSpec, module_prefix: str, config: K3Config | None
) -> tuple[dict[str, torch.Tensor], int, float]:
    """The file's tensors -> (engine tensors at one common rank, that rank, its alpha) (`load_peft`)."""
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    target_parameters = cfg.get("target_parameters") or []
    head = _PEFT_PREFIX + module_prefix

    def ranked(name: str) -> tuple[int, float]:  # PEFT's (r, alpha) of the module or parameter `name`
        return _pattern(rank_pattern, module_prefix + name, lora.rank), _pattern(
            alpha_pattern, module_prefix + name, lora.alpha
        )

    groups: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        if key.startswith(head) and _EMBED_COPY.match(key[len(head) :]):
            # PEFT's copy of a targeted embedding / lm_head base weight (save_embedding_layers): not a delta;
            # a resized vocabulary would show in its shape
            name = key[len(head) : -len(".base_layer.weight")]
            base = tensor_shapes(config).get(f"{name}.weight") if config is not None else None
            if base is not None and tuple(t.shape) != tuple(base):
                raise ValueError(f"tensor {key!r}: shape {tuple(t.shape)}, the model's {name} is {list(base)}")
            continue
        m = _PEFT_KEY.match(key)
        if m is None or not key.startswith(head):
            raise ValueError(f"unexpected tensor {key!r} (expected {head}<module>.lora_A|lora_B.weight)")
        nested = _NESTED.match(m["module"][len(head) :])
        groups.setdefault((nested["module"], nested["nest"].count(".base_layer")), {})[m["ab"]] = t

    # every module: engine name -> (A, B, r, alpha, the file's module name)
    mods: dict[str, tuple[torch.Tensor, torch.Tensor, int, float, str]] = {}
    per_expert: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    block = set(json.loads(meta.get(META_BLOCK, "[]")))

    def add(name: str, a, b, r: int, al: float, where: str) -> None:
        if name in mods:
            raise ValueError(f"module {where!r}: {name!r} is given twice")
        mods[name] = (a, b, r, al, where)

    for (module, depth), ab in sorted(groups.items()):
        where = module_prefix + module + ".base_layer" * depth
        for part in ("lora_A", "lora_B"):
            if part not in ab:
                raise ValueError(f"module {where!r} has no {part}")
        a, b = ab["lora_A"], ab["lora_B"]
        wrapped = [p for p in _EXPERT_PARAMS if _targets_parameter(target_parameters, f"{module_prefix}{module}.{p}")]
        if wrapped and module.endswith(".experts"):
            if depth >= len(wrapped):
                raise ValueError(f"module {where!r}: no target_parameters entry places it ({target_parameters})")
            param = wrapped[len(wrapped) - 1 - depth]
            r, al = ranked(f"{module}.{param}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] % r or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"module {where!r} ({param}): lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
                    f"[E*r, in] / [out, r*E] with r={r}"
                )
            e = a.shape[0] // r
            a3 = a.reshape(e, r, a.shape[1])
            b3 = b.reshape(b.shape[0], r, e).permute(2, 0, 1)
            prefix = engine_name(module)
            if param == "down_proj":
                add(f"{prefix}.w2", a3, b3, r, al, where)
                continue
            if b3.shape[1] % 2:
                raise ValueError(f"module {where!r} (gate_up_proj): {b3.shape[1]} output rows do not split in two")
            i = b3.shape[1] // 2
            if prefix in block:  # ours, block-diagonal: w1 in the first half of the rank, w3 in the second
                h = r // 2
                add(f"{prefix}.w1", a3[:, :h], b3[:, :i, :h], h, al * h / r, where)
                add(f"{prefix}.w3", a3[:, h:], b3[:, i:, h:], h, al * h / r, where)
            else:  # one A per expert shared by gate and up
                add(f"{prefix}.w1", a3, b3[:, :i], r, al, where)
                add(f"{prefix}.w3", a3, b3[:, i:], r, al, where)
            continue
        if depth:
            raise ValueError(f"module {where!r}: no target_parameters entry places it ({target_parameters})")
        one = _PER_EXPERT.match(module)
        if one and a.dim() == 2:
            per_expert.setdefault((one["prefix"], one["proj"]), {})[int(one["e"])] = ab
            continue
        stacked = _STACKED.match(module)
        if stacked and a.dim() == 3 and b.dim() == 3:  # stacked / shared-outer: a leading 1 serves every expert
            e = max(a.shape[0], b.shape[0])
            if {a.shape[0], b.shape[0]} - {1, e}:
                raise ValueError(f"module {where!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree in E")
            r, al = ranked(module)
            add(engine_name(module), a.expand(e, -1, -1).clone(), b.expand(e, -1, -1).clone(), r, al, where)
            continue
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"module {where!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not 2-D")
        add(engine_name(module), a, b, *ranked(module), where)
    for (prefix, proj), by_e in sorted(per_expert.items()):
        where = f"{module_prefix}{prefix}.<e>.{proj}"
        if sorted(by_e) != list(range(len(by_e))):
            raise ValueError(f"module {where!r}: experts {sorted(by_e)[:8]} are not 0..{len(by_e) - 1}")
        for part in ("lora_A", "lora_B"):
            shapes = {tuple(ab[part].shape) for ab in by_e.values()}
            if len(shapes) != 1:
                raise ValueError(f"module {where!r}: {part} of the experts disagree in shape {sorted(shapes)}")
        stack = [torch.stack([by_e[e][part] for e in range(len(by_e))]) for part in ("lora_A", "lora_B")]
        add(engine_name(f"{prefix}.{proj}"), *stack, *ranked(f"{prefix}.0.{proj}"), where)

    if META_MODULES in meta:  # ours: a w1- or w3-only expert adapter comes back without its zero partner
        listed = set(json.loads(meta[META_MODULES]))
        if listed - set(mods):
            raise ValueError(f"modules {sorted(listed - set(mods))[:4]} named by its metadata hold no tensors")
        mods = {k: v for k, v in mods.items() if k in listed}
    shapes = _module_shapes(config) if config is not None else None
    for name, (a, b, r, _, where) in mods.items():
        if not is_adaptable_name(name):
            read = "" if name == where else f" (read as {name!r})"
            raise ValueError(f"module {where!r} is not a module of a K3 or Kimi-Linear model{read}")
        if shapes is not None and name not in shapes:
            raise ValueError(f"module {where!r} ({name!r}) is not an adaptable module of this model")
        lead = a.dim() - 2
        if a.shape[-2] != r or b.shape[-1] != r or a.shape[:lead] != b.shape[:lead]:
            raise ValueError(
                f"module {where!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
                f"{'[E, ' if lead else '['}r, in] / {'[E, ' if lead else '['}out, r] with r={r}"
            )
        if shapes is not None and (b.shape[-2], a.shape[-1]) != shapes[name]:
            raise ValueError(
                f"module {where!r}: its delta is [{b.shape[-2]}, {a.shape[-1]}], {name!r} is {list(shapes[name])}"
            )

    # one rank and scale for the engine: lower ranks zero-padded, a module's own scale folded into its B
    rank = max(r for _, _, r, _, _ in mods.values())
    scale = lora.alpha / lora.rank
    out: dict[str, torch.Tensor] = {}
    for name, (a, b, r, al, _) in mods.items():
        if al / r != scale:
            b = b * (al / r / scale)
        if r < rank:
            a = torch.cat([a, a.new_zeros(*a.shape[:-2], rank - r, a.shape[-1])], dim=-2)
            b = torch.cat([b, b.new_zeros(*b.shape[:-1], rank - r)], dim=-1)
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a.contiguous(), b.contiguous()
    return out, rank, lora.alpha if rank == lora.rank else scale * rank
