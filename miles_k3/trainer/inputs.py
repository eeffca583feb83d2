"""What a run reads before any model is built, each input checked so that a mistake is one ValueError
naming its field or file (`miles-train` prints it as one line and exits with status 2):

    cluster          a CUDA device per local worker; the ray package for launcher=ray
    model.path       config.json (-> K3Config), then every tensor of the checkpoint (read last: the slowest)
    lora.targets     select modules of this model (read off its tensor layout, no model built)
    model.tokenizer  loads, and its eos id lies inside the model's vocabulary
    data.chat_template  "hf": the tokenizer has a chat template (prompts are rendered by it); "k3": the
                     tokenizer has K3's structure tokens (prompts are rendered to ids by K3's encoding, the
                     checkpoint's own renderer when it has one) and its end-of-turn token lies in the vocabulary
    rollout.memory_mb  the engine's pool holds at least one KV page and one state slot of this model
    data.path, data.eval_path  every row (load_prompts); every prompt encodes to ids of the model's
                     vocabulary and fits the engine with rollout.max_new_tokens (Engine.submit's rules, applied
                     to the whole dataset now instead of to one batch mid-run); a row with images (data.images_key
                     or image content parts) needs a vision-language model.path with its preprocessor_config.json,
                     each image must decode whole (a truncated file fails here; its size gives its pad count),
                     and its expanded prompt must hold one pad run per image (`MediaPrompts`)
    reward.fn        imports and has a reward function's signature
    rollout.fn       imports and has a rollout function's signature (fn(client, record))
    trainer.resume   the checkpoint to continue from verifies and fits this run: trainer_state.pt loads and
                     holds step, sampler and one state per trainer rank; the adapter's tensors are finite and
                     shaped by the model and lora.rank, over the modules lora.targets select; the dataset its
                     sampler position points into

Only ValueError (and OSError for a file that cannot be read, FileNotFoundError for a dataset that is not
there) is turned into a message naming the input; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any, NamedTuple

import torch

from miles_k3.data import PromptRecord, PromptSampler, load_prompts
from miles_k3.data.hf_chat import TemplatedPrompts, hf_chat_renderer
from miles_k3.data.k3_chat import K3Chat, K3ChatPrompts
from miles_k3.data.tokenizers import Tokenizer
from miles_k3.model.base import TORCH_DTYPES
from miles_k3.model.config import K3Config
from miles_k3.model.lora_spec import adaptable_modules
from miles_k3.rewards import RewardPlugin, load_plugin
from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer.base import build_tokenizer, load_base_config
from miles_k3.trainer.resolve import ResolvedConfig, in_section
from miles_k3.trainer.rollout_plugin import load_rollout_fn


class Resume(NamedTuple):
    """A checkpoint to continue from: its directory, trainer_state.pt's contents and the adapter tensors."""

    path: Path
    state: dict[str, Any]
    adapter: dict[str, torch.Tensor]


class RunInputs(NamedTuple):
    config: K3Config  # the model's
    tokenizer: Tokenizer
    train: list[PromptRecord]
    heldout: list[PromptRecord] | None  # None: no evaluation
    plugin: RewardPlugin
    base_state: dict[str, torch.Tensor] | None  # the checkpoint's fp32 tensors (None: a preset, or not kept)
    resume: Resume | None
    media: MediaPrompts | None = None  # the image path; None: no record holds an image (a text-only run)


class _Sized(NamedTuple):
    """An image known by its size only: what the XTML expansion reads (`size`, `num_tokens`)."""

    size: tuple[int, int]
    num_tokens: int


class MediaPrompts:
    """The run's image path, built only when a dataset holds images (a text-only run imports none of it).

    A record's images are processed by the checkpoint's own preprocessor_config.json, its placeholders
    expanded to XTML blocks before tokenizing and the pad runs checked against the ids (`encode`); the
    frozen tower + projector of the checkpoint (`vision`, built on first use) computes a prompt's features in
    one forward, which every sample of the prompt shares, in the engine and in the trainer's row. Driver-side;
    one thread."""

    def __init__(self, model_path: str, tokenizer: Tokenizer, pad_id: int, dtype: torch.dtype, device: str):
        from miles_k3.data.image_processor import ImageProcessor

        self.path, self.tok, self.pad_id = model_path, tokenizer, pad_id
        self.processor = ImageProcessor.from_pretrained(model_path)
        self.dtype, self.device = dtype, device
        self._vision = None
        self.encoded_prompts = 0  # vision forwards run (one per prompt with images, per rollout of it)

    def vision(self):
        """The checkpoint's tower and projector, frozen (eval mode, no grad)."""
        if self._vision is None:
            from miles_k3.model.vision import K3VisionModel

            self._vision = K3VisionModel.from_pretrained(self.path, dtype=self.dtype, device=self.device).eval()
            self._vision.requires_grad_(False)
        return self._vision

    def ids(self, record: PromptRecord, images: list[Any]) -> list[int]:
        """The record's prompt ids, each placeholder expanded to its image's block (`images`: anything with
        `size` and `num_tokens`, in order); ValueError when the pad runs do not match the images."""
        from miles_k3.data.media import expand_media_prompt, media_pad_positions

        ids = self.tok.encode_prompt(expand_media_prompt(record.prompt, images))
        media_pad_positions(ids, images, self.pad_id)
        return ids

    def check(self, record: PromptRecord) -> list[int]:
        """`ids` from the images' sizes (the pad counts), each image decoded whole to check it reads."""
        return self.ids(
            record, [_Sized(size, self.processor.num_tokens(*size)) for size in map(_image_size, record.images)]
        )

    def encode(self, record: PromptRecord) -> tuple[list[int], list[Any], torch.Tensor]:
        """(prompt ids, one `rollout.media.ImageFeatures` per image, their rows concatenated [pads, D] on the
        CPU): the images processed and run through the tower and projector once."""
        from rollout.media import ImageFeatures

        processed = [self.processor.process(ref.load(), name=ref.name) for ref in record.images]
        ids = self.ids(record, processed)
        with torch.no_grad():
            feats = self.vision().encode(
                torch.cat([p.pixel_values for p in processed]), torch.tensor([p.grid_thw for p in processed])
            )
        self.encoded_prompts += 1
        feats = feats.cpu()
        rows = feats.split([p.num_tokens for p in processed])
        return ids, [ImageFeatures(f, p.content_hash) for f, p in zip(rows, processed)], feats


def _image_size(ref) -> tuple[int, int]:
    """An image's (W, H), its pixels decoded whole (a truncated or corrupt body fails here, when the data is
    checked, not mid-rollout); one-line ValueError naming it when it does not read as an image."""
    from PIL import Image

    src = ref.load()
    try:
        with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as im:
            im.load()
            return im.size
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # UnidentifiedImageError is an OSError
        raise ValueError(f"{ref.name}: not a readable image ({type(e).__name__}: {e})") from None


def media_prompts(
    rc: ResolvedConfig, config: K3Config, tok: Tokenizer, records: list[PromptRecord]
) -> MediaPrompts | None:
    """The run's `MediaPrompts` when some record holds images, else None; ValueError naming the record and
    what it needs when this run cannot take them."""
    first = next((r for r in records if r.images), None)
    if first is None:
        return None
    where = f"record {first.index} (0-based, {first.prompt[:40]!r}) has {len(first.images)} image(s)"
    if rc.model.path is None:
        raise ValueError(
            f"{where}: images need model.path (a vision-language checkpoint with its "
            f"preprocessor_config.json), not model.preset"
        )
    if config.vision_config is None or config.media_placeholder_token_id is None:
        raise ValueError(
            f"{where}, but model.path {rc.model.path} is a text-only checkpoint (its config.json "
            f"has no vision_config / media_placeholder_token_id)"
        )
    if rc.rollout.fn is not None:
        raise ValueError(f"{where}: image prompts through rollout.fn ({rc.rollout.fn}) are not built yet")
    if rc.data.chat_template == "k3":
        raise ValueError(f"{where}: image prompts with data.chat_template=k3 are not built yet")
    if rc.parallel.cp > 1:
        raise ValueError(
            f"{where}: image prompts with parallel.cp={rc.parallel.cp} are not built yet (the "
            f"features would need the zigzag split of the row)"
        )
    device = "cuda" if rc.cluster.device == "cuda" and torch.cuda.is_available() else "cpu"
    try:
        return MediaPrompts(
            rc.model.path, tok, config.media_placeholder_token_id, TORCH_DTYPES[rc.rollout.dtype], device
        )
    except ValueError as e:  # the processor settings: a missing or bad preprocessor_config.json, named
        raise ValueError(f"{where}; model.path: {e}") from None


def _named(field: str, fn, *errors: type[BaseException]):
    """fn(), with a ValueError (or one of `errors`) re-raised as ValueError("<field>: <message>")."""
    try:
        return fn()
    except (ValueError, *errors) as e:
        raise ValueError(f"{field}: {e}") from None


def _check_layout(rc: ResolvedConfig, config: K3Config) -> None:
    from megatron_patches.model import check_layout  # megatron: only once the cheaper checks passed
    from miles_k3.model.linear import TensorParallel

    par = rc.parallel
    check_layout(config, TensorParallel(par.tp), par.ep, par.pp, None if par.pp_layers is None else list(par.pp_layers))


def check_cluster(rc: ResolvedConfig) -> None:
    c = rc.cluster
    if c.launcher == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("cluster.launcher 'ray' needs the ray package (pip install 'ray[default]')")
    # Ray places its actors on the cluster's GPU nodes; the driver itself may have none
    if c.device == "cuda" and c.launcher == "external" and not torch.cuda.is_available():
        raise ValueError(
            f"cluster.device is 'cuda' but this rank's node has no CUDA device torch can see (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
        )
    if c.device == "cuda" and c.launcher == "local":
        if not torch.cuda.is_available():
            raise ValueError(
                f"cluster.device is 'cuda' but torch sees no CUDA device (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'})"
            )
        if torch.cuda.device_count() < c.num_workers:
            raise ValueError(
                f"cluster.num_workers ({c.num_workers}) needs one CUDA device each; this machine has "
                f"{torch.cuda.device_count()}"
            )


def _check_prompts(
    section: str,
    path: str,
    records: list[PromptRecord],
    tok: Tokenizer,
    rc: ResolvedConfig,
    config: K3Config,
    num_pages: int,
    media: MediaPrompts | None = None,
) -> None:
    new, page, limit = rc.sampling.max_new_tokens, rc.engine.page_size, rc.engine.max_seq_len
    for rec in records:
        where = f"{section}: {path} record {rec.index} (0-based, {rec.prompt[:40]!r})"
        if rec.images:  # media_prompts built `media` for this dataset
            ids = _named(where, lambda: media.check(rec))
        else:
            ids = _named(where, lambda: tok.encode_prompt(rec.prompt))
        if not ids:
            raise ValueError(f"{where}: encodes to no tokens")
        if max(ids) >= config.vocab_size or min(ids) < 0:
            raise ValueError(
                f"{where}: token id {max(ids)} lies outside the model's vocabulary "
                f"({config.vocab_size}); is model.tokenizer the model's?"
            )
        if len(ids) + new > limit:
            raise ValueError(
                f"{where}: {len(ids)} prompt tokens + rollout.max_new_tokens ({new}) exceed the "
                f"engine's max_seq_len ({limit})"
            )
        if -(-(len(ids) + new) // page) > num_pages:
            raise ValueError(
                f"{where}: needs {-(-(len(ids) + new) // page)} KV pages but rollout.memory_mb "
                f"({rc.rollout.memory_mb}) holds {num_pages}"
            )


def _adapted(rc: ResolvedConfig, config: K3Config) -> set[str]:
    return {m for m in adaptable_modules(config) if rc.lora.targets_module(m)}


def find_resume(rc: ResolvedConfig, run_dir: str | Path, config: K3Config, train: list[PromptRecord]) -> Resume | None:
    """The checkpoint trainer.resume names (auto: the newest good one of the run directory), read and checked
    against this run; None when there is none."""
    from miles_k3.model.peft import load_peft

    mode = rc.trainer.resume
    if mode == "never":
        return None
    path = ckpt.latest_good(Path(run_dir) / "checkpoints") if mode == "auto" else Path(mode)
    if path is None:
        return None
    if mode != "auto" and (problem := ckpt.verify_checkpoint(path)) is not None:
        raise ValueError(f"trainer.resume: checkpoint {path} is damaged: {problem}")
    where = f"trainer.resume: checkpoint {path}"
    state = _read_state(path, where)
    adapter, spec = _named(where, lambda: load_peft(path / ckpt.ADAPTER_DIR))
    if len(state["workers"]) != rc.cluster.num_workers:
        raise ValueError(
            f"{where} holds {len(state['workers'])} trainer ranks; cluster.num_workers is {rc.cluster.num_workers}"
        )
    if (spec.rank, spec.alpha) != (rc.lora.rank, rc.lora.alpha):
        raise ValueError(
            f"{where} holds a rank-{spec.rank} adapter (alpha {spec.alpha}); this run has "
            f"lora.rank={rc.lora.rank}, lora.alpha={rc.lora.alpha}"
        )
    saved = {k.rsplit(".", 1)[0] for k in adapter}
    if saved != _adapted(rc, config):
        raise ValueError(
            f"{where}: its adapter covers {len(saved)} modules, lora.targets select "
            f"{len(_adapted(rc, config))} (e.g. {sorted(saved ^ _adapted(rc, config))[:2]})"
        )
    _check_adapter_shapes(adapter, rc, config, where)
    sampler = PromptSampler(train, shuffle=rc.data.shuffle, seed=rc.data.seed, drop_last=rc.data.drop_last)
    _named(where, lambda: sampler.load_state_dict(state["sampler"]), KeyError, TypeError)
    for i, worker in enumerate(state["workers"]):
        missing = [k for k in WORKER_STATE_KEYS if k not in worker]
        if missing:
            raise ValueError(f"{where}: {ckpt.STATE_FILE} workers[{i}] lacks {missing} (not a trainer rank's state)")
    return Resume(path, state, adapter)


# what one trainer rank's state holds (`TrainWorker.state_dict`), and trainer_state.pt's own keys
WORKER_STATE_KEYS = ("optimizer", "scheduler", "rng", "lora_dropout_rng")
STATE_KEYS = {"step": int, "sampler": dict, "workers": list}


def _read_state(path: Path, where: str) -> dict[str, Any]:
    """trainer_state.pt of checkpoint `path`, loaded and its layout checked (ValueError naming `where` and
    the key): a dict with an integer `step` >= 0, a `sampler` dict and a `workers` list of dicts."""
    try:
        state = torch.load(path / ckpt.STATE_FILE, weights_only=False, map_location="cpu")
    except Exception as e:  # any garbage: pickle, zip and torch's own errors alike
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{where}: {ckpt.STATE_FILE} does not load ({type(e).__name__}: {reason})"[:400]) from None
    if not isinstance(state, dict):
        raise ValueError(f"{where}: {ckpt.STATE_FILE} holds a {type(state).__name__}, not a trainer state dict")
    for key, kind in STATE_KEYS.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            got = "nothing" if key not in state else type(state[key]).__name__
            raise ValueError(f"{where}: {ckpt.STATE_FILE} key {key!r} must be a {kind.__name__}, holds {got}")
    if state["step"] < 0:
        raise ValueError(f"{where}: {ckpt.STATE_FILE} step must be >= 0, got {state['step']}")
    bad = next((i for i, w in enumerate(state["workers"]) if not isinstance(w, dict)), None)
    if bad is not None:
        raise ValueError(f"{where}: {ckpt.STATE_FILE} workers[{bad}] is not a trainer rank's state dict")
    return state


def _check_adapter_shapes(adapter: dict[str, torch.Tensor], rc: ResolvedConfig, config: K3Config, where: str) -> None:
    """Each adapter tensor's shape against this model's layout and lora.rank (lora_A [..., rank, in],
    lora_B [..., out, rank], routed experts stacked over num_experts), and its values finite."""
    from miles_k3.model.layout import tensor_shapes

    shapes, rank = tensor_shapes(config), rc.lora.rank
    for key, t in adapter.items():
        module, ab = key.rsplit(".", 1)
        if ".experts.w" in module:
            prefix, proj = module.rsplit(".", 1)
            out, inp = shapes.get(f"{prefix}.0.{proj}.weight", (None, None))
            lead = (config.num_experts,)
        else:
            out, inp = shapes.get(f"{module}.weight", (None, None))
            lead = ()
        if out is None:
            continue  # a module this model lacks: the module check above names it
        want = (*lead, rank, inp) if ab == "lora_A" else (*lead, out, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: adapter tensor {key} has shape {tuple(t.shape)}, this model needs {want}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{where}: adapter tensor {key} holds non-finite values (NaN or inf)")


def load_run_inputs(rc: ResolvedConfig, run_dir: str | Path, *, weights: str | None = None) -> RunInputs:
    """Read and check every input of the run (module docstring), cheapest first. `weights`: "keep" returns
    the checkpoint's tensors (an in-process run uses them), "check" reads them to check them and drops them
    (the workers read their own), "skip" does not read them (the caller checked them already); None: "keep"
    for the local launcher's single worker, else "check"."""
    if weights is None:
        weights = "keep" if rc.cluster.launcher == "local" and rc.cluster.num_workers == 1 else "check"
    from miles_k3.model.checkpoint import load_state_dict
    from rollout.memory import PoolSizes

    check_cluster(rc)
    source = "model.path" if rc.model.path is not None else "model.preset"
    config = _named(source, lambda: load_base_config(rc.model), OSError)
    in_section("lora", lambda: rc.lora.check_matches(adaptable_modules(config)), type(rc.lora))
    _named("parallel", lambda: _check_layout(rc, config))
    tok = _named("model.tokenizer", lambda: build_tokenizer(rc.model, config))
    apply_chat = None
    if rc.data.chat_template == "hf":  # resolve checked model.tokenizer=hf
        apply_chat = in_section("data", lambda: hf_chat_renderer(tok.hf, rc.model.path))
        tok = TemplatedPrompts(tok)
    elif rc.data.chat_template == "k3":  # resolve checked model.tokenizer=hf
        chat = _named("data.chat_template 'k3'", lambda: K3Chat(tok.hf, rc.model.path))
        if chat.end_of_turn_id >= config.vocab_size:
            raise ValueError(
                f"data.chat_template 'k3': the end-of-turn id {chat.end_of_turn_id} is outside the model's "
                f"vocabulary ({config.vocab_size})"
            )
        tok = K3ChatPrompts(tok, chat, rc.data.thinking)
        apply_chat = tok.render
    sizes = _named(
        f"rollout.memory_mb ({rc.rollout.memory_mb} MiB)",
        lambda: PoolSizes.from_budget(
            config,
            rc.engine.memory_bytes,
            page_size=rc.engine.page_size,
            state_fraction=rc.engine.state_fraction,
            dtype=TORCH_DTYPES[rc.rollout.dtype],
        ),
    )

    loaded = []
    media = None
    for section, data in (("data.path", rc.data), ("data.eval_path", rc.eval_data)):
        records = (
            None
            if data is None
            else _named(section, lambda: load_prompts(data, apply_chat), FileNotFoundError, ImportError)
        )
        if records is not None:
            if media is None:
                media = _named(f"{section}: {data.path}", lambda: media_prompts(rc, config, tok, records))
            _check_prompts(section, data.path, records, tok, rc, config, sizes.num_pages, media)
        loaded.append(records)
    train, heldout = loaded
    if media is not None and weights != "skip":  # the tower and projector read and checked now, by tensor name
        _named("model.path", media.vision, OSError)
    if rc.data.drop_last and len(train) < rc.rollout.prompts_per_step:
        raise ValueError(
            f"data.drop_last: the dataset's {len(train)} prompts cannot fill one step of "
            f"rollout.prompts_per_step ({rc.rollout.prompts_per_step}) without wrapping around"
        )
    plugin = _named("reward.fn", lambda: load_plugin(rc.reward))
    if rc.rollout.fn is not None:  # loaded again where the engine runs; here to fail before any model is built
        _named("rollout.fn", lambda: load_rollout_fn(rc.rollout.fn))
    resume = find_resume(rc, run_dir, config, train)

    state = None
    if rc.model.path is not None and weights != "skip":
        # the loader raises ValueError naming the file or tensor (a corrupt or truncated safetensors file too)
        state = _named("model.path", lambda: load_state_dict(rc.model.path, config, torch.float32), OSError)
    return RunInputs(
        config,
        tok,
        train,
        None if heldout is None else heldout[: rc.eval_max_prompts],
        plugin,
        state if weights == "keep" else None,
        resume,
        media,
    )
