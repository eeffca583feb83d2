"""The colocated GRPO loop, run by the driver (the local launcher's rank 0, or the Ray driver).

One step:
  1. sample prompts; the engine(s) generate n samples per prompt with the policy adapter (prefix-cached), or,
     with rollout.fn, the rollout plugin runs each sample's turns against them (multi-turn: tool / environment
     tokens masked out of the loss; `miles_k3.trainer.rollout_plugin`);
  2. reward plugins score them; failed samples are dropped or stop the run (reward.on_failure);
     zero-variance groups are dropped and refilled with fresh prompts (algo.dynamic_sampling:
     `algo.filters`); group-normalized advantages;
  3. the engines release their KV / state pools (unless rollout.release_memory=false); the trainer ranks
     run the GRPO update;
  4. the adapter (gathered over TP) is copied into every engine's adapter slot in place; engines resume;
     with speculation and rollout.speculative.distill_every, every N steps the engine's drafter is distilled
     on this step's rollouts against the policy with its new adapter (in place: the next rollout drafts
     with it);
  5. a metrics row (with speculation: mean accepted length, draft acceptance, verify tokens, from the
     engines' SpecStats over the step's rollouts); evaluation and an atomic checkpoint at their intervals.

Image prompts (a dataset whose records hold images: `RunInputs.media`): each sampled record's images are
processed by the checkpoint's preprocessor config, its placeholders expanded to XTML blocks, and its features
computed once by the frozen tower + projector; its samples go to the engine as `MediaPrompt`s sharing those
`ImageFeatures`, and the same features ride in the train batch (`SequenceMedia`) to the pads of the packed row.

A preemption signal (`miles_k3.trainer.preempt`) stops the run between steps: the step in flight finishes,
a checkpoint of it is written (unless its interval just wrote one) and `run` returns with `preempted` set
to the signal's name; the launcher turns that into `Preempted` (the batch files requeue the job on it).

`Workers` hides where the engines and trainer ranks live (in this process, other processes, Ray actors).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from miles_k3.algo import group_advantages, groups_to_refill, nonzero_variance_groups, reward_stats
from miles_k3.data import PromptRecord, PromptSampler
from miles_k3.rewards import Sample, score
from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer import preempt
from miles_k3.trainer.batch import SequenceMedia, TrainBatch
from miles_k3.trainer.inputs import RunInputs, load_run_inputs
from miles_k3.trainer.resolve import ResolvedConfig
from miles_k3.trainer.rollout_plugin import RolloutJob, Trajectory
from miles_k3.trainer.rollout_worker import Generated, MediaPrompt
from miles_k3.trainer.run_log import Progress, RunLog
from rollout.request import SamplingParams
from rollout.spec.distill import DistillConfig

log = logging.getLogger(__name__)


class Workers(Protocol):
    """The engines and trainer ranks of a run, as the driver sees them."""

    # a prompt with images is a MediaPrompt (its ids and ImageFeatures), else its ids (RolloutWorker.generate)
    def generate(self, prompts: list[list[int] | MediaPrompt], params: list[SamplingParams]) -> list[Generated]: ...
    # rollout.fn's samples on the engine(s) (RolloutWorker.rollout), in job order
    def rollout(self, fn: str, jobs: list[RolloutJob], *, tokenizer: tuple[str, str | None],
                client: str) -> list[Trajectory]: ...
    def engine_counters(self) -> dict[str, int]: ...  # cumulative, summed over engines (RolloutWorker's)
    # distil every engine's drafter on the step's sequences (RolloutWorker.distill_drafter); speculation only
    def distill_drafter(self, sequences: list[tuple[int, list[int]]], config: DistillConfig,
                        seed: int) -> dict[str, float]: ...
    def drafter_state(self) -> dict | None: ...  # the distilled drafter, for a checkpoint (engine 0's)
    def load_drafter_state(self, state: dict, config: DistillConfig) -> None: ...  # into every engine
    def release_engines(self) -> None: ...
    def resume_engines(self) -> None: ...
    def train(self, batch: TrainBatch) -> dict[str, float]: ...
    def adapter_state(self) -> dict[str, torch.Tensor]: ...
    def sync_adapter(self, tensors: dict[str, torch.Tensor]) -> float: ...
    def trainer_states(self) -> list[dict[str, Any]]: ...
    def load_trainer_states(self, states: list[dict[str, Any]], adapter: dict[str, torch.Tensor]) -> None: ...
    def shutdown(self) -> None: ...


class Rolled(NamedTuple):
    """One sample as the loop scores and trains it (single-turn: every response token is the policy's)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # the engine's, per response token
    loss_mask: list[bool] | None  # None: every response token carries loss
    text: str  # what the reward scores
    media: SequenceMedia | None = None  # the prompt's image features at its pads (shared by its samples)

    @property
    def policy_tokens(self) -> int:
        return len(self.output_ids) if self.loss_mask is None else sum(self.loss_mask)


def spec_metrics(counters: dict[str, int | float]) -> dict[str, float]:
    """A step's speculation metrics from its engine counter differences (`rollout_spec_*`): mean accepted
    length (tokens a row advances per verify: its kept drafts + 1), draft acceptance (kept / verified
    drafts), verify tokens (fed to the verify forwards: anchors + verified drafts). Empty without
    speculation."""
    if "rollout_spec_rows" not in counters:
        return {}
    rows, drafted = counters["rollout_spec_rows"], counters["rollout_spec_drafted"]
    return {"spec_accept_len": counters["rollout_spec_emitted"] / rows if rows else float("nan"),
            "spec_draft_acceptance": counters["rollout_spec_accepted"] / drafted if drafted else float("nan"),
            "spec_verify_tokens": rows + drafted}


DRAFTER_FILE = "drafter_state.pt"  # in a checkpoint, with online distillation: the drafter and its optimizer


def sample_seed(run_seed: int, step: int, round_: int, index: int) -> int:
    """A distinct, reproducible engine seed per sample (so a resumed run redraws the same samples)."""
    h = run_seed
    for x in (step, round_, index):
        h = (h * 1_000_003 + x + 1) % (1 << 62)
    return h


class GRPODriver:
    def __init__(self, rc: ResolvedConfig, run_dir: str | Path, workers: Workers, inputs: RunInputs | None = None):
        """`inputs`: what `load_run_inputs(rc, run_dir)` returned, if the caller already read it (else read
        here, without the checkpoint's tensors: the driver holds none)."""
        self.rc, self.workers = rc, workers
        self.run_dir = Path(run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.inputs = inputs or load_run_inputs(rc, run_dir, weights="skip")
        self.tok = self.inputs.tokenizer
        self.sampler = PromptSampler(self.inputs.train, shuffle=rc.data.shuffle, seed=rc.data.seed,
                                     drop_last=rc.data.drop_last)
        self.eval_records = self.inputs.heldout
        self.plugin = self.inputs.plugin
        self.media = self.inputs.media  # None: a text-only run (no vision model, no image code imported)
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint this driver wrote or resumed
        self.preempted: str | None = None  # the signal that stopped the run early (after its checkpoint)
        spec = rc.rollout.speculative
        self.distill_every = spec.distill_every if spec.drafter is not None else 0
        self._step_sequences: list[tuple[int, list[int]]] = []  # this step's rollouts, for the distillation

    # ------------------------------------------------------------------ rollouts
    def _params(self, seed: int | None, greedy: bool = False) -> SamplingParams:
        stop = (self.tok.eos_token_id,) if self.rc.rollout.stop_at_eos else ()
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=self.rc.sampling.max_new_tokens,
                                  stop_token_ids=stop)
        return dataclasses.replace(self.rc.sampling, stop_token_ids=stop, seed=seed)

    def _encode(self, records: list[PromptRecord]) -> tuple[list[list[int] | MediaPrompt], list[SequenceMedia | None]]:
        """Each record as the engine takes it (its ids, or a MediaPrompt with its images' features, computed
        here once for the record) and its media as the trainer takes it (None for a text record)."""
        prompts, media = [], []
        for rec in records:
            if not rec.images:
                prompts.append(self.tok.encode_prompt(rec.prompt))
                media.append(None)
                continue
            ids, images, features = self.media.encode(rec)
            prompts.append(MediaPrompt(ids, tuple(images)))
            media.append(SequenceMedia(tuple(i for i, t in enumerate(ids) if t == self.media.pad_id), features))
        return prompts, media

    def _generate(self, records: list[PromptRecord], prompts: list[list[int] | MediaPrompt],
                  params: list[SamplingParams], group_of: list[int],
                  media: list[SequenceMedia | None] | None = None) -> list[Rolled]:
        """One sample per (prompt, params) pair: the engine's completion, or rollout.fn's trajectory. `media`:
        per prompt, its images' features for the trainer (None: text)."""
        r = self.rc.rollout
        if r.fn is None:
            gens = self.workers.generate(prompts, params)
            media = media or [None] * len(prompts)
            return [Rolled(p.ids if isinstance(p, MediaPrompt) else p, g.output_ids, g.logprobs, None,
                           self.tok.decode(g.output_ids), m) for p, g, m in zip(prompts, gens, media)]
        n = r.samples_per_prompt
        jobs = [RolloutJob(records[g], p, sp, f"group {g} sample {i % n}")
                for i, (g, p, sp) in enumerate(zip(group_of, prompts, params))]
        trajs = self.workers.rollout(r.fn, jobs, tokenizer=(self.rc.model.tokenizer, self.rc.model.path),
                                     client=r.client)
        return [Rolled(t.prompt_ids, t.response_ids, t.logprobs, t.loss_mask,
                       self.tok.decode(t.response_ids) if t.text is None else t.text) for t in trajs]

    def _score(self, records: list[PromptRecord], gens: list[Rolled], group_of: list[int]):
        samples = [Sample(prompt=records[g].prompt, response=out.text, label=records[g].label,
                          metadata=records[g].metadata, group_index=g,
                          sample_index=i % self.rc.rollout.samples_per_prompt)
                   for i, (g, out) in enumerate(zip(group_of, gens))]
        return score(samples, self.rc.reward, self.plugin)

    def collect(self) -> tuple[TrainBatch, dict[str, float]]:
        """Generate, score, filter and refill until `prompts_per_step` groups carry signal (or the refill
        rounds run out); returns the batch and rollout metrics."""
        r, a = self.rc.rollout, self.rc.algo
        n = r.samples_per_prompt
        kept: list[tuple[list[Rolled], list[float]]] = []
        all_rewards: list[float] = []
        lengths: list[int] = []
        failures: dict[str, int] = {}
        groups_seen = groups_flat = all_masked = env_tokens = 0
        counters_before = self.workers.engine_counters()
        for round_ in range(a.max_refill_rounds + 1 if a.dynamic_sampling else 1):
            records = self.sampler.next_batch(groups_to_refill(len(kept), r.prompts_per_step))
            prompts, media = self._encode(records)  # a record's images encoded once, for all n of its samples
            flat_prompts = [p for p in prompts for _ in range(n)]
            flat_media = [m for m in media for _ in range(n)]
            group_of = [g for g in range(len(records)) for _ in range(n)]
            params = [self._params(sample_seed(self.rc.trainer.seed, self.step, round_, i))
                      for i in range(len(flat_prompts))]
            gens = self._generate(records, flat_prompts, params, group_of, flat_media)
            if self.distill_every:  # text sequences only: the drafter's teacher forward takes no image features
                self._step_sequences += [(len(g.prompt_ids), g.prompt_ids + g.output_ids) for g in gens
                                         if g.media is None]
            result = self._score(records, gens, group_of)
            for kind, count in result.failure_counts.items():
                failures[kind] = failures.get(kind, 0) + count
            groups_seen += len(records)
            # a response with no token of the policy's (all tool output, or none) carries no gradient: dropped
            trainable = torch.tensor([g.policy_tokens > 0 for g in gens])
            all_masked += int((~trainable).sum())
            env_tokens += sum(len(g.output_ids) - g.policy_tokens for g in gens)
            # failed samples are out of their groups; a group left with fewer than 2 carries no signal
            keep = result.keep & trainable
            signal = nonzero_variance_groups(result.rewards[keep],
                                             group_ids=torch.tensor(group_of)[keep]).tolist()
            signal += [False] * (len(records) - len(signal))  # trailing groups that lost every sample
            for g in range(len(records)):
                idx = [g * n + j for j in range(n) if bool(keep[g * n + j])]
                rewards = [float(result.rewards[i]) for i in idx]
                all_rewards += rewards
                lengths += [len(gens[i].output_ids) for i in idx]
                if not signal[g]:
                    groups_flat += 1
                    if a.dynamic_sampling or len(idx) < 2:
                        continue
                kept.append(([gens[i] for i in idx], rewards))
            if groups_to_refill(len(kept), r.prompts_per_step) == 0:
                break
        stats = reward_stats(torch.tensor(all_rewards, dtype=torch.float64))
        metrics = {"reward_mean": float(stats["reward_mean"]), "reward_std": float(stats["reward_std"]),
                   "response_len_mean": sum(lengths) / len(lengths) if lengths else float("nan"),
                   "groups_sampled": groups_seen, "groups_kept": len(kept), "groups_zero_variance": groups_flat,
                   "samples_dropped": sum(failures.values())}
        metrics.update({f"reward_failures_{k}": v for k, v in failures.items()})
        if r.fn is not None:
            metrics.update(samples_all_masked=all_masked, response_env_tokens_mean=env_tokens / max(1, len(lengths)))
        metrics.update({f"rollout_{k}": v - counters_before[k] for k, v in self.workers.engine_counters().items()})
        metrics.update(spec_metrics(metrics))
        return self._to_batch(kept), metrics

    def _to_batch(self, kept) -> TrainBatch:
        prompts, responses, logprobs, advantages, group_ids, media = [], [], [], [], [], []
        masks = [] if self.rc.rollout.fn is not None else None  # a rollout plugin's trajectories carry masks
        for g, (gens, rewards) in enumerate(kept):
            adv = group_advantages(torch.tensor(rewards), len(rewards), normalize_std=self.rc.algo.normalize_std)
            for gen, a in zip(gens, adv.tolist()):
                prompts.append(gen.prompt_ids)
                responses.append(gen.output_ids)
                logprobs.append(gen.logprobs)
                if masks is not None:
                    masks.append(gen.loss_mask)
                advantages.append(a)
                group_ids.append(g)
                media.append(gen.media)
        return TrainBatch(prompts, responses, logprobs, advantages, group_ids, masks,
                          media if any(m is not None for m in media) else None)

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts: the fraction of samples whose reward is >= 1 (binary
        verifiable rewards), and the mean reward."""
        recs = self.eval_records
        prompts, media = self._encode(recs)
        gens = self._generate(recs, prompts, [self._params(None, greedy=True)] * len(recs), list(range(len(recs))),
                              media)
        result = self._score(recs, gens, list(range(len(recs))))
        rewards = result.rewards[result.keep]
        return {"eval_accuracy": float((rewards >= 1.0).float().mean()) if len(rewards) else float("nan"),
                "eval_reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
                "eval_samples": len(recs)}

    # --------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        from megatron_patches.peft_io import save_peft

        adapter = self.workers.adapter_state()
        states = self.workers.trainer_states()
        # the distilled drafter drives which tokens a seeded sample draws: a resumed run needs it back
        drafter = self.workers.drafter_state() if self.distill_every else None

        def write(tmp: Path) -> None:
            save_peft(tmp / ckpt.ADAPTER_DIR, adapter, self.rc.lora)
            torch.save({"step": self.step, "sampler": self.sampler.state_dict(), "workers": states,
                        "config": self.rc.raw}, tmp / ckpt.STATE_FILE)
            if drafter is not None:
                torch.save(drafter, tmp / DRAFTER_FILE)

        path = ckpt.save_checkpoint(self.ckpt_root, self.step, write)
        ckpt.prune_checkpoints(self.ckpt_root, self.rc.trainer.keep_checkpoints)
        self.saved_step = self.step
        return path

    def resume(self) -> Path | None:
        """Continue from the checkpoint `load_run_inputs` found and checked (trainer.resume); its path, or None."""
        found = self.inputs.resume
        if found is None:
            return None
        self.sampler.load_state_dict(found.state["sampler"])
        self.workers.load_trainer_states(found.state["workers"], found.adapter)
        if self.distill_every and (found.path / DRAFTER_FILE).is_file():
            self.workers.load_drafter_state(torch.load(found.path / DRAFTER_FILE),
                                                              self.rc.rollout.speculative.distill())
        self.step = self.saved_step = int(found.state["step"])
        return found.path

    # ---------------------------------------------------------------------- run
    def run(self) -> list[dict[str, Any]]:
        t = self.rc.trainer
        resumed = self.resume()
        if resumed is not None:
            log.info("resumed from %s (step %d)", resumed, self.step)
        runlog = RunLog(self.run_dir, wandb_mode=self.rc.logging.wandb, project=self.rc.logging.project,
                        run_name=self.rc.logging.run_name, config=self.rc.raw,
                        resume_step=self.step if resumed is not None else None)
        rows: list[dict[str, Any]] = []
        progress = Progress(t.max_steps, self.step, self.rc.logging.progress)
        try:
            self.workers.sync_adapter(self.workers.adapter_state())
            if self.step == 0 and t.eval_before and self.eval_records:
                rows.append({"step": 0, **self.evaluate()})
                runlog.log(rows[-1])
                log.info("step 0  eval acc %.3f (before training)", rows[-1]["eval_accuracy"])
            while self.step < t.max_steps and preempt.requested() is None:
                rows += self._one_step(runlog, progress)
            if self.step < t.max_steps:
                self._stop_preempted()
        finally:
            progress.close()
            runlog.close()
        return rows

    def _stop_preempted(self) -> None:
        """A preemption signal came: make sure a checkpoint holds the last finished step, then stop. Before
        the first step there is nothing to keep (a restart begins again, its rows replacing these)."""
        self.preempted = preempt.requested()
        if self.step > 0 and self.saved_step != self.step:
            self.save()
        log.warning("%s: stopping after step %d/%d (checkpoint %s); a requeued job resumes from it",
                    self.preempted, self.step, self.rc.trainer.max_steps,
                    ckpt.checkpoint_dir(self.ckpt_root, self.step) if self.step else "none: nothing to keep")

    def _one_step(self, runlog: RunLog, progress: Progress) -> list[dict[str, Any]]:
        t = self.rc.trainer
        self.step += 1
        start = time.perf_counter()
        batch, metrics = self.collect()
        rollout_s = time.perf_counter() - start
        rows = []
        if len(batch):
            release = self.rc.rollout.release_memory
            if release:
                self.workers.release_engines()
            t0 = time.perf_counter()
            metrics.update(self.workers.train(batch))
            train_s = time.perf_counter() - t0
            tensors = self.workers.adapter_state()
            if release:
                self.workers.resume_engines()
            metrics["adapter_sync_ms"] = self.workers.sync_adapter(tensors)
        else:
            log.warning("step %d: no group with reward variance; skipping the update", self.step)
            train_s = 0.0
        if self.distill_every and self.step % self.distill_every == 0 and self._step_sequences:
            metrics.update(self.workers.distill_drafter(self._step_sequences, self.rc.rollout.speculative.distill(),
                                                        sample_seed(self.rc.trainer.seed, self.step, -1, 0)))
        self._step_sequences = []
        step_s = time.perf_counter() - start
        metrics.update(step=self.step, rollout_s=rollout_s, train_s=train_s, step_s=step_s,
                       samples_per_s=metrics["groups_sampled"] * self.rc.rollout.samples_per_prompt / step_s)
        row = {"step": self.step, **{k: v for k, v in metrics.items() if k != "step"}}
        rows.append(row)
        if self.step % self.rc.logging.log_every == 0 or self.step == t.max_steps:
            runlog.log(row)
        last = self.step == t.max_steps
        if self.eval_records and ((t.eval_every and self.step % t.eval_every == 0) or last):
            rows.append({"step": self.step, **self.evaluate()})
            runlog.log(rows[-1])
        if (t.save_every and self.step % t.save_every == 0) or last:
            self.save()
        info = f"reward {row['reward_mean']:.3f}"
        if "eval_accuracy" in rows[-1]:
            info += f"  eval acc {rows[-1]['eval_accuracy']:.3f}"
        progress.update(self.step, info)
        # one line a step for logs without a terminal (Slurm, CI, train.log in the run directory)
        log.info("step %d/%d  %s  %.1fs", self.step, t.max_steps, info, step_s)
        return rows

