"""PEFT-format adapter files: adapter_config.json + adapter_model.safetensors, HF K3 module names.

File layout (what `peft.PeftModel.from_pretrained` reads for a LoRA adapter):
    base_model.model.<module>.lora_A.weight   [r, in]
    base_model.model.<module>.lora_B.weight   [out, r]
with `<module>` the HF module path (`module_prefix` + the name without wrapper prefix; K3's VL
checkpoint wants module_prefix="language_model."). Routed experts, stacked in engine naming
(`<prefix>.experts.w1.lora_A` [E, r, in]), are written per expert as `<prefix>.experts.<e>.w1.lora_A.weight`.

adapter_config.json holds PEFT's LoRA fields: r, lora_alpha, lora_dropout, and `target_modules` as a regex
that PEFT full-matches against module names: the alternation of exactly the adapted modules (expert
index generalized to `\\d+`). `load_peft` returns a LoraSpec whose targets select exactly those modules
(anchored names), not the regexes the adapter was trained with; rank, alpha and dropout round-trip.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from miles_k3.model.checkpoint import staged_dir
from miles_k3.model.lora_spec import LoraSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>w[123])$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>w[123])$")
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_[AB])\.weight$")


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


def peft_tensors(tensors: dict[str, torch.Tensor], rank: int, module_prefix: str = "") -> dict[str, torch.Tensor]:
    """Engine-named adapter tensors -> PEFT state-dict keys (experts unstacked). Validates shapes vs rank."""
    out = {}
    for m in _modules(tensors):
        a, b = tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"]
        stacked = _STACKED.match(m)
        lead = 1 if stacked else 0
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
        if stacked:
            for e in range(a.shape[0]):
                name = f"{module_prefix}{stacked['prefix']}.{e}.{stacked['proj']}"
                out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a[e].contiguous()
                out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b[e].contiguous()
        else:
            out[f"{_PEFT_PREFIX}{module_prefix}{m}.lora_A.weight"] = a.contiguous()
            out[f"{_PEFT_PREFIX}{module_prefix}{m}.lora_B.weight"] = b.contiguous()
    return out


def _target_regex(modules: list[str], module_prefix: str) -> str:
    parts = []
    for m in modules:
        stacked = _STACKED.match(m)
        if stacked:
            parts.append(re.escape(module_prefix + stacked["prefix"]) + r"\.\d+\." + stacked["proj"])
        else:
            parts.append(re.escape(module_prefix + m))
    return "(?:" + "|".join(parts) + ")"


def save_peft(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    lora: LoraSpec,
    *,
    module_prefix: str = "",
    base_model_name_or_path: str | None = None,
) -> None:
    """Write `tensors` (engine naming, full tensors on any device) as a PEFT LoRA adapter directory.
    Atomic: a new directory appears whole; an existing one gets the weights, then the config, each by one
    rename (other files in it stay)."""
    if not tensors:
        raise ValueError("save_peft: no adapter tensors to save")
    modules = _modules(tensors)
    weights = {k: v.detach().cpu() for k, v in peft_tensors(tensors, lora.rank, module_prefix).items()}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": _target_regex(modules, module_prefix),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    with staged_dir(Path(path), last=CONFIG_FILE) as tmp:  # config last: a reader that sees it sees its weights
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
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
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
    }
    for key, default in unsupported.items():
        if cfg.get(key) not in (None, default):
            raise ValueError(f"{f}: {key}={cfg[key]!r} is not supported (expected {default!r})")
    for key in ("r", "lora_alpha"):
        if key not in cfg:
            raise ValueError(f"{f}: missing {key!r}")
    return cfg


def load_peft(path: str | Path, *, module_prefix: str = "") -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """Read a PEFT LoRA adapter directory -> (tensors in engine naming, experts stacked; LoraSpec).
    ValueError on a malformed config, unknown or incomplete keys, shapes that disagree with `r`, or a
    key outside `module_prefix`."""
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
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: cannot read safetensors: {e}") from None
    if not raw:
        raise ValueError(f"{f}: holds no tensors")

    plain: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _PEFT_KEY.match(key)
        if m is None or not key.startswith(_PEFT_PREFIX + module_prefix):
            raise ValueError(
                f"{f}: unexpected tensor {key!r} (expected {_PEFT_PREFIX}{module_prefix}<module>.lora_A|lora_B.weight)"
            )
        module = m["module"][len(_PEFT_PREFIX + module_prefix) :]
        if t.dim() != 2:
            raise ValueError(f"{f}: tensor {key!r} has shape {tuple(t.shape)}, expected 2 dims")
        per_expert = _PER_EXPERT.match(module)
        if per_expert:
            experts.setdefault((per_expert["prefix"], per_expert["proj"], m["ab"]), {})[int(per_expert["e"])] = t
        else:
            plain[f"{module}.{m['ab']}"] = t
    for (prefix, proj, ab), by_e in sorted(experts.items()):
        if sorted(by_e) != list(range(len(by_e))):
            raise ValueError(f"{f}: {prefix}.<e>.{proj}.{ab}: experts {sorted(by_e)[:8]} are not 0..{len(by_e) - 1}")
        shapes = {tuple(t.shape) for t in by_e.values()}
        if len(shapes) != 1:
            raise ValueError(f"{f}: {prefix}.<e>.{proj}.{ab}: experts disagree in shape {sorted(shapes)}")
        plain[f"{prefix}.{proj}.{ab}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    try:
        modules = _modules(plain)
        peft_tensors(plain, lora.rank)  # shape checks against r
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None
    targets = tuple("^" + re.escape(m) + "$" for m in modules)
    return plain, LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=targets)
