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
  4. engines resume; the adapter moves into every engine's slot in place (shard to shard from the trainer
     ranks that own each block, or, with rollout.backend=http, as a new version on every server);
     with speculation and rollout.speculative.distill_every, every N steps the engine's drafter is distilled
     on this step's rollouts against the policy with its new adapter (in place: the next rollout drafts
     with it);
  5. a metrics row (with speculation: mean accepted length, draft acceptance, verify tokens, from the
     engines' SpecStats over the step's rollouts); evaluation and an atomic checkpoint at their intervals.

Every sample is one `Sample` record (`miles_k3.data.sample`) from start to end: the driver makes it (prompt
ids and images, label, metadata, its place in its group), the rollout backend fills in the engine's output,
the reward reads it, the driver sets its reward and advantage, and the train batch is the kept samples.

Image prompts (a dataset whose records hold images: `RunInputs.media`): each sampled record's images are
processed by the checkpoint's preprocessor config, its placeholders expanded to XTML blocks, and its features
computed once by the frozen tower + projector; its samples share one `SequenceMedia` (the pads' positions and
the images' `ImageFeatures`), which the engine splices in and the trainer's packed row takes.

A preemption signal (`miles_k3.trainer.preempt`) stops the run between steps: the step in flight finishes,
a checkpoint of it is written (unless its interval just wrote one) and `run` returns with `preempted` set
to the signal's name; the launcher turns that into `Preempted` (the batch files requeue the job on it).

The driver holds one rollout backend and one trainer group (`miles_k3.trainer.backends`): where the engines
and trainer ranks live (this process, other processes, Ray actors) is theirs to know.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from miles_k3.algo import group_advantages, groups_to_refill, nonzero_variance_groups, reward_stats
from miles_k3.data import PromptRecord, PromptSampler
from miles_k3.data.k3_chat import read_reply
from miles_k3.data.sample import Sample, SequenceMedia
from miles_k3.rewards import score
from miles_k3.trainer import checkpoint as ckpt
from miles_k3.trainer import preempt
from miles_k3.trainer.backends import RolloutBackend, TrainerGroup
from miles_k3.trainer.batch import TrainBatch
from miles_k3.trainer.inputs import RunInputs, load_run_inputs
from miles_k3.trainer.resolve import ResolvedConfig
from miles_k3.trainer.rollout_plugin import RolloutJob
from miles_k3.trainer.run_log import Progress, RunLog
from rollout.request import SamplingParams

log = logging.getLogger(__name__)


def spec_metrics(counters: dict[str, int | float]) -> dict[str, float]:
    """A step's speculation metrics from its engine counter differences (`rollout_spec_*`): mean accepted
    length (tokens a row advances per verify: its kept drafts + 1), draft acceptance (kept / verified
    drafts), verify tokens (fed to the verify forwards: anchors + verified drafts). Empty without
    speculation."""
    if "rollout_spec_rows" not in counters:
        return {}
    rows, drafted = counters["rollout_spec_rows"], counters["rollout_spec_drafted"]
    return {
        "spec_accept_len": counters["rollout_spec_emitted"] / rows if rows else float("nan"),
        "spec_draft_acceptance": counters["rollout_spec_accepted"] / drafted if drafted else float("nan"),
        "spec_verify_tokens": rows + drafted,
    }


DRAFTER_FILE = "drafter_state.pt"  # in a checkpoint, with online distillation: the drafter and its optimizer


def sample_seed(run_seed: int, step: int, round_: int, index: int) -> int:
    """A distinct, reproducible engine seed per sample (so a resumed run redraws the same samples)."""
    h = run_seed
    for x in (step, round_, index):
        h = (h * 1_000_003 + x + 1) % (1 << 62)
    return h


class GRPODriver:
    def __init__(
        self,
        rc: ResolvedConfig,
        run_dir: str | Path,
        rollout: RolloutBackend,
        trainer: TrainerGroup,
        inputs: RunInputs | None = None,
    ):
        """`inputs`: what `load_run_inputs(rc, run_dir)` returned, if the caller already read it (else read
        here, without the checkpoint's tensors: the driver holds none)."""
        self.rc, self.rollout, self.trainer = rc, rollout, trainer
        self.run_dir = Path(run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.inputs = inputs or load_run_inputs(rc, run_dir, weights="skip")
        self.tok = self.inputs.tokenizer
        self.sampler = PromptSampler(
            self.inputs.train, shuffle=rc.data.shuffle, seed=rc.data.seed, drop_last=rc.data.drop_last
        )
        self.eval_records = self.inputs.heldout
        self.plugin = self.inputs.plugin
        self.media = self.inputs.media  # None: a text-only run (no vision model, no image code imported)
        self.step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint this driver wrote or resumed
        self.preempted: str | None = None  # the signal that stopped the run early (after its checkpoint)
        spec = rc.rollout.speculative
        self.distill_every = spec.distill_every if spec.drafter is not None else 0
        self._trained_sampler: dict | None = None  # with rollouts ahead: the sampler's state after the trained step
        self._syncs = 0  # adapter syncs of this run (a rollout backend numbers its versions by them)
        self._step_sequences: list[tuple[int, list[int]]] = []  # this step's rollouts, for the distillation

    # ------------------------------------------------------------------ rollouts
    def _params(self, seed: int | None, greedy: bool = False) -> SamplingParams:
        stop = (self.tok.eos_token_id,) if self.rc.rollout.stop_at_eos else ()
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=self.rc.sampling.max_new_tokens, stop_token_ids=stop)
        return dataclasses.replace(self.rc.sampling, stop_token_ids=stop, seed=seed)

    def samples(self, records: list[PromptRecord], n: int) -> list[Sample]:
        """`n` fresh samples of each record, group by group: the prompt as the engine and the trainer read it
        (a record's images encoded once, shared by its samples), the label and metadata the reward reads."""
        out = []
        for g, rec in enumerate(records):
            if not rec.images:
                ids, media = self.tok.encode_prompt(rec.prompt), None
            else:
                ids, images, _ = self.media.encode(rec)
                media = SequenceMedia(tuple(i for i, t in enumerate(ids) if t == self.media.pad_id), tuple(images))
            out += [
                Sample(
                    rec.prompt,
                    label=rec.label,
                    metadata=rec.metadata,
                    group_index=g,
                    sample_index=i,
                    prompt_ids=list(ids),
                    media=media,
                )
                for i in range(n)
            ]
        return out

    def _generate(
        self, records: list[PromptRecord], samples: list[Sample], params: list[SamplingParams]
    ) -> list[Sample]:
        """Each sample's output: the engine's completion, or rollout.fn's turns; its `response` (what the
        reward scores) the decoded output unless the rollout function set it."""
        r = self.rc.rollout
        if r.fn is None:
            samples = self.rollout.generate(samples, params)
        else:
            jobs = [RolloutJob(records[s.group_index], s, p) for s, p in zip(samples, params)]
            samples = self.rollout.plugins().rollout(
                r.fn, jobs, tokenizer=(self.rc.model.tokenizer, self.rc.model.path), client=r.client
            )
        for s in samples:
            if s.response is None:
                read_reply(self.tok, s)  # the decoded output; K3 chat: the response channel, reasoning, tool calls
        return samples

    def collect(self, step: int) -> tuple[TrainBatch, dict[str, float]]:
        """Step `step`'s batch: generate, score, filter and refill until `prompts_per_step` groups carry signal
        (or the refill rounds run out); returns the batch and rollout metrics."""
        r, a = self.rc.rollout, self.rc.algo
        n = r.samples_per_prompt
        kept: list[list[Sample]] = []
        all_rewards: list[float] = []
        lengths: list[int] = []
        failures: dict[str, int] = {}
        groups_seen = groups_flat = all_masked = env_tokens = 0
        counters_before = self.rollout.counters()
        for round_ in range(a.max_refill_rounds + 1 if a.dynamic_sampling else 1):
            records = self.sampler.next_batch(groups_to_refill(len(kept), r.prompts_per_step))
            samples = self.samples(records, n)
            params = [self._params(sample_seed(self.rc.trainer.seed, step, round_, i)) for i in range(len(samples))]
            samples = self._generate(records, samples, params)
            if self.distill_every:  # text sequences only: the drafter's teacher forward takes no image features
                self._step_sequences += [
                    (len(s.prompt_ids), s.prompt_ids + s.output_ids) for s in samples if s.media is None
                ]
            result = score(samples, self.rc.reward, self.plugin)
            for kind, count in result.failure_counts.items():
                failures[kind] = failures.get(kind, 0) + count
            groups_seen += len(records)
            # a response with no token of the policy's (all tool output, or none) carries no gradient: dropped
            trainable = torch.tensor([s.policy_tokens > 0 for s in samples])
            all_masked += int((~trainable).sum())
            env_tokens += sum(len(s.output_ids) - s.policy_tokens for s in samples)
            # failed samples are out of their groups; a group left with fewer than 2 carries no signal
            keep = result.keep & trainable
            group_of = torch.tensor([s.group_index for s in samples])
            signal = nonzero_variance_groups(result.rewards[keep], group_ids=group_of[keep]).tolist()
            signal += [False] * (len(records) - len(signal))  # trailing groups that lost every sample
            for s, reward in zip(samples, result.rewards.tolist()):
                s.reward = reward
            for g in range(len(records)):
                group = [samples[g * n + j] for j in range(n) if bool(keep[g * n + j])]
                all_rewards += [s.reward for s in group]
                lengths += [len(s.output_ids) for s in group]
                if not signal[g]:
                    groups_flat += 1
                    if a.dynamic_sampling or len(group) < 2:
                        continue
                kept.append(group)
            if groups_to_refill(len(kept), r.prompts_per_step) == 0:
                break
        stats = reward_stats(torch.tensor(all_rewards, dtype=torch.float64))
        metrics = {
            "reward_mean": float(stats["reward_mean"]),
            "reward_std": float(stats["reward_std"]),
            "response_len_mean": sum(lengths) / len(lengths) if lengths else float("nan"),
            "groups_sampled": groups_seen,
            "groups_kept": len(kept),
            "groups_zero_variance": groups_flat,
            "samples_dropped": sum(failures.values()),
        }
        metrics.update({f"reward_failures_{k}": v for k, v in failures.items()})
        if r.fn is not None:
            metrics.update(samples_all_masked=all_masked, response_env_tokens_mean=env_tokens / max(1, len(lengths)))
        metrics.update({f"rollout_{k}": v - counters_before[k] for k, v in self.rollout.counters().items()})
        metrics.update(spec_metrics(metrics))
        return self._to_batch(kept), metrics

    def _fresh(self, batch: TrainBatch, metrics: dict[str, float]) -> TrainBatch:
        """The batch without the groups holding a sample more than rollout.max_staleness adapter versions older
        than the policy this step trains (counted); the staleness of what is trained, logged."""
        k = self.rc.rollout.max_staleness

        def age(s: Sample) -> int:  # syncs since the one that drew it (a skipped step syncs none)
            return self._syncs - s.policy_version

        groups: dict[int, list[Sample]] = {}
        for s in batch.samples:
            groups.setdefault(s.group_index, []).append(s)
        kept, stale = [], 0
        for group in groups.values():
            ages = [age(s) for s in group if s.policy_version is not None]
            if ages and max(ages) > k:
                stale += len(group)
                continue
            kept.append(group)
        ages = [age(s) for g in kept for s in g if s.policy_version is not None]
        metrics.update(samples_stale_dropped=stale, policy_staleness_max=max(ages, default=0))
        metrics["policy_staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
        return self._to_batch(kept) if stale else batch

    def _to_batch(self, kept: list[list[Sample]]) -> TrainBatch:
        """The kept groups' samples with their advantages, the groups numbered 0..K-1 in the batch."""
        for g, group in enumerate(kept):
            adv = group_advantages(
                torch.tensor([s.reward for s in group]), len(group), normalize_std=self.rc.algo.normalize_std
            )
            for s, a in zip(group, adv.tolist()):
                s.advantage, s.group_index = a, g
        return TrainBatch([s for group in kept for s in group])

    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts: the fraction of samples whose reward is >= 1 (binary
        verifiable rewards), and the mean reward."""
        recs = self.eval_records
        samples = self._generate(recs, self.samples(recs, 1), [self._params(None, greedy=True)] * len(recs))
        result = score(samples, self.rc.reward, self.plugin)
        rewards = result.rewards[result.keep]
        return {
            "eval_accuracy": float((rewards >= 1.0).float().mean()) if len(rewards) else float("nan"),
            "eval_reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
            "eval_samples": len(recs),
        }

    # --------------------------------------------------------------- checkpoints
    def save(self) -> Path:
        from miles_k3.model.lora_spec import adapter_family
        from miles_k3.model.peft import save_peft

        states = self.trainer.states()
        # the distilled drafter drives which tokens a seeded sample draws: a resumed run needs it back
        drafter = self.rollout.drafter().drafter_state() if self.distill_every else None

        def write(tmp: Path) -> None:
            # in the naming of the base's family (K3's, or transformers' Kimi-Linear), which PEFT loads whole
            # part by part as the ranks' blocks arrive: no process holds the whole adapter
            parts = self.trainer.adapter_parts()
            save_peft(tmp / ckpt.ADAPTER_DIR, parts, self.rc.lora, family=adapter_family(self.inputs.config))
            # with rollouts generated ahead, the sampler as it stood after this step's batch: a resumed run
            # generates the later steps again, with the adapter it resumes
            sampler = self._trained_sampler if self._trained_sampler is not None else self.sampler.state_dict()
            torch.save(
                {"step": self.step, "sampler": sampler, "workers": states, "config": self.rc.raw},
                tmp / ckpt.STATE_FILE,
            )
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
        self.trainer.load_states(found.state["workers"], found.adapter)
        if self.distill_every and (found.path / DRAFTER_FILE).is_file():
            self.rollout.drafter().load_drafter_state(
                torch.load(found.path / DRAFTER_FILE), self.rc.rollout.speculative.distill()
            )
        self.step = self.saved_step = int(found.state["step"])
        return found.path

    # ---------------------------------------------------------------------- run
    def run(self) -> list[dict[str, Any]]:
        t = self.rc.trainer
        resumed = self.resume()
        if resumed is not None:
            log.info("resumed from %s (step %d)", resumed, self.step)
        runlog = RunLog(
            self.run_dir,
            wandb_mode=self.rc.logging.wandb,
            project=self.rc.logging.project,
            run_name=self.rc.logging.run_name,
            config=self.rc.raw,
            resume_step=self.step if resumed is not None else None,
        )
        rows: list[dict[str, Any]] = []
        progress = Progress(t.max_steps, self.step, self.rc.logging.progress)
        ahead = Ahead(self, self.rc.rollout.max_staleness) if self.rc.rollout.max_staleness else None
        finished = False
        try:
            self.rollout.sync_adapter(self.trainer)
            self._syncs = 1  # the backend's version of the adapter the rollouts now draw with
            if self.step == 0 and t.eval_before and self.eval_records:
                rows.append({"step": 0, **self.evaluate()})
                runlog.log(rows[-1])
                log.info("step 0  eval acc %.3f (before training)", rows[-1]["eval_accuracy"])
            if ahead is not None:
                ahead.start()
            while self.step < t.max_steps and preempt.requested() is None:
                rows += self._one_step(runlog, progress, ahead)
            if self.step < t.max_steps:
                self._stop_preempted()
            finished = True
        finally:
            if ahead is not None:  # after a failure: not waiting for the generation in flight
                ahead.stop(wait=finished)
            progress.close()
            runlog.close()
        return rows

    def _stop_preempted(self) -> None:
        """A preemption signal came: make sure a checkpoint holds the last finished step, then stop. Before
        the first step there is nothing to keep (a restart begins again, its rows replacing these)."""
        self.preempted = preempt.requested()
        if self.step > 0 and self.saved_step != self.step:
            self.save()
        log.warning(
            "%s: stopping after step %d/%d (checkpoint %s); a requeued job resumes from it",
            self.preempted,
            self.step,
            self.rc.trainer.max_steps,
            ckpt.checkpoint_dir(self.ckpt_root, self.step) if self.step else "none: nothing to keep",
        )

    def _one_step(self, runlog: RunLog, progress: Progress, ahead: Ahead | None = None) -> list[dict[str, Any]]:
        t = self.rc.trainer
        self.step += 1
        start = time.perf_counter()
        if ahead is None:
            batch, metrics = self.collect(self.step)
            self._trained_sampler = None
        else:  # generated while earlier steps trained: at most rollout.max_staleness versions behind
            batch, metrics, self._trained_sampler = ahead.take(self.step)
            batch = self._fresh(batch, metrics)
        rollout_s = time.perf_counter() - start  # with `ahead`: the time the trainer waited for the batch
        rows = []
        if len(batch):
            # generation ahead goes on while the trainer trains: the servers keep their memory
            release = self.rc.rollout.release_memory and ahead is None
            if release:
                self.rollout.release()
            t0 = time.perf_counter()
            metrics.update(self.trainer.train(batch))
            train_s = time.perf_counter() - t0
            if release:
                self.rollout.resume()
            metrics.update(self.rollout.sync_adapter(self.trainer))
            self._syncs += 1
            if ahead is not None:
                ahead.trained(self.step)
        else:
            if ahead is not None:
                ahead.trained(self.step)
            log.warning("step %d: no group with reward variance; skipping the update", self.step)
            train_s = 0.0
        if self.distill_every and self.step % self.distill_every == 0 and self._step_sequences:
            metrics.update(
                self.rollout.drafter().distill_drafter(
                    self._step_sequences,
                    self.rc.rollout.speculative.distill(),
                    sample_seed(self.rc.trainer.seed, self.step, -1, 0),
                )
            )
        self._step_sequences = []
        step_s = time.perf_counter() - start
        metrics.update(
            step=self.step,
            rollout_s=rollout_s,
            train_s=train_s,
            step_s=step_s,
            samples_per_s=metrics["groups_sampled"] * self.rc.rollout.samples_per_prompt / step_s,
        )
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


class Ahead:
    """Rollouts generated ahead of training (rollout.max_staleness = k > 0): a thread collects step j's batch
    as soon as the trainer has finished step j - 1 - k, so up to k batches wait (or are being generated) while
    the trainer trains; each sample carries the adapter version that generated it (`Sample.policy_version`).
    The driver takes batches in step order (`take`) and reports each update (`trained`). A failure in the
    thread is raised by the next `take`. Each batch comes with the sampler's state after it, which a checkpoint
    saves: a resumed run generates the steps after it again."""

    def __init__(self, driver: GRPODriver, k: int):
        import queue
        import threading

        self.driver, self.k = driver, k
        self.done = driver.step  # updates finished
        self.ready: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._produce, name="rollouts-ahead", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _produce(self) -> None:
        d = self.driver
        try:
            for j in range(self.done + 1, d.rc.trainer.max_steps + 1):
                with self.cond:  # step j waits for the update j - 1 - k
                    self.cond.wait_for(lambda j=j: self.stopping or self.done >= j - 1 - self.k)
                    if self.stopping:
                        return
                start = time.perf_counter()
                batch, metrics = d.collect(j)
                metrics["rollout_generate_s"] = time.perf_counter() - start
                self.ready.put((j, batch, metrics, d.sampler.state_dict()))
        except BaseException as e:  # noqa: BLE001 - handed to the driver's thread
            self.ready.put((None, e, None, None))

    def take(self, step: int) -> tuple[TrainBatch, dict[str, float], dict]:
        j, batch, metrics, sampler = self.ready.get()
        if j is None:
            raise batch
        assert j == step, (j, step)
        return batch, metrics, sampler

    def trained(self, step: int) -> None:
        with self.cond:
            self.done = step
            self.cond.notify_all()

    def stop(self, wait: bool = True) -> None:
        """Stop producing; `wait`: for the batch being generated to end (the thread is a daemon: a failing run
        leaves it behind)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if wait and self.thread.ident is not None:
            self.thread.join(timeout=600)
