"""rollgym's policy-gradient trainer (`grpo`): the plan's objective (`objectives.py`; the built-ins in
`grpo_loss.py`) on torch + PEFT, one long-lived model with its optimizer, LR schedule and RNG state,
checkpointed after every step.

    trainer = PolicyTrainer(GRPOConfig.model_validate(args), base_model="bundled")
    trainer.restore(previous_adapter_or_checkpoint)     # or start fresh
    metrics = trainer.train_records(groups)             # one optimizer step per batch of groups
    trainer.save_checkpoint(step_dir / "checkpoint")    # adapter or weights + optimizer + scheduler + step

The records are `curation.to_groups` groups: every rollout with its exact `sequence` (prompt ids,
completion ids, completion_mask, sampling logprobs), its `advantage` (used as it is: the batch
computed it once) and the `sampling` it was generated under. The trainer computes its logprobs under
that temperature; rollouts whose sampling distribution it cannot rebuild are refused by name
(`grpo_batch`, the sampling contract).
Tokens a grammar forced (`completion_forced`) and environment tokens are not in the loss; tokens sampled
under a grammar (`completion_constrained`) have no teacher term (grpo_loss).

Data parallel: started under torchrun (WORLD_SIZE > 1) the trainer joins the process group (gloo on
CPU, nccl on GPUs), wraps a LoRA model in DDP and shards full weights with FSDP2 (`fully_shard` per
decoder layer; over several nodes HSDP), and each process takes its share of a batch split by tokens
(`token_shards`), computing π_old and the reference logprobs for those only. The loss scales are computed
over the whole batch first, so 1 and N processes take the same step.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from rollgym.matmul_precision import fp32_matmuls, trainer_fp32_matmuls

from .base import TrainingFailed
from .distributed import DistInfo
from .grpo_batch import (
    TrainSequence, mini_batch_parts, rollout_keys, sampling_temperature, sequences_of, token_shards,
)
from .grpo_checkpoint import STATE_FILE, checkpoint_of, not_resumable, restore, save, save_serving, settle
from .grpo_config import GRPOConfig
from .grpo_loss import policy_loss, sequence_scales
from .lr_schedule import lr_schedule
from .packed_attention import segment_boundaries, use_varlen
from .sharding import full_model, receive_weights, shard, whole_weights
from .step_settings import ModelShape, StepSettings, device_memory, step_settings
from .token_logprobs import decoder_layers, token_logprobs_module


def model_shape(model: Any) -> ModelShape:
    """Parameters (a PEFT model's base and adapter), hidden size and layers of a causal LM."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = causal.config.get_text_config() if hasattr(causal.config, "get_text_config") else causal.config
    return ModelShape(sum(p.numel() for p in model.parameters()), int(config.hidden_size),
                      int(config.num_hidden_layers))


def combined(steps: list[dict[str, float]]) -> dict[str, float]:
    """Several optimizer steps' metrics as one: each one's mean, except `skipped_steps` (summed) and the
    `_min` and `_max` ones (the least and the most)."""
    out = {}
    for key in steps[0]:
        values = [step[key] for step in steps]
        out[key] = (min(values) if key.endswith("_min") else max(values) if key.endswith("_max")
                    else sum(values) if key == "skipped_steps" else sum(values) / len(values))
    return out


class PolicyTrainer:
    """The model, its optimizer and schedule, across every step of a run."""

    def __init__(self, args: GRPOConfig, base_model: str, seed: int = 0) -> None:
        import torch

        self.args = args
        self.base_model = base_model
        self.seed = seed
        self.dist = DistInfo()
        self.dist.init()
        if args.threads:
            torch.set_num_threads(args.threads)
        self.device = self.dist.device
        self.precision = args.precision_on(self.device.type)
        # Set around each step, not for the process: a co-located fp32 server shares it (matmul_precision).
        self.fp32_matmuls = trainer_fp32_matmuls(self.device.type, args.precision)
        # compile and the micro-batch's tokens: the plan's, else the device's defaults (set in use_model).
        self.settings = StepSettings(bool(args.compile), args.micro_batch_tokens or 4096, "before use_model")
        self.step = 0
        self.checkpoint: str | None = None  # the state this trainer holds, as a checkpoint folder or adapter
        self.model: Any = None
        self.module: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.base_weights: dict[str, Any] = {}
        self.sharded = False
        self.varlen = False
        self.background: Any = None  # a checkpoint being written (grpo_checkpoint.Background)
        self.unsaved: Path | None = None  # the last step's folder, when it was between checkpoints

    # ------------------------------------------------------------------ model and state

    def load(self, init: str | None) -> None:
        """Build the model: from a checkpoint folder (adapter/ or model/ + trainer state: everything is
        restored), a PEFT adapter folder (a fresh optimizer), or the base model."""
        import torch

        from .policy import load_base, load_policy

        started = time.perf_counter()
        if why := not_resumable(init):
            raise TrainingFailed(why)
        checkpoint = checkpoint_of(init)
        random.seed(self.seed)
        torch.manual_seed(self.seed)
        if self.args.finetune == "full":
            source = str(Path(checkpoint) / "model") if checkpoint else init
            model = full_model(source or self.base_model, self.dist)  # sharded: rank 0 alone reads it
            if self.dist.rank == 0:
                base, _ = load_base(self.base_model) if source else (model, None)
                self.base_weights = {n: p.detach().clone() for n, p in base.named_parameters()}
        else:
            adapter = str(Path(checkpoint) / "adapter") if checkpoint else init
            model, _ = load_policy(self.base_model, adapter, self.args.lora)
        self.use_model(model, from_rank0=self.args.finetune == "full" and self.dist.distributed)
        if checkpoint:
            self._restore_state(Path(checkpoint))
        self.checkpoint = init
        self.load_s = round(time.perf_counter() - started, 3)

    def use_model(self, model: Any, from_rank0: bool = False) -> None:
        """Train `model` (a causal LM; a PEFT model for finetune: lora) from a fresh optimizer and schedule:
        placed on this process's device and wrapped for data parallelism. `load` calls it; a benchmark
        gives it a randomly initialised model. `from_rank0` (full weights over several processes): rank 0's
        weights are every process's, the others' model being on the meta device (`sharding.full_model`)."""
        import torch

        # Full weights over several processes are sharded (FSDP2 moves each unit to the device as it
        # shards it); a LoRA's few weights are replicated (DDP).
        self.sharded = self.dist.distributed and self.args.finetune == "full"
        if not self.sharded:
            model.to(self.device)
        if self.args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        self.model = model
        # Packed rows in bf16 on a GPU: flash attention's varlen kernel, rollout by rollout (packed_attention).
        self.varlen = (self.args.seq_len is not None and self.device.type == "cuda" and self.precision == "bf16"
                       and use_varlen(model))
        module = token_logprobs_module()(model, self.precision)
        self.settings = step_settings(self.device.type, device_memory(self.device), model_shape(model),
                                      self.args.finetune, self.args.compile, self.args.micro_batch_tokens)
        if self.settings.compile:  # layer by layer, before sharding, as torchtitan does: one graph reused N times
            for layer in decoder_layers(module.causal()):
                layer.compile(dynamic=True)
        if self.sharded:  # each decoder layer, then the rest; over several nodes HSDP (DistInfo.mesh)
            weights = whole_weights(module, self.dist) if from_rank0 else {}
            shard(module, module.causal(), self.dist, self.precision)
            if from_rank0:
                receive_weights(module, weights, self.dist)
        elif self.dist.distributed:
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module, device_ids=[self.dist.local_rank] if self.device.type == "cuda"
                                             else None)
        self.module = module
        self.gathered: dict[str, Any] | None = None  # sharded: the full weights of the last checkpoint (rank 0)
        params = [p for p in model.parameters() if p.requires_grad]
        # Fused on CUDA: one kernel for every weight's update instead of a dozen elementwise ones each.
        self.optimizer = torch.optim.AdamW(params, lr=self.args.learning_rate, betas=self.args.betas,
                                           weight_decay=self.args.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = lr_schedule(self.optimizer, self.args)
        self.step = 0

    def save_checkpoint(self, folder: Path, background: bool = False) -> Path:
        """adapter/ (LoRA) or model/ (full weights) + trainer_state.pt (grpo_checkpoint.save); sharded, with
        `background`, AdamW's shards are written while the trainer goes on."""
        return save(self, Path(folder), background)

    def save_serving(self, folder: Path) -> Path:
        """A step between checkpoints (`checkpoint_every`): what serving reads only; `finish` checkpoints it
        if it is the last."""
        self.unsaved = Path(folder)
        return save_serving(self, Path(folder), self.args.checkpoint_every)

    def finish(self) -> None:
        """Before the trainer stops: its last step checkpointed if it was between checkpoints, and every write
        in place."""
        if self.unsaved is not None:
            self.save_checkpoint(self.unsaved)
        settle(self)

    def _restore_state(self, folder: Path) -> None:
        restore(self, Path(folder))

    def merged_deltas(self) -> dict[str, Any]:
        """What `gguf_export.write_merged_gguf` adds to the base GGUF: LoRA deltas, or weights − base."""
        from .gguf_export import lora_deltas

        if self.args.finetune == "lora":
            return lora_deltas(self.model)
        deltas = {}
        weights = self.gathered if self.sharded else dict(self.model.named_parameters())
        for name, param in (weights or {}).items():
            base = self.base_weights.get(name)
            # lm_head is listed only when untied (named_parameters lists a tied weight once, as the embedding).
            if base is not None and name.endswith(".weight"):
                delta = (param.detach().cpu().float() - base.float()).numpy()
                if delta.any():
                    deltas[name.removesuffix(".weight")] = delta
        return deltas

    # ------------------------------------------------------------------ training

    def train_records(self, groups: list[dict[str, Any]], progress: Any = None) -> dict[str, float]:
        """Train on curated groups: `epochs` passes, `groups_per_step` groups per batch, one optimizer
        step per batch (or `mini_batches`); returns the steps' metrics, averaged. `progress` (a
        progress.ProgressWriter) hears of each optimizer step: its number of all, loss, tokens so far."""
        with fp32_matmuls(self.fp32_matmuls):
            return self._train_records(groups, progress)

    def _train_records(self, groups: list[dict[str, Any]], progress: Any) -> dict[str, float]:
        args = self.args
        by_group = sequences_of(groups, args.temperature)
        if not by_group:
            raise TrainingFailed("no groups to train on")
        order = list(range(len(by_group)))
        per_step = args.groups_per_step or len(order)
        passes = max(1, math.ceil(args.epochs))
        batches: list[list[TrainSequence]] = []
        generator = random.Random(self.seed + self.step)
        for _ in range(passes):
            generator.shuffle(order)
            for start in range(0, len(order), per_step):
                batches.append([seq for g in order[start:start + per_step] for seq in by_group[g]])
        batches = batches[: max(1, math.ceil(args.epochs * math.ceil(len(order) / per_step)))]
        old = None
        if len(batches) > math.ceil(len(order) / per_step) or args.mini_batches > 1:
            # Data used more than once: π_old is the policy before this call's first update, computed
            # once (as verl's old_log_prob), so the clip acts on the passes that re-use it.
            # Each process computes it for the sequences its own steps take, over every pass.
            rollouts = [seq for group in by_group for seq in group]
            needed = {id(batch[i]) for batch in batches for i in self._own(batch)}
            own = [k for k, seq in enumerate(rollouts) if id(seq) in needed]
            computed = self._logprobs_no_grad(rollouts, own)
            old = {id(rollouts[k]): computed[k] for k in own}
        total = len(batches) * args.mini_batches
        done = {"steps": 0, "tokens": 0.0}

        def report(step: dict[str, float]) -> None:
            done["steps"] += 1
            done["tokens"] += step["tokens"]
            if progress is not None and self.dist.rank == 0:
                progress.update(done["steps"], total, step["loss"], done["tokens"])

        history = [self.train_batch(batch, old, report) for batch in batches]
        return combined(history) | {"steps": float(len(history)), "optimizer_step": float(self.step)}

    def train_batch(self, batch: list[TrainSequence], old_logprobs: dict[int, Any] | None = None,
                    report: Any = None) -> dict[str, float]:
        """`mini_batches` optimizer steps on one batch (default one). The PPO ratio's π_old: the given
        logprobs (by `id` of each sequence: computed once when the data is used more than once), else the
        policy at the start of the batch: taken from the same forward pass when there is one step (the
        ratio is then 1, with the gradient of log π), computed without gradient when there are more."""
        with fp32_matmuls(self.fp32_matmuls):
            return self._train_batch(batch, old_logprobs, report)

    def _train_batch(self, batch: list[TrainSequence], old_logprobs: dict[int, Any] | None,
                     report: Any) -> dict[str, float]:
        if not any(seq.loss_tokens for seq in batch):
            raise TrainingFailed("a batch with no token the policy sampled (every token the environment's or forced)")
        if self.args.loss.teacher_tau > 0 and any(seq.teacher_logprobs is None for seq in batch):
            raise TrainingFailed("loss.teacher_tau > 0, but a rollout has no teacher_logprobs: name a teacher for "
                                 "the stage (stages[i].teacher), which scores every trained token")
        count = self.args.mini_batches
        own = self._own(batch)  # π_old and the reference: this process's shard only
        if old_logprobs is not None:
            old = [old_logprobs.get(id(seq)) for seq in batch]
        else:
            old = self._logprobs_no_grad(batch, own) if count > 1 else None
        ref = self._reference_logprobs(batch, own) if self.args.loss.kl_beta > 0 else None
        results = []
        for part in mini_batch_parts(batch, count):
            if not any(batch[i].loss_tokens for i in part):
                continue
            results.append(self._optimizer_step([batch[i] for i in part],
                                                [old[i] for i in part] if old is not None else None,
                                                [ref[i] for i in part] if ref is not None else None))
            if report is not None:
                report(results[-1])
        return combined(results)

    def _micro_batches(self, indices: list[int], batch: list[TrainSequence]) -> list[list[int]]:
        out: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for i in indices:
            if current and tokens + batch[i].length > self.settings.micro_batch_tokens:
                out.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += batch[i].length
        if current:
            out.append(current)
        return out

    def _rows(self, sequences: list[TrainSequence]) -> list[list[int]]:
        """Which sequences share a row: one each, or with `seq_len` packed first-fit in order into rows of
        at most seq_len tokens (a longer rollout gets a row of its own)."""
        capacity = self.args.seq_len
        if capacity is None:
            return [[k] for k in range(len(sequences))]
        rows: list[list[int]] = []
        fill: list[int] = []
        for k, seq in enumerate(sequences):
            row = next((r for r, used in enumerate(fill) if used + seq.length <= capacity), None)
            if row is None:
                rows.append([k])
                fill.append(seq.length)
            else:
                rows[row].append(k)
                fill[row] += seq.length
        return rows

    def _tensors(self, sequences: list[TrainSequence]) -> dict[str, Any]:
        """The micro-batch's ids in rows, the flat positions whose hidden state predicts each loss token,
        and per loss token: its target id, temperature, sampling logprob, rollout number in the
        micro-batch (the order of `sequences`), advantage. One rollout per row: right-padded with an
        attention mask. Packed (`seq_len`): several per row, position ids restarting at 0 with each
        rollout and no attention mask, from which the model builds a block-diagonal causal mask
        (transformers' packed-sequence masks; flash-attention's varlen kernels), so no rollout
        attends to another."""
        import torch

        rows = self._rows(sequences)
        packed = self.args.seq_len is not None
        width = max(sum(sequences[k].length for k in row) for row in rows)
        ids, attention, position_ids = [], [], []
        start = [0] * len(sequences)  # where each sequence begins in the flattened rows
        for number, row in enumerate(rows):
            row_ids: list[int] = []
            row_positions: list[int] = []
            for k in row:
                start[k] = number * width + len(row_ids)
                row_ids += sequences[k].prompt_ids + sequences[k].completion_ids
                row_positions += list(range(sequences[k].length))
            pad = width - len(row_ids)
            ids.append(row_ids + [0] * pad)
            attention.append([1] * len(row_ids) + [0] * pad)
            position_ids.append(row_positions + list(range(pad)))  # the padding: a segment of its own
        # Loss tokens in the order of `sequences`, whatever rows they were packed into.
        positions, targets, temperatures, sampled, rollout, advantages, teacher = [], [], [], [], [], [], []
        for k, seq in enumerate(sequences):
            for j, (token, keep) in enumerate(zip(seq.completion_ids, seq.loss_mask)):
                if keep:
                    positions.append(start[k] + len(seq.prompt_ids) + j - 1)
                    targets.append(token)
                    sampled.append(seq.sampling_logprobs[j])
                    rollout.append(k)
                    temperatures.append(seq.temperature)
                    advantages.append(seq.advantage if seq.token_advantages is None else seq.token_advantages[j])
                    if seq.teacher_logprobs is not None:
                        teacher.append(seq.teacher_logprobs[j])
        # Made on the host and sent to the model's device: from pinned memory without blocking on a GPU, so
        # building the next micro-batch does not wait for the last one's kernels.
        device = self.device

        def put(values: list[Any], dtype: Any) -> Any:
            host = torch.tensor(values, dtype=dtype, device="cpu")
            return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

        segments = None
        if packed and self.varlen:
            cu_seq_lens, longest = segment_boundaries([[sequences[k].length for k in row] for row in rows], width)
            segments = (put(cu_seq_lens, torch.int32), longest)
        return {"input_ids": put(ids, torch.long),
                "attention_mask": None if packed else put(attention, torch.long),
                "position_ids": put(position_ids, torch.long) if packed else None, "segments": segments,
                "positions": put(positions, torch.long), "targets": put(targets, torch.long),
                "temperatures": put(temperatures, torch.float32), "sampled": put(sampled, torch.float32),
                "rollout": put(rollout, torch.long), "rollout_list": rollout,
                "advantages": put(advantages, torch.float32),
                "teacher": put(teacher, torch.float32) if len(teacher) == len(targets) else None}

    def _forward(self, tensors: dict[str, Any], module: Any = None) -> Any:
        return (module or self.module)(tensors["input_ids"], tensors["attention_mask"], tensors["positions"],
                                       tensors["targets"], tensors["temperatures"], tensors["position_ids"],
                                       tensors["segments"])

    def _own(self, batch: list[TrainSequence]) -> list[int]:
        """The indices of the sequences of `batch` this process's optimizer steps take (its shard of each
        mini-batch part: `_shard`), in order."""
        return sorted(i for part in mini_batch_parts(batch, self.args.mini_batches) for i in self._shard(batch, part))

    def _shard(self, batch: list[TrainSequence], indices: list[int]) -> list[int]:
        """This process's share of `indices` (the sequences with loss tokens among them): a split by tokens
        (`token_shards`), which every process computes alike."""
        wanted = [i for i in indices if batch[i].loss_tokens]
        if not self.dist.distributed:
            return wanted
        shards = token_shards([batch[i].length for i in wanted], self.dist.world)
        return [wanted[k] for k in shards[self.dist.rank]]

    def _logprobs_no_grad(self, batch: list[TrainSequence], indices: list[int] | None = None) -> list[Any]:
        """Per sequence of `indices` (default: every one; the others are left empty), the current policy's
        logprobs of its loss tokens (no gradient), computed in the step's micro-batches and left on the
        device. Over several processes each computes its own shard only: a replicated (DDP) model runs its
        inner module, with no collective; a sharded one (FSDP gathers each layer's weights in every forward)
        runs as many passes as the busiest process, the extra ones discarded."""
        import torch

        out = [torch.zeros(0, device=self.device)] * len(batch)
        wanted = [i for i in (range(len(batch)) if indices is None else indices) if batch[i].loss_tokens]
        micro = self._micro_batches(wanted, batch)
        passes = list(micro)
        if self.sharded:
            filler = next(i for i, seq in enumerate(batch) if seq.loss_tokens)
            passes += [[filler]] * (int(self.dist.all_max([float(len(micro))])[0]) - len(micro))
        module = getattr(self.module, "module", self.module) if self.dist.distributed and not self.sharded else None
        with torch.no_grad(), fp32_matmuls(self.fp32_matmuls):
            for number, indices_ in enumerate(passes):
                logprobs = self._forward(self._tensors([batch[i] for i in indices_]), module).detach()
                if number < len(micro):
                    for i, part in zip(indices_, logprobs.split([batch[i].loss_tokens for i in indices_])):
                        out[i] = part
        return out

    def _reference_logprobs(self, batch: list[TrainSequence], indices: list[int] | None = None) -> list[Any]:
        """The reference model's logprobs (the base: the LoRA switched off) for the KL term."""
        if self.args.finetune != "lora":
            raise TrainingFailed("loss.kl_beta > 0 needs finetune: lora (the base model is the reference)")
        with self.model.disable_adapter():
            return self._logprobs_no_grad(batch, indices)

    def _optimizer_step(self, batch: list[TrainSequence], old: list[Any] | None,
                        ref: list[Any] | None) -> dict[str, float]:
        import torch

        args = self.args
        dist = self.dist
        scales = sequence_scales([s.loss_tokens for s in batch], args.loss, rollout_keys(batch))
        mine = self._shard(batch, list(range(len(batch))))
        micro = self._micro_batches(mine, batch)
        # Every process runs as many forward/backward passes as the busiest one (FSDP gathers weights
        # in each forward, DDP reduces in the last backward): the extra ones count for nothing (scale 0).
        rounds = int(dist.all_max([float(len(micro))])[0])
        filler = next(i for i in range(len(batch)) if batch[i].loss_tokens)
        passes = [(indices, False) for indices in micro] + [([filler], True)] * (rounds - len(micro))
        # Measured on the device and read once after the loop: reading a value inside it would wait for
        # the GPU at every micro-batch. The objective's statistics summed, then the loss, Σ |log π_old −
        # log μ| and the tokens it compares; its `_min` and `_max` ones also reduced by min and max.
        objective = args.loss.impl
        names = objective.statistics
        sums = torch.zeros(len(names) + 3, dtype=torch.float64, device=self.device)
        extremes = {name: torch.full((), math.inf if name.endswith("_min") else -math.inf, dtype=torch.float64,
                                     device=self.device) for name in names if name.endswith(("_min", "_max"))}
        tokens = rollouts = 0
        for number, (indices, dummy) in enumerate(passes):
            sequences = [batch[i] for i in indices]
            tensors = self._tensors(sequences)
            token_scales = torch.tensor([0.0 if dummy else scales[indices[r]] for r in tensors["rollout_list"]],
                                        dtype=torch.float32, device="cpu")
            if self.device.type == "cuda":
                token_scales = token_scales.pin_memory().to(self.device, non_blocking=True)
            last = number == len(passes) - 1
            sync = nullcontext()
            if self.sharded:
                self.module.set_requires_gradient_sync(last)
            elif dist.distributed and not last:
                sync = self.module.no_sync()
            with sync:
                logprobs = self._forward(tensors)
                # A filler pass (scale 0) may be of another process's sequence: no π_old or reference here.
                old_lp = (torch.cat([old[i] for i in indices]).to(self.device) if old is not None and not dummy
                          else logprobs.detach())
                ref_lp = (torch.cat([ref[i] for i in indices]).to(self.device) if ref is not None and not dummy
                          else None)
                # A grammar-restricted token has no sampling logprob to compare (behaviour_logprobs): π_old's own.
                unratioed = torch.isnan(tensors["sampled"])
                sampled = torch.where(unratioed, old_lp, tensors["sampled"])
                terms = policy_loss(logprobs, old_lp, sampled, tensors["advantages"], tensors["rollout"],
                                    token_scales, args.loss, ref_lp, rollouts=len(indices),
                                    teacher_logprobs=tensors["teacher"])
                # DDP averages gradients over processes; the scales already divide by the whole batch.
                (terms.loss * dist.world).backward()
            if dummy:
                continue
            with torch.no_grad():
                gap = (old_lp - sampled).abs().sum().double()
                compared = (~unratioed).sum().double()
                sums += torch.cat([terms.stats, terms.loss.detach().double()[None], gap[None], compared[None]])
                for name, extreme in extremes.items():
                    pick = torch.minimum if name.endswith("_min") else torch.maximum
                    extremes[name] = pick(extreme, terms.stats[names.index(name)])
            tokens += terms.tokens
            rollouts += len(indices)
        summed = [name for name in names if name not in extremes]
        values = sums.tolist()
        measured = dict(zip(names, values))
        *totals, loss, gap_sum, gap_tokens, tokens, rollouts = dist.all_sum(
            [measured[name] for name in summed] + values[-3:] + [float(tokens), float(rollouts)])
        named = dict(zip(summed, totals))
        for name, extreme in extremes.items():
            named[name] = (dist.all_min if name.endswith("_min") else dist.all_max)([float(extreme)])[0]
        if args.max_logprob_gap is not None and gap_tokens and gap_sum / gap_tokens > args.max_logprob_gap:
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingFailed(
                f"the served model's sampling logprobs differ from the trainer's by {gap_sum / gap_tokens:.3f} per "
                f"token on average (max_logprob_gap {args.max_logprob_gap}): the rollouts were not sampled from "
                "these weights (a quantized or stale model is serving)")
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm or math.inf)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: a DTensor
        lr = self.scheduler.get_last_lr()[0]
        # A NaN or inf gradient is not applied (nor counted as a step, nor then checkpointed): every
        # process sees the same all-reduced norm, so all skip together.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        unratioed = tokens - gap_tokens
        tokens = max(tokens, 1.0)
        # The teacher's measure, where the objective counts it: Σ (log π_θ − log π_T) over the tokens it taught.
        taught = ({"teacher_kl": named["teacher_kl_sum"] / max(named["teacher_tokens"], 1.0),
                   "teacher_tokens": named["teacher_tokens"]}
                  if batch[0].teacher_logprobs and {"teacher_kl_sum", "teacher_tokens"} <= set(named) else {})
        return ({"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens, "rollouts": rollouts}
                | objective.metrics(named, tokens)
                | {"logprob_gap_mean": gap_sum / max(gap_tokens, 1.0), "unratioed_tokens": unratioed,
                   "skipped_steps": float(skipped)} | taught)


__all__ = ["DistInfo", "PolicyTrainer", "STATE_FILE", "TrainSequence", "checkpoint_of", "combined", "decoder_layers",
           "mini_batch_parts", "rollout_keys", "sampling_temperature", "sequences_of"]
