"""The engine's model step: packed multi-request prefill, decode, and CUDA graphs for decode batches.

`model_step` is the eager step over a `PoolStateCache` (`rollout.model_runner.ModelRunner.forward` runs it
or a graph). The reference `K3Model.forward` refuses packed sequences together with a cache, so the engine
calls its unchecked body `K3Model.hidden` with `cu_seqlens`, and the KDA mixers then carry one state per
packed request; the MLA mixers take their attention from the cache (`PoolStateCache.mla_attention`:
absorbed, over the KV pages).

`DecodeGraphs` captures the decode step per (batch bucket, history bucket) and replays it: the ~2,700
kernel launches of a k3-small step become one graph launch. A batch is padded to its bucket with rows that
read and write only the pools' sink slot / sink page, and histories are padded to a power of two with the
zero page; the layout tensors are the graph's static inputs.

A capture costs about as much as a few eager steps (two warm-up runs, the recorded run, instantiation), so
a batch that shrinks through many buckets (an RL rollout whose samples stop at different lengths) would
pay one per bucket. A bucket is therefore captured once it has been asked for `capture_after` times, and
until then a larger captured graph of the same adapter serves it with more padding rows (and history);
with no larger graph it is captured at once (`GraphChoice`, which the speculative verify and fold graphs
share).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from miles_k3.model.layers import K3DecoderLayer, KDAMixer
from miles_k3.model.modeling import K3ForCausalLM, K3Model, MediaEmbeds
from miles_k3.ops import exact
from rollout.linears import share_input_gemms
from rollout.lora import AdapterPool
from rollout.memory import KDAStatePool, KVPagePool
from rollout.state_cache import BatchLayout, PoolStateCache

log = logging.getLogger(__name__)


def _fp32_read_parameters(model: K3ForCausalLM):
    """(module, name) of the parameters the shared definition only ever reads upcast to fp32: the short
    convolutions' weights (`causal_short_conv`), the gated output norm's weight (`gated_rms_norm`) and the
    AttnRes norm / query weights of every layer and of the output (`attn_res_mix`). Not RMSNorm weights: `rms_norm`
    multiplies in the input's dtype."""
    for module in model.modules():
        if isinstance(module, KDAMixer):
            yield from ((getattr(module, f"{p}_conv1d"), "weight") for p in "qkv")
            yield module.o_norm, "weight"
        elif isinstance(module, K3DecoderLayer) and module.config.attn_res_block_size:
            for site in ("self_attention_res", "mlp_res"):
                yield from ((getattr(module, f"{site}_{part}"), "weight") for part in ("norm", "proj"))
        elif isinstance(module, K3Model) and hasattr(module, "output_attn_res_norm"):
            yield from ((getattr(module, f"output_attn_res_{part}"), "weight") for part in ("norm", "proj"))


def prepare_model(model: K3ForCausalLM) -> None:
    """Ready a loaded engine model for its steps, once (later calls return at once):

    - linears that read the same input share one GEMM (`rollout.linears.share_input_gemms`);
    - the parameters the definition upcasts to fp32 at every use are stored in fp32, holding their own
      (rounded) values: the same math, without a conversion kernel per use per step.

    `model_step` and `DecodeGraphs` call it, so a model built by `build_engine_model` is prepared before its
    first step. Both changes keep every output: tests/rollout/test_decode_fusion.py."""
    if getattr(model, "_engine_prepared", False):
        return
    with torch.inference_mode(False), torch.no_grad():
        if not exact.enabled():  # exact mode: each linear its own GEMM, of the trainer's shape
            share_input_gemms(model)
        store_fp32_reads(model)
    model._engine_prepared = True


def store_fp32_reads(model: K3ForCausalLM) -> None:
    """Store in fp32 the bf16 / fp16 parameters the definition reads only upcast (`_fp32_read_parameters`),
    from their own values: outputs are bit-identical, one conversion kernel per use fewer."""
    for module, name in _fp32_read_parameters(model):
        p = getattr(module, name)
        if p.dtype in (torch.bfloat16, torch.float16):
            setattr(module, name, torch.nn.Parameter(p.float(), requires_grad=False))


def model_step(
    model: K3ForCausalLM,
    ids: torch.Tensor,
    cache: PoolStateCache,
    cu_seqlens: torch.Tensor | None,
    every_token: bool = False,
    media: MediaEmbeds | None = None,
) -> torch.Tensor:
    """ids [N, 1] (decode) or [1, sum T] with `cu_seqlens` (packed prefill) -> logits [N, V] at each
    request's last new token; with `every_token`, logits [sum T, V] at every new token (a verify step).
    `media`: image features for the step's media pads (a prefill; positions index the flattened ids)."""
    prepare_model(model)
    h = model.model.hidden(ids, cache, cu_seqlens, media=media)
    if every_token:
        return model.logits(h.flatten(0, 1))
    last = h[:, -1] if cu_seqlens is None else h[0, cu_seqlens[1:] - 1]
    return model.logits(last)


# Asks of a batch bucket before it gets its own graph while a larger captured one can serve it. An RL
# rollout's batch passes through most buckets for one to three steps each as samples stop; a steady batch
# (the benchmark's) asks for the same bucket every step and is captured on its third.
CAPTURE_AFTER = 3


@contextlib.contextmanager
def hooks(modules: dict[str, torch.nn.Module], store: dict[str, torch.Tensor]) -> Iterator[None]:
    """While open, each module's forward output lands in store[name] (the last call's)."""

    def keep(name):
        def hook(_module, _inputs, output):
            store[name] = output

        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def tapped_rows(store: dict[str, torch.Tensor | tuple], tokens: int) -> dict[str, torch.Tensor]:
    """Hooked outputs of a step of the same tokens a row ([B, T, ...], or a tuple led by it: a decoder
    layer's) in the packed form the fold and a drafter read: [1, tokens, ...], the first `tokens` row by row
    (a padded batch's real rows)."""
    rows = {}
    for name, out in store.items():
        out = out[0] if isinstance(out, tuple) else out
        rows[name] = out.reshape(1, -1, *out.shape[2:])[:, :tokens]
    return rows


class GraphChoice:
    """Which graph serves a step whose exact key is (batch bucket, history bucket, *rest): that key once it
    is captured or has been asked for `capture_after` times (the caller then captures it), until then the
    smallest captured key at least as large in both buckets with the same rest (padding rows and history
    pages read and write only the sink slot and page, so any larger graph computes the same rows), the
    same history bucket first; with none, the exact key. Counts every ask, so call it once per step."""

    def __init__(self, capture_after: int = CAPTURE_AFTER):
        assert capture_after >= 1
        self.capture_after = capture_after
        self.asked: dict[tuple, int] = {}

    def choose(self, exact: tuple, captured: Iterable[tuple]) -> tuple:
        self.asked[exact] = self.asked.get(exact, 0) + 1
        captured = list(captured)
        if exact in captured or self.asked[exact] >= self.capture_after:
            return exact
        larger = [k for k in captured if k[0] >= exact[0] and k[1] >= exact[1] and k[2:] == exact[2:]]
        return min(larger, key=lambda k: (k[1], k[0])) if larger else exact


def _bucket(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


T = TypeVar("T")


def capture_graph(
    step: Callable[[], T], context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `step()` twice on a side stream (autotuning and lazy init happen there, outside the capture), then
    capture one call as a CUDA graph with `context()` open around it. Returns the graph and that call's output
    (the tensors a replay refills). `step` must read only static inputs (they are what a replay reads)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with context(), torch.cuda.graph(graph):
        out = step()
    return graph, out


class DecodeGraphs:
    """Decode steps at padded shapes, replayed from CUDA graphs (`capture=True`, CUDA only) or run eagerly
    at the same padded shapes (`capture=False`: the CPU tests' way to check padding and bucketing; outputs
    come back in buffers the key's next step refills, as a replay's do).

    Graphs read the pools' tensors by address: drop this object when the pools are rebuilt. A capture
    that fails (an op that syncs, say) is logged and turns graphs off; the engine then runs eagerly.

    With an adapter pool, a graph serves batches whose rows all use one adapter slot (an RL rollout: the
    policy, or the base alone): the slot and its scale are part of the graph's key, and the adapter
    buffers are read by address, so `update_adapter` (in place) is seen by every replay. Batches that mix
    adapters are not `usable` and run eagerly.
    """

    def __init__(
        self,
        model: K3ForCausalLM,
        kv: KVPagePool,
        states: KDAStatePool,
        *,
        max_batch: int,
        max_seq_len: int,
        capture: bool,
        adapters: AdapterPool | None = None,
        compile: bool = False,
        capture_after: int = CAPTURE_AFTER,
    ):
        prepare_model(model)  # before torch.compile sees the step
        self.model, self.kv, self.states, self.adapters = model, kv, states, adapters
        self.dcp_rank = getattr(model.model.tp, "dcp_rank", 0)  # the KV positions this rank keeps (rollout.dcp)
        self.capture, self.choice = capture, GraphChoice(capture_after)
        # torch.compile of the padded decode step: inductor fuses the step's elementwise chains (norm and gate
        # upcasts, SiTU, AttnRes mixing) into fewer kernels; the graph then replays the compiled step. Shapes
        # are the buckets', so after the first recompile dynamo generalizes instead of compiling each bucket.
        self._model_step = torch.compile(model_step) if compile else model_step
        self.batch_buckets = [
            b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b < max_batch
        ] + [max_batch]
        page = kv.page_size
        top = -(-max_seq_len // page) * page
        self.hist_buckets = sorted({min(top, max(page, 1 << s)) for s in range(6, 40) if (1 << (s - 1)) < top})
        # key (batch bucket, history bucket, *adapter key) -> captured graph (None when capture=False: the
        # padded shape is then run eagerly, but the bucket policy is the same)
        self.graphs: dict[tuple, tuple | None] = {}
        self._outputs: dict[tuple, tuple] = {}  # capture=False: each key's output buffers (`_as_replayed`)
        self.failed = False
        self.replays = 0
        self.captures = 0

    def graph_key(self, n: int, hist: int, slot_key: tuple = ()) -> tuple:
        """The graph that serves a step of `n` rows whose longest history is `hist` tokens (after `usable`),
        counting the request (`GraphChoice`)."""
        exact = (_bucket(n, self.batch_buckets), _bucket(hist, self.hist_buckets), *slot_key)
        return self.choice.choose(exact, self.graphs)

    def usable(self, batch: int, hist: int) -> bool:
        """After the pool's `set_batch` for this step: whether `run` can serve it."""
        return (
            not self.failed
            and _bucket(batch, self.batch_buckets) is not None
            and _bucket(hist, self.hist_buckets) is not None
            and (self.adapters is None or self.adapters.batch_slot is not None)
        )

    def run(
        self,
        ids: torch.Tensor,
        slots: list[int],
        positions: list[int],
        page_tables: list[list[int]],
        taps: dict[str, torch.nn.Module] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One decode token per request (ids [N] on the pools' device) -> (logits [N, V], the outputs of `taps`,
        modules of the model, at each row's token: [1, N, ...] by name, empty without taps; a tapped step has
        graphs of its own, which hold those outputs). Enqueues only: inputs go to the device with asynchronous
        copies, so the host can prepare the next step while this one runs."""
        n = ids.shape[0]
        taps = taps or {}
        slot_key: tuple = ()
        if self.adapters is not None:
            slot = self.adapters.batch_slot
            assert slot is not None, "run() needs one adapter slot for the whole batch (see usable)"
            slot_key = (slot, float(self.adapters.scale[slot]))
        key = self.graph_key(n, max(positions) + 1, slot_key + (("tapped",) if taps else ()))
        bb, sb = key[0], key[1]
        pad = bb - n
        # built on the host and copied straight into the graph's static inputs (no device-side temporary)
        # when a graph serves the step; to the device otherwise
        target = torch.device("cpu") if self.capture else self._device
        layout = BatchLayout.build(
            self.kv,
            slots + [self.states.sink_slot] * pad,
            positions + [0] * pad,
            [1] * bb,
            page_tables + [[self.kv.sink_page]] * pad,
            target,
            hist_len=sb,
            dcp_rank=self.dcp_rank,
        )
        ids_t = (torch.cat([ids, ids.new_zeros(pad)]) if pad else ids)[:, None]
        if slot_key:
            self.adapters.set_batch([slot_key[0]] * bb, 1)  # sink rows take the batch's slot: same shapes, no mixing
        if not self.capture:  # counted as a capture / replay would be, so the CPU tests see the policy
            if key not in self.graphs:
                self.graphs[key] = None
                self.captures += 1
            self.replays += 1
            return self._as_replayed(key, *self._tapped_step(ids_t, layout, taps, bb), n)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(bb, sb, taps)
                self.captures += 1
            except Exception:  # noqa: BLE001 - any capture failure means: run eagerly from now on
                log.warning(
                    "CUDA graph capture failed for batch %d, history %d, adapter %s; decoding eagerly",
                    bb,
                    sb,
                    slot_key or None,
                    exc_info=True,
                )
                self.failed = True
                self.graphs.clear()
                return self._tapped_step(ids_t, layout.to(self._device), taps, n)
        graph, static_ids, static_layout, out, store = self.graphs[key]
        static_ids.copy_(ids_t)
        static_layout.copy_(layout)
        graph.replay()
        self.replays += 1
        return out[:n], tapped_rows(store, n)

    def _as_replayed(
        self, key: tuple, logits: torch.Tensor, tapped: dict[str, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """An eager padded step's outputs (all `key[0]` rows) returned as a replay returns them: rows of buffers
        that the key's next step refills, so a caller that reads them after enqueueing that step fails on CPU
        as it would on CUDA."""
        if key not in self._outputs:
            self._outputs[key] = (torch.empty_like(logits), {k: torch.empty_like(v) for k, v in tapped.items()})
        out, store = self._outputs[key]
        out.copy_(logits)
        for k, v in tapped.items():
            store[k].copy_(v)
        return out[:n], tapped_rows(store, n)

    @property
    def _device(self) -> torch.device:
        return next(iter(self.kv.buffers.values())).device

    def _step(self, ids: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        with torch.inference_mode():
            return self._model_step(self.model, ids, PoolStateCache(self.kv, self.states, layout), None)

    def _tapped_step(self, ids: torch.Tensor, layout: BatchLayout, taps: dict, n: int):
        store: dict[str, torch.Tensor] = {}
        with hooks(taps, store):
            logits = self._step(ids, layout)
        return logits[:n], tapped_rows(store, n)

    def _capture(self, bb: int, sb: int, taps: dict):
        # Warm-up and capture run on sink-only inputs, so they touch no request's state or KV.
        layout = BatchLayout.build(
            self.kv,
            [self.states.sink_slot] * bb,
            [0] * bb,
            [1] * bb,
            [[self.kv.sink_page]] * bb,
            self._device,
            hist_len=sb,
            dcp_rank=self.dcp_rank,
        )
        ids = torch.zeros(bb, 1, dtype=torch.long, device=self._device)
        store: dict[str, torch.Tensor] = {}  # the taps' outputs inside the graph's memory, refilled by replays
        graph, out = capture_graph(lambda: self._step(ids, layout), lambda: hooks(taps, store))
        return graph, ids, layout, out, store
