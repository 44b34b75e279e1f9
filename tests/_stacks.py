"""torchtitan and Lightning driving fsdp_compose and torch's FSDP2 on the same
script, 2 gloo ranks on CPU (tests/test_stacks.py; ``python -m tests._stacks``
prints the table). ``fsdp_compose.use_as_fsdp2()`` is the only difference
between the two implementations; every shim below is applied to both, and each
says why torch's FSDP2 needs it on this machine too.

* torchtitan (0.3): its llama3 debug model through its own ``Trainer`` (built on
  meta, sharded by its ``parallelize_llama``, ``init_weights`` after sharding,
  its clipping and ``set_gradient_divide_factor(1.0)``), started from its own
  seed checkpoint (``create_seed_checkpoint``, one rank, no sharding: the same
  weights for both implementations whatever their shards' random draws), a
  checkpoint through its ``CheckpointManager`` at step TITAN_SAVE_AT, and a
  fresh ``Trainer`` that resumes from it.
* Lightning (2.6): ``ModelParallelStrategy`` with a ``LightningModule`` whose
  ``configure_model`` calls ``fully_shard``; ``trainer.save_checkpoint`` at the
  end of epoch LIT_SAVE_AT and a fresh Trainer and module that
  ``fit(..., ckpt_path=)``, in both of the strategy's checkpoint formats.

Every worker catches its own exception and returns its text (the stage it
reached, the error, the traceback), so that a failing implementation is a row
of the table and not a hung or aborted launch.

torchtitan 0.3.0 is not in the test extra (pyproject.toml says why); without
its dependency pins, next to transformers::

    pip install --no-deps torchtitan==0.3.0 datasets==4.7.0 dill==0.4.0 \
        multiprocess==0.70.18 xxhash pyarrow pandas python-dateutil tzdata httpx \
        httpcore sniffio
    pip install torchdata torch_checkpointing tyro einops spmd_types==0.2.3 \
        tensorboard "torch==<the installed one>"

The launches run in a driver process forked from the caller (``launches``):
it imports the stacks' heavy dependencies once before forking the ranks (each
rank would otherwise spend seconds importing them), and the caller (pytest's
process, whose later forks carry what it imported) imports none of them.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch

# ---------------------------------------------------------------------------
# torchtitan
# ---------------------------------------------------------------------------

TITAN_STEPS, TITAN_SAVE_AT = 4, 2
TITAN_SEQ, TITAN_BATCH = 32, 2
TITAN_LAYERS = 2  # of the debug model's 6 (its widths unchanged): CPU time


_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _stub_triton_kernels() -> None:
    """Shim (both implementations): torchtitan's dense models import, through
    its MoE token dispatcher, ``torchtitan.distributed.minimal_async_ep.kernels``,
    which does ``import triton`` at import time; torch's CPU build has no
    triton. That one module is replaced by a stub whose kernels raise if called
    (only expert-parallel MoE calls them). ``triton`` itself is not faked: torch
    asks whether it is importable and would then take CPU code paths that need
    the real one."""
    import types

    if _TRITON_KERNELS in sys.modules:
        return
    mod = types.ModuleType(_TRITON_KERNELS)

    def kernel(name):
        def run(*a, **k):
            raise RuntimeError(f"{name}: a triton kernel (stubbed: no triton on CPU)")
        return run
    for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
                 "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
                 "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(mod, name, kernel(name))
    sys.modules[_TRITON_KERNELS] = mod


def import_titan():
    """Import torchtitan with the import-time shims; return its modules."""
    _stub_triton_kernels()
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.llama3.config_registry as registry
    import torchtitan.tools.utils as tutils
    import torchtitan.trainer as trainer
    from torchtitan.hf_datasets import text_datasets
    return dict(trainer=trainer, registry=registry, tutils=tutils, metrics=metrics,
                dist_utils=dist_utils, parallel_dims=parallel_dims,
                text_datasets=text_datasets)


class _CpuDeviceModule:
    """Shim (both implementations): torchtitan picks its device at import,
    ``_get_available_device_type() or "cuda"``, so on a machine without an
    accelerator it is "cuda" and its device module ``torch.cuda``. The test sets
    both to CPU: ``torch.cpu``, with the memory-statistics calls its metrics make
    on every device module (``get_device_name``, ``get_device_properties``,
    ``memory_stats``, ...) answered with zeros, and ``current_device`` an index
    as for any accelerator."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device():
        return 0  # an index (torch.cpu's is the string "cpu"; barrier(device_ids=) wants ints)

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        import types
        return types.SimpleNamespace(total_memory=1, name="cpu")

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass


_DIVIDE_FACTOR_UNITS: list = []  # (in a rank) units torchtitan set a divide factor of 1.0 on


def _titan_shims(m: dict) -> None:
    """Every CPU shim, on the torchtitan modules imported by ``import_titan``;
    each is needed by torch's FSDP2 as much as by ours."""
    import torch.distributed as dist
    cpu = _CpuDeviceModule()
    # device type and module (see _CpuDeviceModule): every module that copied them
    for mod in (m["tutils"], m["metrics"], m["dist_utils"], m["parallel_dims"]):
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = cpu
    # torch.distributed.set_timeout: torchtitan lowers the process groups' timeout
    # after the first step with it; torch 2.13 has no such function. A no-op here
    # (the test harness keeps its own gloo timeout).
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    # gloo has no ReduceOp.PREMUL_SUM: with torchtitan's
    # set_gradient_divide_factor(1.0), FSDP2 reduce-scatters with PREMUL_SUM(1.0)
    # ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). After torchtitan's own
    # disable_fsdp_gradient_division, every unit also gets FSDP2's
    # set_force_sum_reduction_for_comms(True) (a SUM, then the division by 1.0).
    import torchtitan.distributed.fsdp as tfsdp
    real = getattr(tfsdp.disable_fsdp_gradient_division, "__wrapped__",
                   tfsdp.disable_fsdp_gradient_division)

    def disable_fsdp_gradient_division(model):
        real(model)  # torchtitan's: set_gradient_divide_factor(1.0) on every unit
        units = [mod for mod in model.modules() if isinstance(mod, tfsdp.FSDPModule)]
        for mod in units:
            mod.set_force_sum_reduction_for_comms(True)
        _DIVIDE_FACTOR_UNITS.append(len(units))
    disable_fsdp_gradient_division.__wrapped__ = real
    tfsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _tokenizer(path: str) -> None:
    """A generated tokenizer (no download): word-level, 200 words and the two
    special tokens torchtitan's HuggingFaceTokenizer reads from
    tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    os.makedirs(path, exist_ok=True)
    vocab = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<unk>": 2}
    for i in range(200):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    import json
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)


def _texts() -> list:
    """Generated documents: 64 texts of 10-60 words, the same on every call."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(64):
        n = int(torch.randint(10, 60, (1,), generator=g))
        out.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (n,), generator=g)))
    return out


def _titan_config(m: dict, root: str, dump: str, *, steps: int, seed_ckpt: str | None,
                  tp: int = 1):
    """torchtitan's own llama3 debugmodel config (its config registry), with the
    test's small sizes, generated tokenizer and data, and checkpointing on;
    ``tp > 1``: tensor parallel inside the blocks, fully_shard over the data-
    parallel dim (dp 2 x tp, torchtitan's own 2-D plan)."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention

    texts = _texts()
    m["text_datasets"].DATASETS["stacks_generated"] = DatasetConfig(
        path="generated", loader=lambda path: Dataset.from_dict({"text": texts}),
        sample_processor=lambda sample: sample["text"])
    cfg = m["registry"].llama3_debugmodel()
    # Shim (both implementations): the debug model's attention is FlexAttention,
    # which torch 2.13 cannot differentiate on CPU ("FlexAttention does not
    # support backward on CPU") and which torchtitan compiles (inductor). Every
    # layer's inner attention is torch's SDPA instead (causal over the whole
    # sequence rather than block-causal per document; the same for both).
    for layer in cfg.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg.model_spec.model.layers = cfg.model_spec.model.layers[:TITAN_LAYERS]
    cfg.hf_assets_path = os.path.join(root, "tokenizer")
    cfg.dump_folder = dump
    cfg.training.local_batch_size = TITAN_BATCH
    cfg.training.seq_len = TITAN_SEQ
    cfg.training.steps = steps
    cfg.dataloader.dataset = "stacks_generated"
    cfg.validator.enable = False
    # Shim (both implementations): torchtitan's default SPMD backend, spmd_types,
    # passes fully_shard a dp_mesh_dims that torch 2.13's FSDP2 refuses for
    # parameters that are not already DTensors on the full mesh ("When
    # dp_mesh_dims is provided, all parameters must be DTensors ..."): the
    # pure-FSDP path is the "partial_dtensor" backend (DTensor for model-parallel
    # axes only; plain fully_shard over the data-parallel mesh).
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.debug.seed = 0
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = TITAN_SAVE_AT
    # Clipping (torchtitan's clip_grad_norm_: get_total_norm over the gradients,
    # full_tensor() of a DTensor norm, clip_grads_with_norm_) at a max norm above
    # these steps' norms (~1.5): the global norm is computed and the gradients
    # scaled by exactly 1.0, so that the losses stay bitwise comparable between
    # the two implementations (their norms are sums in different orders).
    cfg.training.max_norm = 2.0
    # the last step's checkpoint is never loaded here: the model only (torchtitan's
    # default; the debug config saves everything)
    cfg.checkpoint.last_save_model_only = True
    if tp > 1:
        cfg.parallelism.tensor_parallel_degree = tp
        cfg.parallelism.data_parallel_shard_degree = 2
    if seed_ckpt is not None:
        cfg.checkpoint.initial_load_path = seed_ckpt
        cfg.checkpoint.initial_load_model_only = True
    return cfg


def _record_losses(trainer) -> list:
    """(step, loss, grad norm, time) as the trainer logs them (every step),
    after ("load", what the checkpointer's load returned)."""
    rec: list = []
    real_load = trainer.checkpointer.load

    def load(*a, **k):
        ok = real_load(*a, **k)
        rec.append(("load", ok))
        return ok
    trainer.checkpointer.load = load
    real = trainer.metrics_processor.log

    def log(step, global_avg_loss, global_max_loss, grad_norm, *a, **k):
        rec.append((step, float(global_avg_loss), float(grad_norm), time.time()))
        return real(step, global_avg_loss, global_max_loss, grad_norm, *a, **k)
    trainer.metrics_processor.log = log
    return rec


def titan_seed(rank: int, world: int, root: str) -> str:
    """torchtitan's seed checkpoint (``create_seed_checkpoint``: one rank, the
    model built and initialised on CPU without sharding, saved at step 0):
    both implementations start from its weights."""
    m = import_titan()
    _titan_shims(m)
    _tokenizer(os.path.join(root, "tokenizer"))
    dump = os.path.join(root, "seed")
    cfg = _titan_config(m, root, dump, steps=1, seed_ckpt=None)
    cfg.checkpoint.create_seed_checkpoint = True
    trainer = cfg.build()
    trainer.checkpointer.save(curr_step=0, last_step=True)
    trainer.close()
    return os.path.join(dump, cfg.checkpoint.folder, "step-0")


def titan_run(rank: int, world: int, root: str, impl: str, seed_ckpt: str,
              tp: int = 1) -> dict:
    """One implementation: a Trainer trains TITAN_STEPS steps from the seed
    checkpoint, saving at TITAN_SAVE_AT (the uninterrupted run); a fresh
    Trainer in the same folder resumes from that step and trains to the end
    (``tp > 1``: the 2-D run, see ``_titan_config``).
    Returns what it reached: ``stage`` ("done" or where it failed), ``error``
    and ``traceback`` if it failed, the (step, loss, grad norm) records."""
    import fsdp_compose
    if impl == "ours":
        fsdp_compose.use_as_fsdp2()  # before torchtitan imports fully_shard
    out: dict = {"impl": impl, "rank": rank, "stage": "import", "times": {}}
    t0 = time.time()

    def stage(name):
        out["times"][out["stage"]] = round(time.time() - t0, 1)
        out["stage"] = name
    try:
        m = import_titan()
        _titan_shims(m)
        dump = os.path.join(root, f"titan_{impl}" + (f"_tp{tp}" if tp > 1 else ""))
        stage("build")
        trainer = _titan_config(m, root, dump, steps=TITAN_STEPS, seed_ckpt=seed_ckpt,
                                tp=tp).build()
        out["params"] = _param_facts(trainer.model_parts[0])
        out["divide_factor_units"] = list(_DIVIDE_FACTOR_UNITS)
        stage("train")
        rec = _record_losses(trainer)
        trainer.train()
        out["uninterrupted"] = rec
        trainer.close()
        stage("resume")
        cfg = _titan_config(m, root, dump, steps=TITAN_STEPS, seed_ckpt=seed_ckpt, tp=tp)
        cfg.checkpoint.load_step = TITAN_SAVE_AT
        trainer = cfg.build()
        rec = _record_losses(trainer)
        trainer.train()
        out["resumed"] = rec
        trainer.close()
        stage("done")
    except Exception as e:  # noqa: BLE001 - the parent reports it
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _param_facts(model) -> dict:
    """What the stack sees of the sharded parameters: whether the model is an
    FSDPModule (and whose), how many parameters are DTensors, their placements,
    whether their shapes are the unsharded ones."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard
    ps = list(model.named_parameters())
    dts = [p for _, p in ps if isinstance(p, DTensor)]
    return {"fsdp_module": isinstance(model, FSDPModule),
            "class_from": type(model).__mro__[1].__module__,
            "count": len(ps), "dtensor": len(dts),
            # as printed (a placement of ours may carry its split), and what it means
            "placements": sorted({str(tuple(p.placements)) for p in dts}),
            # (the tensor dim each mesh dim shards: FSDP2's _StridedShard is no
            # Shard subclass on torch 2.13, and shards a dim too)
            "shard_dims": sorted({tuple(pl.dim if isinstance(pl, Shard) or hasattr(pl, "dim")
                                        else type(pl).__name__
                                        for pl in p.placements) for p in dts}, key=str),
            "meshes": sorted({(p.device_mesh.ndim, p.device_mesh.size()) for p in dts}),
            "shapes": {n: tuple(p.shape) for n, p in ps}}


# ---------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------

LIT_EPOCHS, LIT_SAVE_AT = 2, 1        # train 2 epochs; the checkpoint ends epoch 1
LIT_BATCHES, LIT_BATCH, LIT_SEQ = 3, 2, 8   # per rank and epoch
LIT_VOCAB, LIT_D, LIT_HIDDEN = 64, 32, 65   # hidden 65: rows that do not split evenly
LIT_FORMATS = ("sharded", "full")  # save_distributed_checkpoint=True / False


def _lit_module_class():
    import pytorch_lightning as pl
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(LIT_D)
            self.up = nn.Linear(LIT_D, LIT_HIDDEN)
            self.down = nn.Linear(LIT_HIDDEN, LIT_D)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(LIT_VOCAB, LIT_D)
            self.layers = nn.ModuleList([Block() for _ in range(2)])
            self.head = nn.Linear(LIT_D, LIT_VOCAB)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    class LitLM(pl.LightningModule):
        """A LightningModule as Lightning's ModelParallelStrategy docs have it:
        the model built in ``__init__``, sharded in ``configure_model`` with
        ``fully_shard`` from torch.distributed.fsdp over the strategy's
        data-parallel mesh."""

        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.model = TinyLM()
            self.losses: list = []

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard  # ours after use_as_fsdp2()
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self.model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, LIT_VOCAB), ids[:, 1:].reshape(-1))
            self.losses.append((self.current_epoch, batch_idx, loss.item()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return LitLM


def _lit_data():
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, LIT_VOCAB, (2 * LIT_BATCHES * LIT_BATCH, LIT_SEQ + 1), generator=g)
    # Lightning puts a DistributedSampler (no shuffle) under it: 3 batches per rank
    return DataLoader(TensorDataset(ids), batch_size=LIT_BATCH, shuffle=False)


def _lit_trainer(root: str, distributed_ckpt: bool, callbacks=(), devices: int = 2):
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy
    # The harness has set torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
    # MASTER_*) and joined the gloo group: Lightning's environment sees processes
    # created externally and skips its own init; accelerator="cpu" gives a cpu mesh.
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                     save_distributed_checkpoint=distributed_ckpt)
    return pl.Trainer(accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy,
                      max_epochs=LIT_EPOCHS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=root, callbacks=list(callbacks))


def _full_params(module) -> dict:
    """Every parameter in full, on every rank (DCP's full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=False))
    return {k: v.detach().clone() for k, v in sd.items()}


def lit_run(rank: int, world: int, root: str, impl: str, fmt: str) -> dict:
    """One checkpoint format of ModelParallelStrategy ("sharded": a DCP folder;
    "full": ``save_distributed_checkpoint=False``'s single file): an
    uninterrupted fit of LIT_EPOCHS epochs that ``trainer.save_checkpoint``s at
    the end of epoch LIT_SAVE_AT, then a fresh module (another seed) and Trainer
    that ``fit(..., ckpt_path=)`` from it. Returns what it reached, as
    ``titan_run`` does."""
    import pytorch_lightning as pl

    import fsdp_compose
    if impl == "ours":
        fsdp_compose.use_as_fsdp2()
    LitLM = _lit_module_class()
    distributed = fmt == "sharded"
    path = os.path.join(root, f"lit{world}_{impl}_{fmt}" + ("" if distributed else ".ckpt"))
    res: dict = {"impl": impl, "rank": rank, "stage": "fit"}
    t0 = time.time()

    class SaveAt(pl.Callback):
        def on_train_epoch_end(self, trainer, module):
            if trainer.current_epoch + 1 == LIT_SAVE_AT:
                trainer.save_checkpoint(path)
    try:
        module = LitLM(seed=0)
        trainer = _lit_trainer(root, distributed, [SaveAt()], devices=world)
        trainer.fit(module, _lit_data())
        res["uninterrupted"] = module.losses
        res["params"] = _param_facts(module.model)
        res["full_after"] = _full_params(module.model)
        res["stage"] = "resume"
        module2 = LitLM(seed=1)
        trainer2 = _lit_trainer(root, distributed, devices=world)
        trainer2.fit(module2, _lit_data(), ckpt_path=path)
        res["resumed"] = module2.losses
        res["full_resumed"] = _full_params(module2.model)
        res["stage"] = "done"
    except Exception as e:  # noqa: BLE001 - the parent reports it
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    res["seconds"] = round(time.time() - t0, 1)
    return res


# ---------------------------------------------------------------------------
# The launches and the table
# ---------------------------------------------------------------------------

# What the ranks import (in the driver, once; see the module doc): torch's
# modules the stacks load, and the stacks' own dependencies. Not torchtitan
# itself: it binds fully_shard at import, before or after use_as_fsdp2().
_PREWARM = ("torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.checkpoint",
            "torch.distributed.fsdp", "torch.distributed.pipelining",
            "torch.distributed.tensor", "datasets", "tokenizers", "torchao", "torchdata",
            "pytorch_lightning")


def _prewarm() -> None:
    import importlib
    for name in _PREWARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the run that needs it reports it


def _run(fn, *args, timeout: float, world: int = 2) -> list:
    """``run_distributed`` on ``world`` ranks; a launch that fails as a whole (a
    rank that died or hung past ``timeout``) is one error for every rank."""
    from ._dist import DistributedError, run_distributed
    try:
        return run_distributed(fn, world, *args, timeout=timeout)
    except DistributedError as e:
        msg = str(e)
        return [{"stage": "launch", "error": msg.strip().splitlines()[-1],
                 "traceback": msg}] * world


_TITAN = ("torchtitan", "datasets", "tokenizers", "torchdata")
#: what each stack's runs import (tests/test_stacks.py skips a stack without them);
#: "torchtitan 2-D": its (dp 2, tp 2) run on 4 ranks
PACKAGES = {"torchtitan": _TITAN, "torchtitan 2-D": _TITAN, "Lightning": ("pytorch_lightning",),
            "Lightning 1 device": ("pytorch_lightning",)}
TITAN_TP = 2


def _launch_all(root: str, stacks) -> dict:
    from ._dist import DistributedError, run_distributed
    out: dict = {"seconds": {}}
    seed = None
    if "torchtitan" in stacks or "torchtitan 2-D" in stacks:
        try:
            seed = run_distributed(titan_seed, 1, root, timeout=300)[0]
        except DistributedError as e:
            out["titan_seed_error"] = str(e)
    for stack, key, world, tp in (("torchtitan", "titan", 2, 1),
                                  ("torchtitan 2-D", "titan2d", 4, TITAN_TP)):
        if stack not in stacks:
            continue
        t = time.time()
        for impl in ("fsdp2", "ours"):
            out[f"{key}_{impl}"] = (
                _run(titan_run, root, impl, seed, tp, timeout=400, world=world)
                if seed is not None else
                [{"stage": "seed", "error": "the seed checkpoint failed",
                  "traceback": out["titan_seed_error"]}] * world)
        out["seconds"][stack] = round(time.time() - t, 1)
    for stack, key, world in (("Lightning", "lit", 2), ("Lightning 1 device", "lit1", 1)):
        if stack not in stacks:
            continue
        t = time.time()
        for impl in ("fsdp2", "ours"):
            # a launch per format: a format that fails leaves no rank behind in the next
            fmts = {fmt: _run(lit_run, root, impl, fmt, timeout=300, world=world)
                    for fmt in LIT_FORMATS}
            out[f"{key}_{impl}"] = [{fmt: fmts[fmt][rank] for fmt in LIT_FORMATS}
                                    for rank in range(world)]
        out["seconds"][stack] = round(time.time() - t, 1)
    return out


def _driver(conn, root: str, stacks) -> None:
    import pickle
    try:
        _prewarm()
        payload = ("ok", _launch_all(root, stacks))
    except BaseException:  # noqa: BLE001 - to the caller
        payload = ("err", traceback.format_exc())
    # plain pickle: the connection's own (torch's reductions) would pass tensors as
    # shared-memory handles that die with this process
    conn.send_bytes(pickle.dumps(payload))
    conn.close()


def launches(stacks=("torchtitan", "Lightning"), timeout: float = 1500.0) -> dict:
    """Every run of the table for ``stacks``, from one temporary folder:
    torchtitan's seed checkpoint, then torchtitan and Lightning with FSDP2 and
    with ours; in a driver process (see the module doc) where fork exists, else
    here. Returns ``{"titan_fsdp2": [rank0, rank1], "titan_ours": ...,
    "lit_fsdp2": ..., "lit_ours": ..., "seconds": {stack: wall seconds}}``."""
    import multiprocessing as mp
    import pickle
    import tempfile
    with tempfile.TemporaryDirectory(prefix="fsdp_stacks_") as root:
        if "fork" not in mp.get_all_start_methods() or \
                os.environ.get("FSDP_TEST_START_METHOD") == "spawn":
            return _launch_all(root, stacks)
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_driver, args=(send, root, tuple(stacks)), name="stacks-driver")
        proc.start()
        send.close()
        try:
            if not recv.poll(timeout):
                raise TimeoutError(f"the stacks' launches did not end within {timeout:.0f}s")
            kind, value = pickle.loads(recv.recv_bytes())
        except EOFError:
            raise RuntimeError(f"the stacks' driver died (exit code {proc.exitcode})") from None
        finally:
            if proc.is_alive():
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if kind != "ok":
            raise RuntimeError(f"the stacks' driver failed:\n{value}")
        return value


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _losses(rec: list) -> list:
    return [(s, loss) for s, loss, *_ in (r for r in rec if r[0] != "load")]


def induced(error: str) -> bool:
    """Whether a rank's error only says that its peer went away."""
    return any(s in error for s in ("CollectiveStopped", "Connection closed",
                                    "Connection reset", "Broken pipe"))


def _failed(ranks: list, at: str | None = None) -> str | None:
    """The first rank's own error (not one that only saw its peer go away)."""
    errs = [r for r in ranks if "error" in r]
    if not errs:
        return None
    first = next((r for r in errs if not induced(r["error"])), errs[0])
    msg = first["error"].replace("|", "/").replace("`", "'").replace("\n", " ")
    if len(msg) > 160 and ". " in msg[:160]:
        msg = msg[:msg.index(". ") + 1]  # its first sentence
    if len(msg) > 160:
        msg = msg[:157] + "..."
    return f"fails at {at or first.get('stage', '?')}: `{msg}`"


def titan_cells(ranks: list, ref: list | None) -> list:
    """torchtitan's rows for one implementation (``ref``: FSDP2's, None for FSDP2)."""
    r0 = ranks[0]
    err = _failed(ranks)
    stage = r0.get("stage")
    order = ["import", "build", "train", "resume", "done"]
    reached = order.index(stage) if stage in order else -1

    def at(s):  # the cell of a step not reached, or the error of the one that failed
        return err if stage == s else "(not reached)"
    cells = []
    if reached > order.index("build") or stage == "done":
        facts = r0["params"]
        cells.append(f"builds; init_weights after sharding; {facts['dtensor']}/{facts['count']}"
                     f" parameters DTensor")
    else:
        cells.append(err or "?")
    if "uninterrupted" in r0:
        mine = _losses(r0["uninterrupted"])
        if ref is None:
            cells.append("trains: losses " + ", ".join(f"{v:.4f}" for _, v in mine))
        else:
            same = mine == _losses(ref[0].get("uninterrupted", []))
            cells.append("trains; losses = FSDP2's (bitwise)" if same else "trains; losses DIFFER")
        norms = [x[2] for x in r0["uninterrupted"] if x[0] != "load"]
        cells.append("global norm " + ", ".join(f"{n:.4f}" for n in norms) +
                     f"; divide factor 1.0 on {r0.get('divide_factor_units', ['?'])[0]} units")
    else:
        cells += [at("train")] * 2
    if "resumed" in r0:
        ok = all(_losses(r["resumed"]) == _losses(r["uninterrupted"])[TITAN_SAVE_AT:]
                 for r in ranks)
        cells.append("resumes bitwise" if ok else "resumes, losses DIFFER")
    else:
        cells.append(at("resume"))
    return cells


def lit_per_epoch(r: dict) -> int:
    """Steps per epoch of a run (its rank's share of the data)."""
    return len(r["uninterrupted"]) // LIT_EPOCHS


def lit_cells(ranks: list, ref: list | None) -> list:
    cells = []
    for fmt in LIT_FORMATS:
        res = [r[fmt] for r in ranks]
        err = _failed(res)
        if fmt == "sharded":  # training: the same in both formats' runs
            if "uninterrupted" in res[0]:
                facts = res[0]["params"]
                dt = f"; {facts['dtensor']}/{facts['count']} parameters DTensor"
                if ref is None:
                    cells.append(f"trains ({len(res[0]['uninterrupted'])} steps){dt}")
                else:
                    same = all(a["uninterrupted"] == b[fmt].get("uninterrupted")
                               and _same(a["full_after"], b[fmt].get("full_after", {}))
                               for a, b in zip(res, ref))
                    cells.append(("trains; losses and parameters = FSDP2's (bitwise)" if same
                                  else "trains; DIFFERS from FSDP2") + dt)
            else:
                cells.append(err or "?")
        if "resumed" in res[0]:
            ok = all(r["resumed"] == r["uninterrupted"][LIT_SAVE_AT * lit_per_epoch(r):]
                     and _same(r["full_resumed"], r["full_after"]) for r in res)
            cells.append("resumes bitwise" if ok else "resumes, DIFFERS")
        else:
            cells.append(err or "?")
    return cells


TITAN_STEPS_TEXT = [
    "llama3 debug model: meta, `parallelize_llama` (fully_shard), `init_weights`",
    f"train {TITAN_STEPS} steps from its seed checkpoint",
    "its clipping (`get_total_norm`, `clip_grads_with_norm_`), `set_gradient_divide_factor(1.0)`",
    f"`CheckpointManager` at step {TITAN_SAVE_AT}, a fresh `Trainer` resumes, steps "
    f"{TITAN_SAVE_AT + 1}-{TITAN_STEPS}",
]
LIT_STEPS_TEXT = [
    f"`configure_model` calls `fully_shard`; fit {LIT_EPOCHS} epochs",
    f"`save_checkpoint` (sharded DCP folder) at epoch {LIT_SAVE_AT}, `fit(ckpt_path=)`",
    "`save_checkpoint` (`save_distributed_checkpoint=False`, one file), `fit(ckpt_path=)`",
]


def table(out: dict) -> str:
    """Stack × step × result, FSDP2 and ours (from one call of ``launches``)."""
    from importlib.metadata import version  # (not the packages: see the module doc)
    rows = []
    for key, suffix in (("titan", ""), ("titan2d", f", (dp 2, tp {TITAN_TP}) on 4 ranks")):
        if f"{key}_fsdp2" in out:
            f2 = titan_cells(out[f"{key}_fsdp2"], None)
            ours = titan_cells(out[f"{key}_ours"], out[f"{key}_fsdp2"])
            name = f"torchtitan {version('torchtitan')}{suffix}"
            steps = TITAN_STEPS_TEXT if not suffix else [
                TITAN_STEPS_TEXT[0].replace("(fully_shard)", "(TP in each block, then "
                                            "fully_shard over dp)")] + TITAN_STEPS_TEXT[1:]
            rows += [(name, s, a, b) for s, a, b in zip(steps, f2, ours)]
    for key, suffix in (("lit", ""), ("lit1", ", 1 device")):
        if f"{key}_fsdp2" in out:
            f2 = lit_cells(out[f"{key}_fsdp2"], None)
            ours = lit_cells(out[f"{key}_ours"], out[f"{key}_fsdp2"])
            name = f"Lightning {version('pytorch-lightning')} `ModelParallelStrategy`{suffix}"
            rows += [(name, s, a, b) for s, a, b in zip(LIT_STEPS_TEXT, f2, ours)]
    lines = ["| stack (gloo ranks, CPU) | step | torch FSDP2 | fsdp_compose |",
             "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in out["seconds"].items())
    return "\n".join(lines) + f"\n\n(wall time, both implementations: {secs})"


if __name__ == "__main__":
    import importlib.util
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    have = [stack for stack, names in PACKAGES.items()
            if all(importlib.util.find_spec(n) is not None for n in names)]
    print(table(launches(have)))
