"""The rollout backend of engines behind HTTP (`rollout.backend=http`, `rollout.urls`): any number of `miles-serve`
processes, or an SGLang deployment, driven through SGLang's API.

    miles-serve --model builtin:k3-tiny-arith --quantize none --max-lora-rank 8 --max-loras 2 --port 30001 &
    miles-train recipe=k3_grpo rollout.backend=http rollout.urls=[http://127.0.0.1:30001]

What goes over the wire, by SGLang's field names:

    generate         POST /generate {input_ids, sampling_params {max_new_tokens, temperature, top_p, top_k,
                     stop_token_ids, ignore_eos: true only when there are no stop ids (SGLang's ignore_eos turns
                     stop_token_ids off too; with stop ids the model's eos stops as well, which the driver's
                     stop ids hold: rollout.stop_at_eos), no_stop_trim: true (the stop token is kept, as the
                     trainer trains it), sampling_seed (the sample's own seed: the same samples as the
                     colocated engine draws; SGLang draws by it only when launched with
                     --enable-deterministic-inference)}, return_logprob, lora_path (the policy's current name;
                     null: the base), return_routed_experts (with rollout.record_routing), rid}
                     -> {output_ids, meta_info {finish_reason {type: stop | length | abort}, output_token_logprobs:
                     [logprob, token id, null] per output token (at the request's temperature, before top-p /
                     top-k), routed_experts}}
    adapter sync     POST /load_lora_adapter_from_tensors {lora_name: "policy-<run>-v<N>", config_dict,
                     serialized_tensors: the PEFT file, base64, load_format: "safetensors"} on every server
                     (miles-serve's encoding of the tensors: SGLang's own field is serialized_named_tensors,
                     its multiprocessing serializer's output, which an SGLang server needs instead); or, with
                     rollout.adapter_dir (a filesystem the servers share: what an SGLang deployment loads),
                     the PEFT directory written to <adapter_dir>/<lora_name> and POST /load_lora_adapter
                     {lora_name, lora_path: that directory} on every server. Then /unload_lora_adapter
                     {lora_name} of the version that falls out of the last rollout.max_staleness + 1 (whose
                     requests may still be in flight), and its directory removed
    partial          POST /abort_request {rid} of a request an update stops (rollout.partial): it answers
                     with finish_reason abort and the tokens it had
    memory           POST /release_memory_occupation, /resume_memory_occupation (rollout.release_memory: servers
                     that share the trainer's GPUs)

A prompt group's samples go to one server (their shared prefix is cached there); groups are dealt round-robin
over the servers that answer. A request that fails (a connection refused or reset, a timeout, a 5xx, a finish
by abort) is sent again to another server, and the failing server leaves the set: a sample is filled from
exactly one answer, so none is counted twice. Servers the run started itself (cluster.mode=disaggregated,
`revive`) are started again at the next step, or at once when none is left, given the current adapter and
taken back in; others stay out for the rest of the run. With no server left the step fails with one line
naming rollout.urls.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from miles_k3.data.sample import Sample
from miles_k3.trainer.backends import RolloutBackend, TrainerGroup, group_positions

if TYPE_CHECKING:
    from miles_k3.model.config import K3Config
    from miles_k3.model.lora_spec import LoraSpec
    from rollout.request import SamplingParams

POLICY = "policy"  # the adapter's name on the servers, suffixed by its version


class ServerGone(Exception):
    """A server that failed a request: it leaves the set."""


class HTTPEngines(RolloutBackend):
    """The engines behind `urls` (module docstring). `config`: the base's (the MoE layers and top-k of the
    routing table; read only with `record_routing`, so None serves a base without one); `family`: the PEFT
    naming the adapter is sent in (`adapter_family(config)`)."""

    def __init__(
        self,
        urls: list[str],
        lora: LoraSpec,
        config: K3Config | None,
        family: str,
        *,
        record_routing: bool = False,
        keep_versions: int = 1,
        partial: str = "off",
        timeout_s: float = 600.0,
        adapter_dir: str | None = None,
        revive: Callable[[str], None] | None = None,
    ):
        """`keep_versions`: adapter versions each server keeps loaded (rollout.max_staleness + 1: requests of
        the older ones may still be in flight when a new one arrives). `partial` (rollout.partial): what an
        update does to the requests in flight: "off" they finish under their version; "restart" they are
        aborted and sent again under the new one; "continue" aborted and sent again from their tokens, the new
        version drawing the rest. `adapter_dir` (rollout.adapter_dir): None sends each adapter version in the
        load request; a directory the servers also see (at the same path) receives each version's PEFT
        directory, which the servers are told to load (module docstring). `revive(url)`: starts the server at
        `url` again (cluster.mode=disaggregated's `EngineFleet.restart`); a server that left the set is then
        revived at the next step, or at once when none is left, given the current adapter and taken back in.
        None: a server that fails stays out for the rest of the run."""
        import httpx

        from miles_k3.model.routing import moe_layers

        self.urls, self.alive = list(urls), list(urls)
        self.lora, self.family, self.record_routing = lora, family, record_routing
        if record_routing and config is None:
            raise ValueError("rollout.record_routing: the routing table's shape needs the base's config")
        self.routing_shape = (len(moe_layers(config)), config.num_experts_per_token) if record_routing else None
        self.adapter_dir = None if adapter_dir is None else Path(adapter_dir).absolute()
        self.version, self.keep_versions = 0, keep_versions
        self.run_id = uuid.uuid4().hex[:8]
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.client = httpx.Client(timeout=self.timeout)
        self.failed: dict[str, str] = {}  # url -> why it left the set (while it is out)
        self.lost = self.restarted = 0  # servers that left the set / came back, since the run began
        self.revive = revive
        # the current version's load request, for a revived server; held with the version by whoever changes
        # either (a sync, a revival: the generating thread's and the driver's can meet)
        self.current_load: tuple[str, dict] | None = None
        self.joined = dict.fromkeys(urls, 0)  # url -> the version it (re)joined the set with
        self.round = 0  # generate calls so far: a server is revived at most once a round (`_revive_dead`)
        self.tried: dict[str, int] = {}  # url -> the round its last revival was tried in
        self.sync_lock = threading.RLock()
        self.partial = partial
        # requests in flight (rid -> (server, version)) and those an update stopped: the generating thread and
        # the driver's (which syncs) share them
        self.lock = threading.Lock()
        self.inflight: dict[str, tuple[str, int]] = {}
        self.stopped: set[str] = set()
        self.partials = 0  # requests an update stopped and sent again
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the run's log

    def name(self, version: int) -> str | None:
        """The servers' name of adapter version `version` (None: the base), unique to this backend so a run that
        restarts against servers still up never meets its predecessor's names."""
        return f"{POLICY}-{self.run_id}-v{version}" if version else None

    # ------------------------------------------------------------------ generate
    def generate(self, samples: list[Sample], params: list[SamplingParams]) -> list[Sample]:
        return asyncio.run(self._generate(samples, params))

    async def _generate(self, samples: list[Sample], params: list[SamplingParams]) -> list[Sample]:
        import httpx

        order = group_positions([s.group_index for s in samples])
        with self.sync_lock:
            self.round += 1
        self._revive_dead()
        async with httpx.AsyncClient(timeout=self.timeout) as http:
            await asyncio.gather(*(self._one(http, s, p, order[s.group_index]) for s, p in zip(samples, params)))
        return samples

    async def _one(self, http, sample: Sample, params: SamplingParams, group: int) -> None:
        done = _Partial()  # with rollout.partial=continue: the tokens of versions an update stopped
        while True:
            rid = f"miles-k3-{uuid.uuid4().hex}"
            if not self.alive and self.revive is not None:
                await asyncio.to_thread(self._revive_dead)
            with self.lock:  # the version read and the request registered at once: a sync sees it or it sees the sync
                if not self.alive:
                    raise ValueError(f"rollout.urls: no server answers ({self._why()})")
                url = self.alive[group % len(self.alive)]
                version = self.version
                self.inflight[rid] = (url, version)
            body = self._body(sample, params, done, rid, version)
            try:
                out = await self._post(http, url, body, rid)
            except ServerGone as e:
                self._drop(url, str(e))
                continue
            finally:
                with self.lock:
                    self.inflight.pop(rid, None)
                    self.stopped.discard(rid)
            # only our own aborts come back as answers (a server's abort is ServerGone); a request that finished
            # before the abort reached it keeps its answer
            if (out["meta_info"].get("finish_reason") or {}).get("type") == "abort":
                # an update stopped it: again under the new version, from scratch or from its tokens
                with self.lock:
                    self.partials += 1
                if self.partial == "restart":
                    continue
                if len(done.ids) + len(out["output_ids"]) < params.max_new_tokens:
                    done.add(out, version)
                    continue
                out["meta_info"]["finish_reason"] = {"type": "length"}  # stopped on its last token
            self._fill(sample, out, done, version)
            return

    async def _post(self, http, url: str, body: dict, rid: str) -> dict:
        import httpx

        while True:
            try:
                r = await http.post(f"{url}/generate", json=body)
            except httpx.HTTPError as e:
                raise ServerGone(f"{type(e).__name__}: {e}") from None
            if r.status_code != 429:  # a full queue: the same server, a moment later
                break
            await asyncio.sleep(0.05)
        if r.status_code >= 500:
            raise ServerGone(f"HTTP {r.status_code}")
        if r.status_code != 200:  # our request is wrong: no other server would take it
            raise ValueError(f"rollout.urls {url}: /generate refused a request: {r.text[:300]}")
        out = r.json()
        if (out["meta_info"].get("finish_reason") or {}).get("type") == "abort":
            with self.lock:
                if rid in self.stopped:  # our own abort (an update): the caller goes on from what it had
                    return out
            raise ServerGone("the server aborted the request")
        return out

    def _body(self, sample: Sample, params: SamplingParams, done: _Partial, rid: str, version: int) -> dict:
        if sample.media is not None:
            raise ValueError("rollout.backend=http: image prompts are not sent over HTTP yet")
        body = {
            "rid": rid,
            "input_ids": sample.prompt_ids + done.ids,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens - len(done.ids),
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k if params.top_k else -1,
                "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": not params.stop_token_ids,  # SGLang's also turns stop_token_ids off
                "no_stop_trim": True,
                "sampling_seed": params.seed,
            },
            "return_logprob": True,
            "lora_path": self.name(version),
        }
        if self.record_routing:
            body["return_routed_experts"] = True
        return body

    def _fill(self, sample: Sample, out: dict, done: _Partial, version: int) -> None:
        """The sample from its last answer and the tokens earlier versions gave it (`done`): each output token
        tagged with the adapter version that drew it (`token_fields["policy_version"]`), the sample with its
        oldest (`policy_version`: what the staleness bound reads)."""
        from miles_k3.model.routing import decode_table

        meta = out["meta_info"]
        done.add(out, version)
        sample.output_ids, sample.logprobs = done.ids, done.logprobs
        sample.loss_mask = [True] * len(sample.output_ids)
        sample.token_fields["policy_version"] = done.versions
        sample.policy_version = min(done.versions, default=version)
        sample.finish_reason = (meta.get("finish_reason") or {}).get("type", "length")
        if self.record_routing:
            table = decode_table(meta["routed_experts"], *self.routing_shape)
            last = torch.full((1, *self.routing_shape), -1, dtype=table.dtype)  # the last token is never fed
            sample.routed_experts = torch.cat([table, last])

    def _drop(self, url: str, why: str) -> None:
        with self.lock:
            if url in self.alive:
                self.alive.remove(url)
                self.failed[url] = why
                self.lost += 1

    def _revive_dead(self) -> None:
        """With `revive`: every server out of the set started again, given the current adapter version and taken
        back in (one that cannot be revived stays out, and says why in the run's log). A server is tried once a
        round: the requests that find no server left all land here, and one failed start answers them all."""
        with self.sync_lock:
            for url in list(self.failed):
                if self.revive is None or self.tried.get(url) == self.round:
                    continue
                self.tried[url] = self.round
                try:
                    self.revive(url)
                    if self.current_load is not None:
                        self._control(url, *self.current_load)
                except (ServerGone, ValueError) as e:
                    logging.getLogger(__name__).warning("engine server %s not revived: %s", url, e)
                    continue
                with self.lock:
                    self.failed.pop(url)
                    self.alive.append(url)
                    self.joined[url] = self.version
                    self.restarted += 1

    def _why(self) -> str:
        return "; ".join(f"{u}: {w}" for u, w in self.failed.items()) or "none given"

    # -------------------------------------------------------------------- adapter
    def sync_adapter(self, trainer: TrainerGroup) -> dict[str, float]:
        """The trainer's adapter, gathered part by part on the driver, as one PEFT file loaded by every server
        under the next version's name (sent in the request, or written under `adapter_dir` and named); the
        version that falls out is unloaded after (and its directory removed). A server that fails it leaves the
        set. `adapter_sync_sent_bytes_max`: the adapter file's size, what each server takes in."""
        start = time.perf_counter()
        with self.sync_lock:  # no revival in between: a revived server takes the version current when it joins
            self._revive_dead()
            return self._sync(trainer, start)

    def _sync(self, trainer: TrainerGroup, start: float) -> dict[str, float]:
        from miles_k3.model.peft import CONFIG_FILE, WEIGHTS_FILE, save_peft

        new = self.version + 1  # requests go on naming the current version until every server holds this one
        old = self.name(new - self.keep_versions) if new > self.keep_versions else None
        if self.adapter_dir is None:
            with tempfile.TemporaryDirectory(prefix="miles-k3-adapter-") as tmp:
                save_peft(Path(tmp), trainer.adapter_parts(), self.lora, family=self.family)
                weights = (Path(tmp) / WEIGHTS_FILE).read_bytes()
                config = json.loads((Path(tmp) / CONFIG_FILE).read_text())
            size = len(weights)
            body = {
                "lora_name": self.name(new),
                "config_dict": config,
                "serialized_tensors": base64.b64encode(weights).decode("ascii"),
                "load_format": "safetensors",
            }
            load = ("/load_lora_adapter_from_tensors", body)
        else:
            directory = self.adapter_dir / self.name(new)
            save_peft(directory, trainer.adapter_parts(), self.lora, family=self.family)
            size = (directory / WEIGHTS_FILE).stat().st_size
            load = ("/load_lora_adapter", {"lora_name": self.name(new), "lora_path": str(directory)})
        self.load_adapter(*load)
        with self.lock:
            self.version = new
        self.current_load = load
        if self.partial != "off":
            self._stop_older(new)
        if old is not None:  # no request names it now: the last that did were built before `new`
            # a server revived since holds only the versions it was given from then on
            self._on_all(
                "/unload_lora_adapter",
                {"lora_name": old},
                among=lambda url: self.joined[url] <= new - self.keep_versions,
            )
            if self.adapter_dir is not None:
                shutil.rmtree(self.adapter_dir / old)
        return {"adapter_sync_ms": (time.perf_counter() - start) * 1e3, "adapter_sync_sent_bytes_max": size}

    def load_adapter(self, path: str, body: dict) -> None:
        """Every server in the set takes one adapter version: `path` is SGLang's load route
        (/load_lora_adapter_from_tensors or /load_lora_adapter), `body` its request. A server that fails it
        leaves the set; ValueError naming rollout.urls when none is left, or (one line naming the server) when a
        server refuses the request itself."""
        self._on_all(path, body)
        if not self.alive and self.revive is not None:  # every one failed it: started again, they take it
            self._revive_dead()
            self._on_all(path, body)
        if not self.alive:
            raise ValueError(f"rollout.urls: no server took the adapter ({self._why()})")

    def _stop_older(self, version: int) -> None:
        """Abort every request in flight under a version older than `version`; its coroutine sends it again
        (`partial`). A request that finishes before the abort reaches it keeps its answer."""
        with self.lock:
            older = [(rid, url) for rid, (url, v) in self.inflight.items() if v < version]
            self.stopped.update(rid for rid, _ in older)
        for rid, url in older:
            try:
                self._control(url, "/abort_request", {"rid": rid})
            except ServerGone as e:
                self._drop(url, str(e))

    def _control(self, url: str, path: str, body: dict) -> dict:
        import httpx

        try:
            r = self.client.post(f"{url}{path}", json=body)
        except httpx.HTTPError as e:
            raise ServerGone(f"{type(e).__name__}: {e}") from None
        if r.status_code >= 500:
            raise ServerGone(f"{path}: HTTP {r.status_code}")
        if r.status_code != 200:
            raise ValueError(f"rollout.urls {url}: {path} refused: {r.text[:300]}")
        return r.json() if r.content else {}

    # --------------------------------------------------------------------- memory
    def release(self) -> None:
        """Servers on GPUs of the trainer's (rollout.release_memory with this backend) give their memory back."""
        self._on_all("/release_memory_occupation", {})

    def resume(self) -> None:
        self._on_all("/resume_memory_occupation", {})

    def _on_all(self, path: str, body: dict, among: Callable[[str], bool] = lambda url: True) -> None:
        """`path` with `body` on every server in the set (`among` them); one that fails leaves it."""
        for url in list(self.alive):
            if not among(url):
                continue
            try:
                self._control(url, path, body)
            except ServerGone as e:
                self._drop(url, str(e))

    def counters(self) -> dict[str, int]:
        """Since the run began (the driver logs each step's change): servers that left the set, those revived
        into it (`revive`), and requests an adapter update stopped and sent again (rollout.partial)."""
        return {"servers_lost": self.lost, "servers_restarted": self.restarted, "partial_resent": self.partials}

    def shutdown(self) -> None:
        """Unload this run's adapter versions from the servers that answer (their slots go back to the pool),
        then remove this run's directories under `adapter_dir`. No server is revived after it."""
        with self.sync_lock:  # a revival under way ends first
            self.revive = None
        for version in range(max(1, self.version - self.keep_versions + 1), self.version + 1):
            for url in list(self.alive):
                try:
                    self._control(url, "/unload_lora_adapter", {"lora_name": self.name(version)})
                except (ServerGone, ValueError):
                    pass  # the run is over: a server that cannot unload keeps a slot
        if self.adapter_dir is not None:
            for directory in self.adapter_dir.glob(f"{POLICY}-{self.run_id}-v*"):
                shutil.rmtree(directory, ignore_errors=True)
        self.client.close()


class _Partial:
    """The output a request has so far across the versions that drew it (rollout.partial=continue)."""

    def __init__(self):
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def add(self, out: dict, version: int) -> None:
        ids = list(out["output_ids"])
        self.ids += ids
        self.logprobs += [float(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        self.versions += [version] * len(ids)
