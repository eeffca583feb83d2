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
by position over groups of M ranks), and rank 0 writes the output. `--speculative dspark --drafter DIR`
drafts `--gamma` tokens a step with a DSpark drafter (scripts/train_drafter.py) and verifies them in one
target forward: the same tokens and log-probs as without it (lossless; `rollout.spec`).

Bad input (a flag, a row of a file, the checkpoint, the adapter, a layout the model's heads do not divide)
stops it before any generation and before any worker is spawned, with one line naming it, exit status 2
(`miles_k3.errors`). What only the --tp workers meet (the checkpoint's weights, which each rank reads its
slices of) stops them all and comes back as the same one line, naming the rank (`spawn_ranks`). A row's
chat messages are checked by the validator the server and the trainer share (`miles_k3.data.messages`).
`--json` never overwrites an input: a path that is an input file or a directory is refused, its directory
must be writable before anything is generated, and the file is written through a temporary file in the same
directory, renamed over it once complete (removed if the write fails).

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
from dataclasses import dataclass, field
from pathlib import Path

from miles_k3.errors import check_output_path, write_atomically
from miles_k3.ranks import spawn_ranks
from rollout.server.config import ENGINE_FLAGS, EngineFlags, add_flags, check_adapters, flag_errors

ADAPTER = "adapter"  # the name the rows' adapter is loaded under
MAX_SEED = 2**63  # row i samples with --seed + i: a torch generator's seed (int64) must hold every row's


@dataclass(frozen=True, kw_only=True)
class GenerateArgs(EngineFlags):
    """The command's flags: the engine's (`EngineFlags`, shared with miles-serve: the same names, help, checks
    and messages) and its own below, checked by `check` (ValueError "--flag ..." before any model is read)."""

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
    # a batch holds its rows' KV at once: more memory than a server's default
    memory_mb: float = field(default=256.0, metadata=EngineFlags.__dataclass_fields__["memory_mb"].metadata)

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """--adapter as the engine loads it: under the name `ADAPTER`."""
        return () if self.adapter is None else ((ADAPTER, str(self.adapter)),)

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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"--seed must be an integer in [0, 2**63), got {self.seed}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"--stop-token-id {t}: token ids are >= 0")
        self.sampling(0, self.stop_token_ids)  # SamplingParams' own checks, before anything is loaded
        super().check()  # model, tokenizer, device, dtype, memory, layout and speculation flags
        check_adapters(self.adapters, self.model)
        if self.out is not None:  # before anything is generated: an output that cannot be written, or an input
            inputs = {"--prompts": self.prompts, "--input-ids": self.input_ids, "--model": self.model_path}
            inputs.update({f"--image {p}": p for p in self.images})
            check_output_path(self.out, "--json", inputs)

    def engine_spec(self, **fields):
        """The engine's spec: the engine flags' (the --tp / --ep / --dcp layout among them) with the adapter;
        `fields` as `EngineFlags.engine_spec` (a worker rank's device)."""
        return super().engine_spec(**{"adapters": self.adapters, **fields})

    def sampling(self, row: int, stops: tuple[int, ...]):
        from rollout.request import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=stops,
            seed=self.seed + row,
        )


def read_rows(path: Path, flag: str, encode) -> list[list[int]]:
    """Each line's token ids. `encode(row) -> ids` for --prompts rows; None: rows carry input_ids."""
    from miles_k3.data.prompts import read_jsonl_rows

    rows = []
    try:
        for where, row in read_jsonl_rows(path):
            if encode is None:
                ids = row.get("input_ids")
                if (
                    not isinstance(ids, list)
                    or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                ):
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


def encode_images(paths: tuple[Path, ...], model_path: str, dtype: str, device: str) -> tuple[list, list]:
    """The --image files processed by the checkpoint's image settings, and their features from its tower
    and projector (one forward, each image once): (ProcessedImages, `rollout.media.ImageFeatures` on the
    CPU). ValueError naming the file or the checkpoint part that is missing."""
    import torch

    from miles_k3.data.image_processor import ImageProcessor
    from miles_k3.model.base import TORCH_DTYPES
    from miles_k3.model.vision import K3VisionModel
    from rollout.media import ImageFeatures

    processor = ImageProcessor.from_pretrained(model_path)
    processed = [processor.process(path, name=f"--image {path}") for path in paths]
    vision = K3VisionModel.from_pretrained(model_path, dtype=TORCH_DTYPES[dtype], device=device).eval()
    with torch.no_grad():
        feats = vision.encode(
            torch.cat([p.pixel_values for p in processed]), torch.tensor([p.grid_thw for p in processed])
        )
    rows = feats.float().cpu().split([p.num_tokens for p in processed])  # the CPU: they travel to --tp workers
    return processed, [ImageFeatures(f.clone(), p.content_hash) for f, p in zip(rows, processed)]


def check_ids(rows: list[list[int]], vocab_size: int, max_seq_len: int, max_new_tokens: int, source: str) -> None:
    for i, ids in enumerate(rows):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{source} row {i + 1}: token id {bad} is outside the model's vocabulary ({vocab_size})")
        if len(ids) + max_new_tokens > max_seq_len:
            raise ValueError(
                f"{source} row {i + 1}: {len(ids)} prompt tokens + --max-new-tokens {max_new_tokens} "
                f"exceed the engine's max sequence length {max_seq_len} (--max-seq-len)"
            )


def generate_outputs(
    engine,
    rows: list[list[int]],
    args: GenerateArgs,
    stops: tuple[int, ...],
    adapter: str | None,
    tokenizer=None,
    images: list | None = None,
) -> list[dict]:
    """Run every row to completion on `engine` (each row with `images`, ImageFeatures, when given); one
    output dict per row, in row order."""
    completions = engine.generate(
        rows,
        [args.sampling(i, stops) for i in range(len(rows))],
        adapter,
        images=[images] * len(rows) if images else None,
    )
    outputs = []
    for c in completions:
        out = {"output_ids": c.output_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason.value}
        if tokenizer is not None:
            out["text"] = tokenizer.decode(c.output_ids)
        outputs.append(out)
    return outputs


def run(args: GenerateArgs) -> list[dict]:
    """Load, check every row, generate (tensor-parallel workers for --tp > 1). ValueError on bad input."""
    from miles_k3.data.media import prompt_encoder
    from rollout.server.tokenization import build_server_tokenizer

    args.check()
    spec = args.engine_spec()
    config = spec.base_config()
    processed, images = [], None
    if args.images:
        if config.vision_config is None or config.media_placeholder_token_id is None:
            raise ValueError(
                f"--image: {args.model_path} is not a vision-language checkpoint (its config.json has "
                "no vision_config / media_placeholder_token_id)"
            )
        processed, images = encode_images(args.images, spec.path, spec.dtype, args.device)
    tokenizer = None
    if args.prompts is not None:
        tokenizer = build_server_tokenizer(args.tokenizer_kind, spec.path)
        encode = prompt_encoder(tokenizer, processed, config.media_placeholder_token_id)
        rows = read_rows(args.prompts, "--prompts", encode)
    else:
        rows = read_rows(args.input_ids, "--input-ids", None)
    for t in args.stop_token_ids:
        if not 0 <= t < config.vocab_size:
            raise ValueError(f"--stop-token-id {t} is outside the model's vocabulary ({config.vocab_size})")
    if args.seed + len(rows) - 1 >= MAX_SEED:
        raise ValueError(
            f"--seed {args.seed}: row {len(rows)} would sample with seed {args.seed + len(rows) - 1} >= 2**63"
        )
    stops = tuple(args.stop_token_ids) + ((tokenizer.eos_token_id,) if tokenizer is not None else ())
    check_ids(
        rows,
        config.vocab_size,
        spec.engine.max_seq_len,
        args.max_new_tokens,
        "--prompts" if args.prompts is not None else "--input-ids",
    )
    with flag_errors():  # --tp / --ep against the model's heads and experts, before any worker is spawned
        spec.check_layout(config)
    sizes = args.check_pool(config, args.tp, args.dcp)
    page = spec.engine.page_size
    for i, ids in enumerate(rows):
        need = -(-(len(ids) + args.max_new_tokens) // page)
        if need > sizes.num_pages:
            raise ValueError(
                f"{'--prompts' if args.prompts is not None else '--input-ids'} row {i + 1}: {len(ids)} prompt "
                f"tokens + --max-new-tokens {args.max_new_tokens} need {need} KV pages; --memory-mb "
                f"{args.memory_mb:g} holds {sizes.num_pages}"
            )
    if args.tp == 1:
        from rollout.build import build_engine

        with flag_errors():
            engine = build_engine(spec)
        return generate_outputs(engine, rows, args, stops, None if args.adapter is None else ADAPTER, tokenizer, images)
    outputs = run_workers(args, rows, stops, images)
    if tokenizer is not None:
        for out in outputs:
            out["text"] = tokenizer.decode(out["output_ids"])
    return outputs


def run_workers(
    args: GenerateArgs, rows: list[list[int]], stops: tuple[int, ...], images: list | None = None
) -> list[dict]:
    """--tp N: N worker processes, one engine rank each (gloo on CPU, nccl with a GPU per rank); rank 0
    generates and hands the outputs back through a file. A failure on any rank comes back as `spawn_ranks`
    raises it."""
    import tempfile

    from miles_k3.ranks import free_port

    with tempfile.TemporaryDirectory(prefix="miles-k3-generate-") as tmp:
        result = Path(tmp) / "result.json"
        spawn_ranks(_worker, args.tp, (free_port(), args, rows, stops, str(result), images), Path(tmp))
        return json.loads(result.read_text())["outputs"]


def _worker(
    rank: int,
    world: int,
    port: int,
    args: GenerateArgs,
    rows: list[list[int]],
    stops: tuple[int, ...],
    result: str,
    images: list | None = None,
) -> None:
    """One engine rank (`rollout.build.build_engine` on every rank of the world); rank 0 generates, writes the
    outputs to `result` and then releases the others, which follow it until then. Errors propagate (to
    `spawn_ranks`, which reports them)."""
    from miles_k3.ranks import end_world, join_local_world
    from rollout.build import build_engine

    device = join_local_world(rank, world, port, args.device)
    try:
        with flag_errors():
            engine = build_engine(args.engine_spec(device=device))
        if not engine.is_leader:
            engine.follow()
            return
        try:
            outputs = generate_outputs(engine, rows, args, stops, ADAPTER if args.adapter else None, images=images)
        finally:
            engine.stop_followers()
        Path(result).write_text(json.dumps({"outputs": outputs}))
    finally:
        end_world()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, GenerateArgs, ["model"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-ids", type=Path, help='JSONL rows {"input_ids": [...]}')
    src.add_argument("--prompts", type=Path, help='JSONL rows {"prompt": "text"} or {"messages": [...]}')
    p.add_argument(
        "--image",
        dest="images",
        type=Path,
        action="append",
        default=[],
        help="an image every --prompts row sees, at its <|kimi_image_placeholder|> (repeatable, in order)",
    )
    p.add_argument("--json", dest="out", type=Path, help="write the outputs here (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--seed", type=int, default=0, help="row i samples from a generator seeded seed + i")
    p.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        default=[],
        help="also stop after this token (repeatable)",
    )
    p.add_argument("--adapter", type=Path, help="a PEFT LoRA adapter directory (as the trainer saves it)")
    add_flags(p, GenerateArgs, [n for n in ENGINE_FLAGS if n != "model"])  # the engine's, as miles-serve's


def cmd_generate(ns: argparse.Namespace) -> int:
    fields = GenerateArgs.__dataclass_fields__
    args = GenerateArgs(
        **{k: getattr(ns, k) for k in fields if k not in ("stop_token_ids", "images")},
        stop_token_ids=tuple(ns.stop_token_ids),
        images=tuple(ns.images),
    )
    outputs = run(args)
    try:
        text = json.dumps({"outputs": outputs}, allow_nan=False)
    except ValueError:
        raise ValueError(
            "the outputs hold non-finite log-probs (NaN or inf): the model or --adapter is broken; nothing written"
        ) from None
    if args.out is None:
        sys.stdout.write(text + "\n")
    else:
        write_atomically(args.out, text)  # a reader never sees half a file; a failed write leaves none
        print(f"miles-k3 generate: {len(outputs)} outputs -> {args.out}", file=sys.stderr)
    return 0
