"""`miles-k3 generate`: offline batch generation through the rollout engine, for scripts and tests.

    miles-k3 generate --model builtin:k3-tiny-arith --prompts prompts.jsonl --json out.json
    miles-k3 generate --model /ckpt --input-ids ids.jsonl --max-new-tokens 256 --temperature 0.7 --seed 1 \
        --adapter runs/grpo/adapter --device cuda --tp 2 --json out.json
    miles-k3 generate --model /vl-ckpt --prompts q.jsonl --image chart.png --temperature 0   # an image prompt

Input, one JSON object per line: `{"input_ids": [...]}` (`--input-ids`), or with `--prompts` either
`{"prompt": "text"}` or `{"messages": [{"role": ..., "content": ...}, ...]}` (the tokenizer's chat
template). Output (`--json`, or stdout): `{"outputs": [{"output_ids", "logprobs", "finish_reason"}, ...]}`
in input order (`text` too with `--prompts`). Log-probs are the engine's: the sampled token's under the
untruncated distribution at the temperature.

Sampling is reproducible: row i draws from its own generator seeded `--seed + i`, so its output does not
depend on the batch, the schedule or the tensor-parallel size. With `--prompts` a row stops at the
tokenizer's end-of-sequence token; `--stop-token-id` adds others (with `--input-ids` they are the only
stops). `--tp N` starts N worker processes, one engine rank each (`rollout.parallel`: attention heads
split, routed experts split by intermediate dim or with `--ep` whole per rank, `--dcp M` MLA's KV sharded
by position over groups of M ranks), and rank 0 writes the output. Bad input (a flag, a row of a file, the checkpoint) stops it before any generation with one
line naming it, exit status 2. `--speculative dspark --drafter DIR` drafts `--gamma` tokens a step with a
DSpark drafter (scripts/train_drafter.py) and verifies them in one target forward: the same tokens and
log-probs as without it (lossless; `rollout.spec`).

Images (`--image PATH`, repeatable, with `--prompts` and a vision-language checkpoint): every row sees the
images in order, one `<|kimi_image_placeholder|>` each in its prompt text (or in its messages' string
contents, in order). Each image is resized by the checkpoint's own `preprocessor_config.json`, its
placeholder expanded to Kimi's XTML block (`miles_k3.data.media`), and its features computed once by the
checkpoint's tower and projector, for every row; the engine splices them in at the pads and keys its
prefix cache on the image's content (`rollout.media`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ADAPTER = "adapter"  # the name the rows' adapter is loaded under


@dataclass(frozen=True)
class GenerateArgs:
    """The command's flags, checked by `check` (ValueError "--flag ..." before any model is read)."""

    model: str  # a checkpoint directory or builtin:<name>
    images: tuple[Path, ...]  # --image: the images every --prompts row sees, in placeholder order
    input_ids: Path | None  # JSONL of {"input_ids": [...]}
    prompts: Path | None  # JSONL of {"prompt": str} or {"messages": [...]}
    out: Path | None  # --json: where the outputs go; None: stdout
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: tuple[int, ...]
    adapter: Path | None  # a PEFT adapter directory (as the trainer saves it) the rows run with
    tokenizer: str | None
    tp: int
    dcp: int
    ep: bool  # with --tp: whole routed experts, num_experts / tp per rank (else split by intermediate dim)
    speculative: str  # the server's flags (rollout.server.config.ServeConfig checks them and builds the SpecConfig)
    drafter: str | None
    gamma: int | None
    spec_planner: str | None
    spec_max_batch: int | None
    device: str
    dtype: str | None
    quantize: str
    memory_mb: float
    max_running: int | None
    max_seq_len: int | None

    def check(self) -> None:
        if (self.input_ids is None) == (self.prompts is None):
            raise ValueError("give exactly one of --input-ids FILE.jsonl and --prompts FILE.jsonl")
        if self.images and self.prompts is None:
            raise ValueError("--image needs --prompts: the images' placeholders are expanded in the prompt text")
        for path in self.images:
            if not path.is_file():
                raise ValueError(f"--image {path}: no such file")
        for flag, path in (("--input-ids", self.input_ids), ("--prompts", self.prompts)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag} {path}: no such file")
        for flag, value in (("--tp", self.tp), ("--dcp", self.dcp)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.ep and self.tp == 1:
            raise ValueError("--ep needs --tp > 1: expert parallelism runs over the tensor-parallel ranks")
        if self.tp % self.dcp:
            raise ValueError(f"--dcp {self.dcp} must divide --tp {self.tp}: decode context parallelism runs inside "
                             f"the tensor-parallel group")
        self.sampling(0, self.stop_token_ids)  # SamplingParams' own checks, before anything is loaded
        self.serve_config().check()  # model, adapter, tokenizer, device, dtype, memory and speculation flags

    def serve_config(self):
        """The engine settings as the server's config (same flags, same checks, same loading)."""
        from rollout.server.config import ServeConfig

        adapters = () if self.adapter is None else ((ADAPTER, str(self.adapter)),)
        return ServeConfig(model=self.model, adapters=adapters,
                           tokenizer=self.tokenizer, device=self.device, dtype=self.dtype, quantize=self.quantize,
                           memory_mb=self.memory_mb, max_running=self.max_running, max_seq_len=self.max_seq_len,
                           speculative=self.speculative, drafter=self.drafter, gamma=self.gamma,
                           spec_planner=self.spec_planner, spec_max_batch=self.spec_max_batch)

    def sampling(self, row: int, stops: tuple[int, ...]):
        from rollout.request import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, stop_token_ids=stops, seed=self.seed + row)


def read_rows(path: Path, flag: str, encode) -> list[list[int]]:
    """Each line's token ids. `encode(row) -> ids` for --prompts rows; None: rows carry input_ids."""
    from miles_k3.data.prompts import read_jsonl_rows

    rows = []
    try:
        for where, row in read_jsonl_rows(path):
            if encode is None:
                ids = row.get("input_ids")
                if not isinstance(ids, list) or not ids or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"{where}: input_ids must be a non-empty list of integers")
            else:
                try:
                    ids = encode(row)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            rows.append(ids)
    except ValueError as e:
        raise ValueError(f"{flag} {e}") from None
    if not rows:
        raise ValueError(f"{flag} {path}: no rows")
    return rows


def prompt_encoder(tokenizer, images: list | None = None, pad_token_id: int | None = None):
    """`encode(row) -> ids`. With `images` (ProcessedImages) the row's placeholders are expanded first, and
    the ids must hold one pad run of each image's length (a tokenizer that splits the pad fails here)."""
    from miles_k3.data.media import IMAGE_PLACEHOLDER, expand_media_prompt, media_pad_positions

    def expand(text: str, at: int) -> tuple[str, int]:
        n = text.count(IMAGE_PLACEHOLDER)
        return expand_media_prompt(text, images[at:at + n]), at + n

    def encode(row: dict) -> list[int]:
        if isinstance(row.get("prompt"), str):
            text = expand_media_prompt(row["prompt"], images) if images else row["prompt"]
            ids = tokenizer.encode(text)
        elif isinstance(row.get("messages"), list):
            messages, at = row["messages"], 0
            if images:
                messages = [dict(m) for m in messages]
                for m in messages:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        m["content"], at = expand(m["content"], at)
                if at != len(images):
                    raise ValueError(f"the messages hold {at} image placeholder(s) {IMAGE_PLACEHOLDER} but "
                                     f"{len(images)} image(s) were given (--image)")
            ids = tokenizer.encode_chat(messages)
        else:
            raise ValueError('expected {"prompt": "text"} or {"messages": [...]}')
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        if images:
            media_pad_positions(ids, images, pad_token_id)
        return ids
    return encode


def encode_images(paths: tuple[Path, ...], model_path: str, dtype: str, device: str) -> tuple[list, list]:
    """The --image files processed by the checkpoint's image settings, and their features from its tower
    and projector (one forward, each image once): (ProcessedImages, `rollout.media.ImageFeatures` on the
    CPU). ValueError naming the file or the checkpoint part that is missing."""
    import torch

    from miles_k3.data.image_processor import ImageProcessor
    from miles_k3.model.vision import K3VisionModel
    from megatron_patches.parallel import end_world
    from miles_k3.trainer.base import TORCH_DTYPES
    from rollout.media import ImageFeatures

    processor = ImageProcessor.from_pretrained(model_path)
    processed = [processor.process(path, name=f"--image {path}") for path in paths]
    vision = K3VisionModel.from_pretrained(model_path, dtype=TORCH_DTYPES[dtype], device=device).eval()
    with torch.no_grad():
        feats = vision.encode(torch.cat([p.pixel_values for p in processed]),
                              torch.tensor([p.grid_thw for p in processed]))
    rows = feats.float().cpu().split([p.num_tokens for p in processed])  # the CPU: they travel to --tp workers
    return processed, [ImageFeatures(f.clone(), p.content_hash) for f, p in zip(rows, processed)]


def check_ids(rows: list[list[int]], vocab_size: int, max_seq_len: int, max_new_tokens: int, source: str) -> None:
    for i, ids in enumerate(rows):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{source} row {i + 1}: token id {bad} is outside the model's vocabulary ({vocab_size})")
        if len(ids) + max_new_tokens > max_seq_len:
            raise ValueError(f"{source} row {i + 1}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} "
                             f"exceed the engine's max sequence length {max_seq_len} (--max-seq-len)")


def generate_outputs(engine, rows: list[list[int]], args: GenerateArgs, stops: tuple[int, ...],
                     adapter: str | None, tokenizer=None, images: list | None = None) -> list[dict]:
    """Run every row to completion on `engine` (each row with `images`, ImageFeatures, when given); one
    output dict per row, in row order."""
    completions = engine.generate(rows, [args.sampling(i, stops) for i in range(len(rows))], adapter,
                                  images=[images] * len(rows) if images else None)
    outputs = []
    for c in completions:
        out = {"output_ids": c.output_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason.value}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(c.output_ids)
        outputs.append(out)
    return outputs


def run(args: GenerateArgs) -> list[dict]:
    """Load, check every row, generate (tensor-parallel workers for --tp > 1). ValueError on bad input."""
    from miles_k3.trainer.base import load_base_config
    from miles_k3.trainer.config import ModelCfg
    from rollout.config import EngineConfig
    from rollout.server.tokenization import build_server_tokenizer

    args.check()
    cfg = args.serve_config()
    model = ModelCfg(path=str(cfg.model_path), tokenizer=cfg.tokenizer_kind)
    config = load_base_config(model)
    processed, images = [], None
    if args.images:
        if config.vision_config is None or config.media_placeholder_token_id is None:
            raise ValueError(f"--image: {cfg.model_path} is not a vision-language checkpoint (its config.json has "
                             "no vision_config / media_placeholder_token_id)")
        processed, images = encode_images(args.images, str(cfg.model_path), cfg.resolved_dtype, args.device)
    tokenizer = None
    if args.prompts is not None:
        tokenizer = build_server_tokenizer(cfg.tokenizer_kind, str(cfg.model_path))
        encode = prompt_encoder(tokenizer, processed, config.media_placeholder_token_id)
        rows = read_rows(args.prompts, "--prompts", encode)
    else:
        rows = read_rows(args.input_ids, "--input-ids", None)
    stops = tuple(args.stop_token_ids) + ((tokenizer.eos_token_id,) if tokenizer is not None else ())
    check_ids(rows, config.vocab_size, cfg.max_seq_len or EngineConfig.max_seq_len, args.max_new_tokens,
              "--prompts" if args.prompts is not None else "--input-ids")
    if args.tp == 1:
        from rollout.server.loading import build_engine

        engine, _ = build_engine(model, cfg, seed=args.seed)
        return generate_outputs(engine, rows, args, stops, None if args.adapter is None else ADAPTER, tokenizer,
                                images)
    outputs = run_workers(args, rows, stops, images)
    if tokenizer is not None:
        for out in outputs:
            out["text"] = tokenizer.decode(out["output_ids"])
    return outputs


def run_workers(args: GenerateArgs, rows: list[list[int]], stops: tuple[int, ...], images: list | None = None
                ) -> list[dict]:
    """--tp N: N worker processes, one engine rank each (gloo on CPU, nccl with a GPU per rank); rank 0
    generates and hands the outputs back through a file. A worker's ValueError comes back as this one."""
    import tempfile

    import torch.multiprocessing as mp

    from megatron_patches.parallel import free_port

    with tempfile.TemporaryDirectory(prefix="miles-k3-generate-") as tmp:
        result = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(args.tp, free_port(), args, rows, stops, str(result), images), nprocs=args.tp,
                 join=True)
        answer = json.loads(result.read_text())
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer["outputs"]


def _worker(rank: int, world: int, port: int, args: GenerateArgs, rows: list[list[int]], stops: tuple[int, ...],
            result: str, images: list | None = None) -> None:
    import os

    import torch
    import torch.distributed as dist

    from megatron_patches.parallel import end_world
    from miles_k3.trainer.base import TORCH_DTYPES
    from rollout.config import EngineConfig
    from rollout.parallel import build_sharded_engine
    from rollout.server.loading import read_adapters

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        cfg = args.serve_config()
        spec, tensors, alphas = read_adapters(cfg.adapters)
        engine_config = EngineConfig(memory_bytes=int(cfg.memory_mb * (1 << 20)), dcp_size=args.dcp,
                                     **cfg.engine_overrides())
        engine = build_sharded_engine(cfg.model_path, engine_config, ep=args.ep, quantize=cfg.quantize, lora=spec,
                                      max_adapters=1, dtype=TORCH_DTYPES[cfg.resolved_dtype], device=device)
        if not engine.is_leader:
            engine.follow()
            return
        try:
            for name, t in tensors.items():  # rank 0's calls reach every rank (the leader's log)
                engine.add_adapter(ADAPTER, t, alpha=alphas[name])
            answer = {"outputs": generate_outputs(engine, rows, args, stops, ADAPTER if tensors else None,
                                                  images=images)}
        except ValueError as e:
            answer = {"error": str(e)}
        finally:
            engine.stop_followers()
        Path(result).write_text(json.dumps(answer))
    finally:
        end_world()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a checkpoint directory or builtin:<name>")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-ids", type=Path, help='JSONL rows {"input_ids": [...]}')
    src.add_argument("--prompts", type=Path, help='JSONL rows {"prompt": "text"} or {"messages": [...]}')
    p.add_argument("--image", dest="images", type=Path, action="append", default=[],
                   help="an image every --prompts row sees, at its <|kimi_image_placeholder|> (repeatable, in order)")
    p.add_argument("--json", dest="out", type=Path, help="write the outputs here (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=0, help="row i samples from a generator seeded seed + i")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[],
                   help="also stop after this token (repeatable)")
    p.add_argument("--adapter", type=Path, help="a PEFT LoRA adapter directory (as the trainer saves it)")
    p.add_argument("--tokenizer", help="arithmetic | hf (default: arithmetic for builtin:, hf for a directory)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel engine ranks (worker processes)")
    p.add_argument("--dcp", type=int, default=1, help="decode context-parallel ranks inside the TP group")
    p.add_argument("--ep", action="store_true", help="with --tp: whole routed experts, num_experts / tp per rank")
    from rollout.server.config import ServeConfig

    # the server's flags, help and defaults
    for name in ("speculative", "drafter", "gamma", "spec_planner", "spec_max_batch"):
        f = ServeConfig.__dataclass_fields__[name]
        p.add_argument("--" + name.replace("_", "-"), type=f.metadata.get("type", str), default=f.default,
                       help=f.metadata["help"])
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", help="float32 | bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--quantize", default="experts", help="none | experts | all (MXFP4 base weights)")
    p.add_argument("--memory-mb", type=float, default=256.0, help="KV pages + KDA state slots per rank, MiB")
    p.add_argument("--max-running", type=int, help="rows decoding at once (default: the engine's)")
    p.add_argument("--max-seq-len", type=int, help="prompt + generated tokens of a row (default: the engine's)")


def cmd_generate(ns: argparse.Namespace) -> int:
    fields = GenerateArgs.__dataclass_fields__
    args = GenerateArgs(**{k: getattr(ns, k) for k in fields if k not in ("stop_token_ids", "images")},
                        stop_token_ids=tuple(ns.stop_token_ids), images=tuple(ns.images))
    outputs = run(args)
    text = json.dumps({"outputs": outputs})
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)  # atomic: a reader never sees half a file
        print(f"miles-k3 generate: {len(outputs)} outputs -> {args.out}", file=sys.stderr)
    return 0
