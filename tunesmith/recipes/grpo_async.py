"""Asynchronous GRPO: the ``grpo`` recipe with its rollouts sampled and scored by Ray workers
while the trainer trains (see :mod:`tunesmith.rl.asynchronous.pipeline`).

    tunesmith run grpo_async --config tiny model_dir=path/to/model prompts.source=prompts.jsonl
    tunesmith run grpo_async --config tiny ... async_mode=off_policy max_staleness=2

Ray starts in this process (nothing to start by hand), or the run joins a cluster with
``ray.address=auto``. Each step:

1. the rollout workers sample ``group_size`` answers to the step's prompts with a policy at
   most ``lead`` updates old (``async_mode``: ``sync`` 0, ``overlap`` one batch,
   ``off_policy`` ``max_staleness``), tagged with its version; reward workers score them and
   add the reference's log-probs; groups wait in the replay buffer;
2. the trainer takes the step's groups (staler ones are sampled again), computes its own
   log-probs of the sampled tokens and makes GRPO's update (``updates_per_batch`` of them);
3. the new weights go to the rollout workers (Ray's object store, or a broadcast from rank 0
   with ``rollout.weight_sync: collective``), with the new version.

The trainer's ranks (``trainer_group``) are this process's or torchrun's (``launcher:
torchrun``, the default: ``--nproc-per-node`` for FSDP2/TP, as in ``grpo``), or Ray actors
(``launcher: ray``: this process drives ``trainer_group.workers`` trainer actors of
``num_cpus``/``num_gpus`` each, with the same process group, ``parallelism`` and checkpoints;
rank 0's output on this console, every rank's in ``<output_dir>/logs/trainer-group-*``; see
:mod:`tunesmith.rl.asynchronous.trainer_group`)::

    tunesmith run grpo_async --config tiny ... trainer_group.launcher=ray trainer_group.workers=2

Logged besides ``grpo``'s: ``staleness_mean``/``_max``, the histogram ``staleness_<k>_groups``,
``wait_s`` (trainer idle), ``weight_sync_s``, ``weight_sync_mb``, ``buffer_groups``,
``dropped_stale``, ``requeued_groups``, ``worker_restarts``, ``samples_per_s``, ``refill_rounds``;
``<output_dir>/rollouts.jsonl`` lists the groups of every batch with the policy version that
sampled each and its mean reward.
"""

from __future__ import annotations

from omegaconf import DictConfig

from tunesmith.recipes import grpo
from tunesmith.rl.asynchronous.trainer_group import (
    check_launch as check_launch,  # read by `tunesmith run`
)
from tunesmith.rl.asynchronous.trainer_group import run_trainers
from tunesmith.training.rules import choice

RUNTIME_ARGS = grpo.RUNTIME_ARGS
RUNTIME_KWARGS = grpo.RUNTIME_KWARGS
KEYS = grpo.KEYS
RULES = {**grpo.RULES, "async_mode": choice("sync", "overlap", "off_policy")}


def main(cfg: DictConfig) -> None:
    run_trainers(grpo.train, cfg, KEYS, RULES)  # this process's ranks, or Ray actors
